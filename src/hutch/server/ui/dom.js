// Building the page from data without HTML strings: every text the daemon
// gives (ids, file names, event messages) goes in as text, never as markup.

/** An element: `h("td", {class: "num"}, "12", child)`. */
export function h(tag, attrs = {}, ...children) {
  const el = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === undefined || value === null || value === false) continue;
    if (key.startsWith("on") && typeof value === "function") {
      el.addEventListener(key.slice(2), value);
    } else if (key === "dataset") {
      Object.assign(el.dataset, value);
    } else if (value === true) {
      el.setAttribute(key, "");
    } else {
      el.setAttribute(key, String(value));
    }
  }
  append(el, children);
  return el;
}

function append(el, children) {
  for (const child of children.flat(Infinity)) {
    if (child === undefined || child === null || child === false) continue;
    el.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
}

export function svg(tag, attrs = {}, ...children) {
  const el = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [key, value] of Object.entries(attrs)) el.setAttribute(key, String(value));
  append(el, children);
  return el;
}

export function replace(el, ...children) {
  el.replaceChildren();
  append(el, children);
}

export function stateBadge(state) {
  return h("span", { class: `state state-${state}`, "data-state": state }, state);
}

// -- figures ---------------------------------------------------------------------------------

export function duration(seconds) {
  if (seconds === null || seconds === undefined || Number.isNaN(seconds)) return "–";
  const s = Math.max(0, seconds);
  if (s < 60) return `${Math.floor(s)}s`;
  if (s < 3600) return `${Math.floor(s / 60)}m${String(Math.floor(s % 60)).padStart(2, "0")}s`;
  if (s < 86400) return `${Math.floor(s / 3600)}h${String(Math.floor((s % 3600) / 60)).padStart(2, "0")}m`;
  return `${Math.floor(s / 86400)}d${Math.floor((s % 86400) / 3600)}h`;
}

export function bytes(n) {
  if (n === null || n === undefined) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0, v = n;
  while (v >= 1024 && i < units.length - 1) { v /= 1024; i += 1; }
  return `${v >= 10 || i === 0 ? v.toFixed(0) : v.toFixed(1)} ${units[i]}`;
}

export function when(unix) {
  if (!unix) return "–";
  return new Date(unix * 1000).toLocaleString();
}

export function now() { return Date.now() / 1000; }

/** A passing message in the corner (`bad`: an error). */
export function toast(message, bad = false) {
  const box = document.getElementById("toast");
  const msg = h("div", { class: bad ? "msg bad" : "msg" }, message);
  box.append(msg);
  setTimeout(() => msg.remove(), bad ? 8000 : 3500);
}

/**
 * Ask before doing: the page's dialog, with an optional text field.
 * Resolves to null when cancelled, else to the field's text ("" without one).
 */
export function ask(title, message, { okLabel = "OK", danger = false, field = null } = {}) {
  const dialog = document.getElementById("ask");
  document.getElementById("ask-title").textContent = title;
  document.getElementById("ask-message").textContent = message;
  const ok = document.getElementById("ask-ok");
  ok.textContent = okLabel;
  ok.className = danger ? "danger" : "";
  const fieldBox = document.getElementById("ask-field");
  const input = document.getElementById("ask-input");
  fieldBox.hidden = !field;
  input.value = "";
  if (field) document.getElementById("ask-field-label").textContent = field;
  return new Promise((resolve) => {
    dialog.addEventListener("close", () => {
      resolve(dialog.returnValue === "ok" ? input.value.trim() : null);
    }, { once: true });
    dialog.returnValue = "";
    dialog.showModal();
    (field ? input : ok).focus();
  });
}
