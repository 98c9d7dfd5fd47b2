// One sandbox: what it is, its buttons (pause, suspend, resume, snapshot,
// fork, kill), and its events, processes, files, lineage and figures.

import { api, apiBlob, ApiError, enc } from "./api.js";
import { ask, bytes, duration, h, now, replace, stateBadge, toast, when } from "./dom.js";
import { plot, recordHistory, recordSample, samplesOf } from "./plot.js";
import { clocks } from "./sandboxes.js";

const ENDED = new Set(["terminated", "failed"]);
/** How often the open sandbox is read again for its figures. */
const SAMPLE_SECONDS = 5;

export function sandboxView(main, { params: [id], onEvent }) {
  const base = `/v1/sandboxes/${enc(id)}`;
  let info = null, readAt = now(), tab = "events";
  const title = h("h1", {}, "Sandbox ", h("code", {}, id), " ", h("span", { id: "sandbox-state" }));
  const facts = h("div", { class: "facts card", id: "facts" });
  const actions = h("div", { class: "actions", id: "actions" });
  const notice = h("p", { class: "error" });
  const tabs = h("div", { class: "tabs", role: "tablist" });
  const panel = h("div", { class: "panel", id: "panel" });
  replace(main, h("p", {}, h("a", { href: "#/sandboxes" }, "← Sandboxes")), title, notice, facts,
    actions, tabs, panel);

  // -- what it is ------------------------------------------------------------------------------
  function drawFacts() {
    if (!info) return;
    const c = clocks(info, readAt);
    const meter = `${duration(c.running)} / ${duration(c.paused)} / ${duration(c.suspended)}`;
    const rows = [
      ["Provider", info.provider], ["State", stateBadge(info.state)], ["Reason", info.reason || "–"],
      ["Created", when(info.created_at_unix)], ["Age", duration(c.age)],
      ["Idle", duration(c.idle)],
      ["Deadline", c.deadline === null ? "none" : `in ${duration(c.deadline)}`],
      ["Memory", bytes(info.memory_bytes)], ["Disk", bytes(info.disk_bytes ?? null)],
      ["Running / paused / suspended", meter],
      ["Working directory", h("code", {}, info.workdir || "–")],
      ["Workspace", info.workspace || "–"],
      ["Started from snapshot", info.origin_snapshot_id ? h("code", {}, info.origin_snapshot_id) : "–"],
      ["Sessions attached", String((info.attachments || []).length)],
    ];
    replace(facts, rows.map(([k, v]) => h("div", {}, h("span", {}, k), v)));
    replace(document.getElementById("sandbox-state"), stateBadge(info.state));
  }

  async function read() {
    try {
      info = await api("GET", base);
      readAt = now();
      notice.textContent = "";
      if (!ENDED.has(info.state)) recordSample(info, readAt);
    } catch (failure) {
      if (failure instanceof ApiError && failure.status === 401) return;
      notice.textContent = failure.message;
    }
    drawFacts();
    drawActions();
    if (tab === "usage") showTab("usage");
  }

  // -- its buttons ------------------------------------------------------------------------------
  const busy = new Set();
  function button(name, label, enabled, run, cls = "") {
    return h("button", {
      type: "button", id: `do-${name}`, class: cls, disabled: !enabled || busy.size > 0,
      onclick: async () => {
        busy.add(name);
        drawActions();
        try {
          await run();
        } catch (failure) {
          toast(`${label}: ${failure.message}`, true);
        } finally {
          busy.delete(name);
          await read();
        }
      },
    }, busy.has(name) ? `${label}…` : label);
  }
  function drawActions() {
    if (!info) return;
    const s = info.state, caps = info.capabilities || {};
    const live = !ENDED.has(s);
    replace(actions,
      button("pause", "Pause", s === "running" && caps.pause !== false, async () => {
        await api("POST", `${base}/pause`);
        toast("Paused.");
      }),
      button("suspend", "Suspend", (s === "running" || s === "paused") && caps.suspend !== false,
        async () => {
          await api("POST", `${base}/suspend`);
          toast("Suspended.");
        }),
      button("resume", "Resume", s === "paused" || s === "suspended", async () => {
        await api("POST", `${base}/resume`);
        toast("Resumed.");
      }),
      button("snapshot", "Snapshot…", live && caps.snapshot !== false, async () => {
        const label = await ask("Snapshot", `Capture ${id}'s state? It stays as it is.`,
          { okLabel: "Snapshot", field: "Label (optional)" });
        if (label === null) return;
        const snap = await api("POST", `${base}/snapshots`, label ? { label } : {});
        toast(`Snapshot ${snap.id} taken.`);
        if (tab === "lineage") showTab("lineage");
      }),
      button("fork", "Fork…", live && caps.fork !== false, async () => {
        const label = await ask("Fork", `Snapshot ${id} and start a new sandbox from it?`,
          { okLabel: "Fork", field: "Label (optional)" });
        if (label === null) return;
        const answer = await api("POST", `${base}/fork`, label ? { label, count: 1 } : { count: 1 });
        toast(`Forked: ${answer.sandboxes.map((b) => b.id).join(", ")}.`);
        if (tab === "lineage") showTab("lineage");
      }),
      button("kill", "Kill…", live, async () => {
        const ok = await ask("Kill the sandbox", `End ${id}? Its processes stop and its ` +
          "state is removed; this cannot be undone.", { okLabel: "Kill", danger: true });
        if (ok === null) return;
        await api("DELETE", base);
        toast(`${id} killed.`);
      }, "danger"));
  }

  // -- its tabs ---------------------------------------------------------------------------------
  const TABS = { events: "Events", processes: "Processes", files: "Files", lineage: "Lineage",
    usage: "Memory and disk" };
  for (const [key, label] of Object.entries(TABS)) {
    tabs.append(h("button", { type: "button", role: "tab", id: `tab-${key}`, dataset: { tab: key },
      onclick: () => showTab(key) }, label));
  }
  let events = [];
  function showTab(key) {
    tab = key;
    for (const b of tabs.children) b.classList.toggle("current", b.dataset.tab === key);
    ({ events: drawEvents, processes: showProcesses, files: () => showFiles(null),
      lineage: showLineage, usage: drawUsage })[key]();
  }

  // The daemon's samples from before this page opened: the plots start from them.
  async function readHistory() {
    try {
      recordHistory(id, (await api("GET", `${base}/meters`)).samples);
    } catch (failure) {
      if (!(failure instanceof ApiError && failure.status === 401)) toast(failure.message, true);
      return;
    }
    if (tab === "usage") drawUsage();
  }

  async function readEvents() {
    try {
      events = (await api("GET", `/v1/events?subject=${enc(id)}&limit=500`)).events;
    } catch (failure) {
      if (!(failure instanceof ApiError && failure.status === 401)) toast(failure.message, true);
    }
    if (tab === "events") drawEvents();
  }
  function drawEvents() {
    replace(panel, h("table", { id: "events" },
      h("thead", {}, h("tr", {}, h("th", {}, "When"), h("th", {}, "Kind"), h("th", {}, "What"))),
      h("tbody", {}, [...events].reverse().map((e) => h("tr", { dataset: { kind: e.kind } },
        h("td", {}, when(e.at_unix)), h("td", {}, e.kind), h("td", { class: "wrap" }, e.message))),
      events.length ? null : h("tr", {}, h("td", { colspan: 3, class: "muted" }, "No events.")))));
  }

  function wakes(what, then) {
    // Reading a suspended sandbox's files or processes would resume it: asked, not done.
    replace(panel, h("p", { class: "muted" }, `The sandbox is ${info.state}: `,
      `looking at its ${what} resumes it. `),
    h("button", { type: "button", class: "quiet", onclick: then }, `Show its ${what} anyway`));
  }

  async function showProcesses(force = false) {
    if (!info) return;
    if (ENDED.has(info.state)) { replace(panel, h("p", { class: "muted" }, "It has ended.")); return; }
    if (info.state !== "running" && !force) { wakes("processes", () => showProcesses(true)); return; }
    let list;
    try {
      list = (await api("GET", `${base}/processes`)).processes;
    } catch (failure) {
      replace(panel, h("p", { class: "error" }, failure.message));
      return;
    }
    replace(panel, h("div", { class: "toolbar" },
      h("button", { type: "button", class: "quiet", onclick: () => showProcesses(true) }, "Reload")),
    h("table", { id: "processes" },
      h("thead", {}, h("tr", {}, ["ID", "Command", "Running", "Exit code", ""].map((t) => h("th", {}, t)))),
      h("tbody", {}, list.map((p) => h("tr", {},
        h("td", { class: "mono" }, p.id), h("td", { class: "mono wrap" }, p.command),
        h("td", {}, p.running ? "yes" : "no"), h("td", {}, p.exit_code ?? "–"),
        h("td", {}, p.running ? h("button", { type: "button", class: "quiet", onclick: async () => {
          if (await ask("Kill the process", `Kill ${p.id} (${p.command})?`,
            { okLabel: "Kill", danger: true }) === null) return;
          try { await api("POST", `${base}/processes/${enc(p.id)}/kill`); } catch (f) { toast(f.message, true); }
          showProcesses(true);
        } }, "Kill…") : null))),
      list.length ? null : h("tr", {}, h("td", { colspan: 5, class: "muted" },
        "No background processes.")))));
  }

  let cwd = null;
  async function showFiles(path, force = false) {
    if (!info) return;
    if (ENDED.has(info.state)) { replace(panel, h("p", { class: "muted" }, "It has ended.")); return; }
    if (info.state !== "running" && !force) { wakes("files", () => showFiles(path, true)); return; }
    cwd = path ?? cwd ?? info.workdir ?? ".";
    let entries;
    try {
      entries = (await api("GET", `${base}/list?path=${enc(cwd)}`)).entries;
    } catch (failure) {
      replace(panel, h("p", { class: "error" }, `${cwd}: ${failure.message}`));
      return;
    }
    entries.sort((a, b) => (a.type === "directory") === (b.type === "directory")
      ? (a.path < b.path ? -1 : 1) : (a.type === "directory" ? -1 : 1));
    const parts = cwd.split("/").filter(Boolean);
    const crumbs = [h("button", { type: "button", class: "quiet", onclick: () => showFiles("/", true) }, "/")];
    parts.forEach((part, i) => crumbs.push(h("button", { type: "button", class: "quiet",
      onclick: () => showFiles(`/${parts.slice(0, i + 1).join("/")}`, true) }, part), "/"));
    const name = (e) => e.path.split("/").filter(Boolean).pop() || e.path;
    const full = (e) => (e.path.startsWith("/") ? e.path : `${cwd.replace(/\/$/, "")}/${e.path}`);
    replace(panel, h("div", { class: "crumbs mono", id: "crumbs" }, crumbs),
      h("table", { id: "files" },
        h("thead", {}, h("tr", {}, ["Name", "Type", "Size", "Modified", ""].map((t) => h("th", {}, t)))),
        h("tbody", {}, entries.map((e) => h("tr", { dataset: { path: full(e) } },
          h("td", { class: "mono" }, e.type === "directory"
            ? h("a", { href: "#", onclick: (ev) => { ev.preventDefault(); showFiles(full(e), true); } }, `${name(e)}/`)
            : name(e)),
          h("td", {}, e.type), h("td", { class: "num" }, e.type === "file" ? bytes(e.size) : ""),
          h("td", {}, when(e.mtime)),
          h("td", {}, e.type === "file" ? h("button", { type: "button", class: "quiet",
            onclick: () => download(full(e), name(e)) }, "Download") : null))),
        entries.length ? null : h("tr", {}, h("td", { colspan: 5, class: "muted" }, "Empty.")))));
  }
  async function download(path, name) {
    try {
      const blob = await apiBlob(`${base}/files?path=${enc(path)}`);
      const url = URL.createObjectURL(blob);
      const link = h("a", { href: url, download: name });
      document.body.append(link);
      link.click();
      link.remove();
      setTimeout(() => URL.revokeObjectURL(url), 10000);
    } catch (failure) {
      toast(`${path}: ${failure.message}`, true);
    }
  }

  async function showLineage() {
    let snapshots, sandboxes;
    try {
      [snapshots, sandboxes] = await Promise.all([
        api("GET", "/v1/snapshots").then((a) => a.snapshots),
        api("GET", "/v1/sandboxes?all=true").then((a) => a.sandboxes)]);
    } catch (failure) {
      replace(panel, h("p", { class: "error" }, failure.message));
      return;
    }
    if (tab !== "lineage") return;
    const snapById = new Map(snapshots.map((s) => [s.id, s]));
    const boxById = new Map(sandboxes.map((s) => [s.id, s]));
    if (info && !boxById.has(id)) boxById.set(id, info);
    // Up from this sandbox through the snapshots it came from, to the first.
    let root = id;
    for (let depth = 0; depth < 50; depth += 1) {
      const origin = boxById.get(root)?.origin_snapshot_id;
      const from = origin && snapById.get(origin);
      if (!from || !from.sandbox_id) break;
      root = from.sandbox_id;
    }
    const seen = new Set();
    function sandboxNode(sid) {
      if (seen.has(sid)) return h("li", {}, h("code", {}, sid));
      seen.add(sid);
      const box = boxById.get(sid);
      const mine = snapshots.filter((s) => s.sandbox_id === sid)
        .sort((a, b) => a.created_at_unix - b.created_at_unix);
      return h("li", { dataset: { sandbox: sid } },
        h("span", { class: sid === id ? "self" : "" }, "sandbox ",
          sid === id ? h("code", {}, sid) : h("a", { href: `#/sandboxes/${enc(sid)}` }, h("code", {}, sid)),
          " ", box ? stateBadge(box.state) : h("span", { class: "muted" }, "(gone)")),
        mine.length ? h("ul", {}, mine.map(snapshotNode)) : null);
    }
    function snapshotNode(snap) {
      const children = sandboxes.filter((s) => s.origin_snapshot_id === snap.id);
      return h("li", { dataset: { snapshot: snap.id } },
        "snapshot ", h("code", {}, snap.id), snap.label ? ` “${snap.label}”` : "",
        h("span", { class: "muted" }, ` · ${bytes(snap.size_bytes)} · ${when(snap.created_at_unix)}`,
          snap.parent_id ? ` · over ${snap.parent_id}` : ""),
        children.length ? h("ul", {}, children.map((c) => sandboxNode(c.id))) : null);
    }
    replace(panel, h("ul", { class: "tree", id: "lineage" }, sandboxNode(root)));
  }

  function drawUsage() {
    const samples = samplesOf(id);
    replace(panel, h("div", { class: "plots", id: "usage" },
      plot("Memory", samples.map((s) => ({ at: s.at, value: s.memory, daemon: s.daemon })), bytes),
      plot("Disk", samples.map((s) => ({ at: s.at, value: s.disk, daemon: s.daemon })), bytes)),
    h("p", { class: "muted" }, "The daemon's samples of the last hour while it ran, then " +
      `every ${SAMPLE_SECONDS} s while this page is open and whenever the sandboxes page ` +
      "reads the list."));
  }

  // -- kept current -----------------------------------------------------------------------------
  let timer = null;
  const stopEvents = onEvent((event) => {
    if (event === null) { readEvents(); read(); return; }
    if (event.subject !== id) return;
    if (!events.some((e) => e.seq === event.seq)) events.push(event);
    if (tab === "events") drawEvents();
    if (timer === null) timer = setTimeout(() => { timer = null; read(); }, 100);
  });
  const tick = setInterval(drawFacts, 1000);
  const sampler = setInterval(() => { if (info && !ENDED.has(info.state)) read(); }, SAMPLE_SECONDS * 1000);
  read().then(() => showTab("events"));
  readEvents();
  readHistory();
  return () => {
    stopEvents();
    clearInterval(tick);
    clearInterval(sampler);
    if (timer !== null) clearTimeout(timer);
  };
}
