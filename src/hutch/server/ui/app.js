// The dashboard: a login, then pages chosen by the address's #fragment (which
// holds page names and ids only, never a credential).

import { api, followLines, login, logout, onUnauthorized } from "./api.js";
import { h, replace } from "./dom.js";
import { definitionsView, poolsView, workspacesView } from "./lists.js";
import { sandboxView } from "./sandbox.js";
import { sandboxesView } from "./sandboxes.js";

const ROUTES = [
  [/^#\/sandboxes\/([^/]+)$/, sandboxView, "sandboxes"],
  [/^#\/sandboxes$/, sandboxesView, "sandboxes"],
  [/^#\/workspaces$/, workspacesView, "workspaces"],
  [/^#\/definitions$/, definitionsView, "definitions"],
  [/^#\/pools$/, poolsView, "pools"],
];

const view = document.getElementById("view");
const nav = document.getElementById("nav");
const live = document.getElementById("live");

let leaveView = null;   // what the current page does when left
let feed = null;        // the event log's stream, while logged in
const eventListeners = new Set();

/**
 * The event log, followed once for every page: `fn(event)` for each new
 * event, and `fn(null)` whenever the stream (re)opens, so a page catches up
 * with what it may have missed. Returns what unsubscribes.
 */
function onEvent(fn) {
  eventListeners.add(fn);
  return () => eventListeners.delete(fn);
}

function startFeed() {
  if (feed) return;
  feed = new AbortController();
  followLines("/v1/events/follow?limit=0", (event) => {
    eventListeners.forEach((fn) => fn(event));
  }, {
    signal: feed.signal,
    onState: (up) => {
      live.classList.toggle("on", up);
      live.title = up ? "live: following the event log" : "reconnecting…";
      if (up) eventListeners.forEach((fn) => fn(null));
    },
  });
}

function stopFeed() {
  if (feed) feed.abort();
  feed = null;
  live.classList.remove("on");
}

function leave() {
  if (leaveView) leaveView();
  leaveView = null;
}

function render() {
  leave();
  const hash = location.hash || "#/sandboxes";
  for (const [pattern, make, section] of ROUTES) {
    const match = hash.match(pattern);
    if (!match) continue;
    for (const link of nav.querySelectorAll("a[data-nav]")) {
      link.classList.toggle("current", link.dataset.nav === section);
    }
    replace(view);
    leaveView = make(view, { params: match.slice(1).map(decodeURIComponent), onEvent }) || null;
    return;
  }
  location.hash = "#/sandboxes";
}

function showLogin(message) {
  leave();
  stopFeed();
  nav.hidden = true;
  const input = h("input", { type: "password", name: "token", id: "token", required: true,
    autocomplete: "current-password", placeholder: "the daemon's token" });
  const error = h("p", { class: "error", id: "login-error", role: "alert" }, message || "");
  const form = h("form", { class: "card login", id: "login" },
    h("h1", {}, "hutch"),
    h("p", { class: "muted" }, "Log in with the daemon's token (HUTCH_TOKEN, or the file " +
      "api-token in its data directory)."),
    h("label", {}, "Token", input),
    error,
    h("button", { type: "submit" }, "Log in"));
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    error.textContent = "";
    try {
      await login(input.value);
    } catch (failure) {
      error.textContent = failure.status === 401 ? "Wrong token." : failure.message;
      input.select();
      return;
    }
    enter();
  });
  replace(view, form);
  input.focus();
}

function enter() {
  nav.hidden = false;
  startFeed();
  render();
}

async function start() {
  try {
    await api("GET", "/healthz");
  } catch (failure) {
    if (failure.status === 401) { showLogin(); return; }
    replace(view, h("p", { class: "error" }, `The daemon does not answer: ${failure.message}`));
    return;
  }
  enter();
}

onUnauthorized(() => showLogin("Your session has ended: log in again."));
window.addEventListener("hashchange", () => { if (!nav.hidden) render(); });
document.getElementById("logout").addEventListener("click", async () => {
  await logout();
  showLogin();
});
start();
