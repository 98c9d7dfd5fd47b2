// The sandboxes, as a table: filtered, sorted, and kept current by the event
// log (a change of state is an event: the list is read again after it, at
// most a few times a second), the clocks (age, idle, deadline, time spent)
// moving on their own between reads.

import { api, ApiError } from "./api.js";
import { recordSample } from "./plot.js";
import { bytes, duration, h, now, replace, stateBadge } from "./dom.js";

const ENDED = new Set(["terminated", "failed"]);
/** How often the list is read again without an event (memory moves on its own). */
const FIGURES_SECONDS = 15;
/** After an event, how long to wait for the others of its burst; and the least gap between reads. */
const EVENT_SETTLE_MS = 100;
const READ_GAP_MS = 500;

/** A sandbox's clocks as of `at`, from a description read at `read`. */
export function clocks(info, read, at = now()) {
  const since = info.state === "running" || info.state === "paused" ? Math.max(0, at - read) : 0;
  const meter = info.meter || {};
  const grow = (state, key) => (meter[key] ?? 0) + (info.state === state ? since : 0);
  return {
    age: info.created_at_unix ? at - info.created_at_unix : null,
    idle: info.state === "running" && info.idle_seconds !== null && info.idle_seconds !== undefined
      ? info.idle_seconds + since : info.idle_seconds,
    deadline: info.deadline_unix ? info.deadline_unix - at : null,
    running: grow("running", "running_s"),
    paused: grow("paused", "paused_s"),
    suspended: (meter.suspended_s ?? 0) + (info.state === "suspended" ? Math.max(0, at - read) : 0),
  };
}

const COLUMNS = [
  { key: "id", label: "ID", value: (s) => s.id,
    cell: (s) => h("a", { href: `#/sandboxes/${encodeURIComponent(s.id)}`, class: "mono" }, s.id) },
  { key: "provider", label: "Provider", value: (s) => s.provider },
  { key: "state", label: "State", value: (s) => s.state, cell: (s) => stateBadge(s.state) },
  { key: "age", label: "Age", num: true, clock: true, value: (s, c) => c.age, show: duration },
  { key: "idle", label: "Idle", num: true, clock: true, value: (s, c) => c.idle, show: duration },
  { key: "deadline", label: "Deadline", num: true, clock: true, value: (s, c) => c.deadline,
    show: (v) => (v === null ? "–" : v <= 0 ? "due" : `in ${duration(v)}`) },
  { key: "memory", label: "Memory", num: true, value: (s) => s.memory_bytes, show: bytes },
  { key: "disk", label: "Disk", num: true, value: (s) => s.disk_bytes ?? null, show: bytes },
  { key: "running", label: "Running", num: true, clock: true, value: (s, c) => c.running,
    show: duration },
  { key: "paused", label: "Paused", num: true, clock: true, value: (s, c) => c.paused,
    show: duration },
  { key: "suspended", label: "Suspended", num: true, clock: true, value: (s, c) => c.suspended,
    show: duration },
];

export function sandboxesView(main, { onEvent }) {
  let sandboxes = [];
  let readAt = now();
  let sort = { key: "age", dir: 1 };
  let error = null;

  const text = h("input", { type: "search", id: "filter", placeholder: "Filter: id, provider, workspace…" });
  const state = h("select", { id: "state-filter" },
    h("option", { value: "" }, "every state"),
    ["running", "paused", "suspended", "terminated", "failed"].map((s) => h("option", { value: s }, s)));
  const ended = h("input", { type: "checkbox", id: "show-ended" });
  const count = h("span", { class: "muted" });
  const head = h("tr");
  const body = h("tbody", { id: "sandbox-rows" });
  const notice = h("p", { class: "error" });

  for (const col of COLUMNS) {
    const th = h("th", { class: `sortable${col.num ? " num" : ""}`, dataset: { key: col.key } }, col.label);
    th.addEventListener("click", () => {
      sort = sort.key === col.key ? { key: col.key, dir: -sort.dir } : { key: col.key, dir: 1 };
      draw();
    });
    head.append(th);
  }
  replace(main,
    h("h1", {}, "Sandboxes"),
    h("div", { class: "toolbar" }, text, state, h("label", {}, ended, " show ended"), count),
    notice,
    h("table", { id: "sandboxes" }, h("thead", {}, head), body));

  function visible() {
    const words = text.value.trim().toLowerCase().split(/\s+/).filter(Boolean);
    return sandboxes.filter((s) => {
      if (state.value && s.state !== state.value) return false;
      const hay = `${s.id} ${s.provider} ${s.state} ${s.workspace || ""} ${s.reason || ""}`.toLowerCase();
      return words.every((w) => hay.includes(w));
    });
  }

  function draw() {
    const at = now();
    const col = COLUMNS.find((c) => c.key === sort.key);
    const rows = visible().map((s) => ({ s, c: clocks(s, readAt, at) }));
    rows.sort((a, b) => {
      const x = col.value(a.s, a.c), y = col.value(b.s, b.c);
      if (x === y) return a.s.id < b.s.id ? -1 : 1;
      if (x === null || x === undefined) return 1;
      if (y === null || y === undefined) return -1;
      return (x < y ? -1 : 1) * sort.dir;
    });
    for (const th of head.children) {
      th.classList.toggle("sorted-asc", th.dataset.key === sort.key && sort.dir === 1);
      th.classList.toggle("sorted-desc", th.dataset.key === sort.key && sort.dir === -1);
    }
    replace(body, rows.map(({ s, c }) => h("tr", { dataset: { id: s.id, state: s.state } },
      COLUMNS.map((col) => h("td", { class: [col.num ? "num" : "", `col-${col.key}`].join(" ").trim() },
        col.cell ? col.cell(s) : (col.show || String)(col.value(s, c)))))));
    if (!rows.length) {
      replace(body, h("tr", {}, h("td", { colspan: COLUMNS.length, class: "muted" },
        sandboxes.length ? "No sandbox matches." : "No sandboxes.")));
    }
    count.textContent = `${rows.length} of ${sandboxes.length}`;
    notice.textContent = error ? `Could not read the sandboxes: ${error}` : "";
  }

  // Reading the list: one at a time; asked for again while one runs, once more after it;
  // for events, at most one read every READ_GAP_MS however busy the log is.
  let reading = null, again = false, timer = null, lastRead = 0;
  async function read() {
    if (reading) { again = true; return reading; }
    lastRead = Date.now();
    reading = (async () => {
      try {
        const answer = await api("GET", `/v1/sandboxes${ended.checked ? "?all=true" : ""}`);
        sandboxes = answer.sandboxes;
        readAt = now();
        for (const s of sandboxes) if (!ENDED.has(s.state)) recordSample(s, readAt);
        error = null;
      } catch (failure) {
        if (failure instanceof ApiError && failure.status === 401) return;
        error = failure.message;
      }
      draw();
    })();
    await reading;
    reading = null;
    if (again) { again = false; read(); }
  }
  function soon() {
    if (timer !== null) return;
    const wait = Math.max(EVENT_SETTLE_MS, lastRead + READ_GAP_MS - Date.now());
    timer = setTimeout(() => { timer = null; read(); }, wait);
  }

  text.addEventListener("input", draw);
  state.addEventListener("change", draw);
  ended.addEventListener("change", read);
  const stopEvents = onEvent(() => soon());
  const tick = setInterval(draw, 1000);
  const figures = setInterval(read, FIGURES_SECONDS * 1000);
  read();
  return () => {
    stopEvents();
    clearInterval(tick);
    clearInterval(figures);
    if (timer !== null) clearTimeout(timer);
  };
}
