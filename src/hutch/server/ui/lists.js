// Workspaces, definitions and warm pools: what the daemon keeps besides
// its sandboxes, each a table read again when the event log moves.

import { api, ApiError, enc } from "./api.js";
import { ask, h, replace, stateBadge, toast, when } from "./dom.js";

/** A page that is a table read from `path`, drawn by `draw(rows)`. */
function listPage(main, onEvent, { title, path, key, draw, note }) {
  const body = h("div");
  replace(main, h("h1", {}, title), note ? h("p", { class: "muted" }, note) : null, body);
  let timer = null;
  async function read() {
    try {
      const rows = (await api("GET", path))[key];
      replace(body, rows.length ? draw(rows, read) : h("p", { class: "muted" }, `No ${title.toLowerCase()}.`));
    } catch (failure) {
      if (!(failure instanceof ApiError && failure.status === 401)) {
        replace(body, h("p", { class: "error" }, failure.message));
      }
    }
  }
  const stop = onEvent(() => {
    if (timer === null) timer = setTimeout(() => { timer = null; read(); }, 200);
  });
  read();
  return () => { stop(); if (timer !== null) clearTimeout(timer); };
}

function table(id, headers, rows) {
  return h("table", { id }, h("thead", {}, h("tr", {}, headers.map((t) => h("th", {}, t)))),
    h("tbody", {}, rows));
}

function sandboxLink(sid) {
  return sid ? h("a", { href: `#/sandboxes/${enc(sid)}`, class: "mono" }, sid) : "–";
}

export function workspacesView(main, { onEvent }) {
  return listPage(main, onEvent, {
    title: "Workspaces", path: "/v1/workspaces", key: "workspaces",
    note: "A workspace keeps its state across sandboxes: suspended, it lives in a snapshot.",
    draw: (rows, again) => table("workspaces",
      ["Name", "Status", "Provider", "Live sandbox", "State snapshot", "Created", "Last active", ""],
      rows.map((w) => h("tr", { dataset: { name: w.name } },
        h("td", { class: "mono" }, w.name), h("td", {}, stateBadge(w.status)), h("td", {}, w.provider),
        h("td", {}, sandboxLink(w.live_sandbox_id)), h("td", { class: "mono" }, w.state_snapshot_id || "–"),
        h("td", {}, when(w.created_at_unix)), h("td", {}, when(w.last_active_unix)),
        h("td", {}, w.live_sandbox_id
          ? h("button", { type: "button", class: "quiet", onclick: async () => {
            if (await ask("Suspend the workspace", `Keep ${w.name}'s state in a snapshot and ` +
              "end its sandbox?", { okLabel: "Suspend" }) === null) return;
            try { await api("POST", `/v1/workspaces/${enc(w.name)}/suspend`, {}); } catch (f) { toast(f.message, true); }
            again();
          } }, "Suspend…")
          : h("button", { type: "button", class: "quiet", onclick: async () => {
            try { await api("POST", `/v1/workspaces/${enc(w.name)}/resume`); } catch (f) { toast(f.message, true); }
            again();
          } }, "Resume"))))),
  });
}

export function definitionsView(main, { onEvent }) {
  return listPage(main, onEvent, {
    title: "Definitions", path: "/v1/definitions", key: "definitions",
    note: "Sandbox definitions: how to make a sandbox ready (hutch.toml's and those PUT).",
    draw: (rows) => table("definitions", ["ID", "Provider", "Tenant", "Definition"],
      rows.map((d) => h("tr", { dataset: { id: d.id ?? "" } },
        h("td", { class: "mono" }, d.id ?? "–"),
        h("td", {}, (d.provider && (d.provider.type || d.provider)) || "–"),
        h("td", {}, d.tenant ?? "–"),
        h("td", {}, h("details", {}, h("summary", {}, "settings"),
          h("pre", { class: "json" }, JSON.stringify(d, null, 2))))))),
  });
}

export function poolsView(main, { onEvent }) {
  return listPage(main, onEvent, {
    title: "Pools", path: "/v1/pools", key: "pools",
    note: "Warm pools keep sandboxes ready: a create that matches one takes a sandbox from it.",
    draw: (rows, again) => table("pools", ["Name", "Provider", "Size", "Ready", "Hits", "Settings", ""],
      rows.map((p) => h("tr", { dataset: { name: p.name } },
        h("td", { class: "mono" }, p.name), h("td", {}, p.provider),
        h("td", { class: "num" }, p.size), h("td", { class: "num" }, p.ready),
        h("td", { class: "num" }, p.hits),
        h("td", {}, h("details", {}, h("summary", {}, "settings"),
          h("pre", { class: "json" }, JSON.stringify(p.settings, null, 2)))),
        h("td", {},
          h("button", { type: "button", class: "quiet", onclick: async () => {
            const size = await ask("Resize the pool", `How many sandboxes should ${p.name} keep ready?`,
              { okLabel: "Resize", field: "Size" });
            if (size === null) return;
            if (!/^\d+$/.test(size)) { toast("The size is a whole number.", true); return; }
            try {
              await api("PUT", `/v1/pools/${enc(p.name)}`, { settings: p.settings, size: Number(size) });
            } catch (f) { toast(f.message, true); }
            again();
          } }, "Resize…"), " ",
          h("button", { type: "button", class: "quiet", onclick: async () => {
            if (await ask("Remove the pool", `Remove ${p.name} and free the sandboxes it keeps?`,
              { okLabel: "Remove", danger: true }) === null) return;
            try { await api("DELETE", `/v1/pools/${enc(p.name)}`); } catch (f) { toast(f.message, true); }
            again();
          } }, "Remove…"))))),
  });
}
