// Memory and disk over time: the daemon's own samples of the last hour
// (GET /v1/sandboxes/{id}/meters, read when a sandbox's page opens), and
// those taken from every description the page reads after (the list's, a
// sandbox's), kept while the dashboard is open, drawn as small inline SVG
// plots.

import { h, svg } from "./dom.js";

/** The most samples kept per sandbox (an hour at one every 5 s). */
const KEEP = 720;
const history = new Map();

/** Keep a sandbox's figures of a description read at `at` (unix seconds). */
export function recordSample(info, at) {
  let samples = history.get(info.id);
  if (!samples) history.set(info.id, (samples = []));
  const last = samples[samples.length - 1];
  if (last && at - last.at < 1) return;
  samples.push({ at, memory: info.memory_bytes ?? null, disk: info.disk_bytes ?? null });
  if (samples.length > KEEP) samples.splice(0, samples.length - KEEP);
}

/**
 * Take in the daemon's samples of a sandbox (its meters history, oldest
 * first): over the time they span they are the figures, the page's own kept
 * only before and after it.
 */
export function recordHistory(id, samples) {
  if (samples.length === 0) return;
  const first = samples[0].at_unix, last = samples[samples.length - 1].at_unix;
  const kept = history.get(id) || [];
  history.set(id, [
    ...kept.filter((k) => k.at < first),
    ...samples.map((s) => ({ at: s.at_unix, memory: s.memory_bytes ?? null,
      disk: s.disk_bytes ?? null, daemon: true })),
    ...kept.filter((k) => k.at > last),
  ].slice(-KEEP));
}

export function samplesOf(id) {
  return history.get(id) || [];
}

/**
 * A small plot of `points` ({at, value}; value null where there was none),
 * `show` formatting a value for its labels.
 */
export function plot(title, points, show, { width = 320, height = 90 } = {}) {
  const known = points.filter((p) => p.value !== null && p.value !== undefined);
  const box = h("figure", { class: "plot", "data-plot": title.toLowerCase(),
    "data-samples": String(known.length),
    "data-from-daemon": String(known.filter((p) => p.daemon).length) },
  h("figcaption", {}, title));
  if (known.length === 0) {
    box.append(h("p", { class: "muted" }, "No figure reported yet."));
    return box;
  }
  const pad = 4;
  const t0 = known[0].at, t1 = Math.max(known[known.length - 1].at, t0 + 1);
  const max = Math.max(...known.map((p) => p.value), 1);
  const x = (t) => pad + ((t - t0) / (t1 - t0)) * (width - 2 * pad);
  const y = (v) => height - pad - (v / max) * (height - 2 * pad);
  const path = known.map((p, i) => `${i ? "L" : "M"}${x(p.at).toFixed(1)},${y(p.value).toFixed(1)}`).join(" ");
  const area = `${path} L${x(known[known.length - 1].at).toFixed(1)},${height - pad} L${x(t0).toFixed(1)},${height - pad} Z`;
  box.append(
    svg("svg", { width, height, viewBox: `0 0 ${width} ${height}`, role: "img",
      "aria-label": `${title} over time` },
      svg("path", { class: "area", d: area }),
      svg("path", { class: "line", d: path })),
    h("div", { class: "muted" },
      `now ${show(known[known.length - 1].value)} · peak ${show(max)} · ` +
      `${known.length} samples over ${Math.round(t1 - t0)} s`));
  return box;
}
