// A job's K-FAC intervals per layer over time and why they changed: its intervals records
// (GET /v1/jobs/{id}/metrics?kind=intervals, then the event stream's), drawn as each layer's
// inverse-update interval against the step, with the staleness each layer last measured and
// every change with its reason. Only jobs that measure staleness (kfac: auto adapts from it)
// send them: for the others the section stays hidden.

import { api } from "./api.js";
import { fmt, h } from "./dom.js";

const degrees = (value) => (value === undefined || value === null || value < 0 ? "–" : `${value.toFixed(2)}°`);
const rung = (pair) => `${pair[0]} / ${pair[1]}`;

/** The intervals of job ``id`` in ``box``: ``load()`` reads the history (again after a
 *  reconnection); ``add(record)`` takes a streamed intervals record (true if it was one). */
export function intervals(box, id, sets, signal) {
  const kind = sets.kind.intervals;
  let records = [];
  let early = [];
  let loaded = false;
  box.hidden = true;
  const chart = h("div", { class: "chart", id: "chart-intervals" });
  const layers = h("table", { class: "intervals", id: "interval-layers" });
  const changes = h("ol", { class: "interval-changes", id: "interval-changes" });
  const summary = h("p", { class: "muted" });
  box.append(h("h2", {}, "K-FAC intervals per layer"), summary, chart, layers,
    h("h3", {}, "Why they changed"), changes);

  function series() {
    // Each layer's intervals at each record, and at each change's step (a step line).
    const byLayer = new Map();
    for (const record of records) {
      for (const change of record.values.changes || []) {
        const points = byLayer.get(change.layer) || [];
        if (!points.length) points.push({ step: 0, inv: change.before[1] });
        points.push({ step: change.step, inv: change.after[1] });
        byLayer.set(change.layer, points);
      }
      for (const layer of record.values.layers || []) {
        const points = byLayer.get(layer.layer) || [{ step: 0, inv: layer.inv_update_steps }];
        points.push({ step: record.step, inv: layer.inv_update_steps });
        byLayer.set(layer.layer, points);
      }
    }
    return byLayer;
  }

  function draw() {
    if (!records.length) { box.hidden = true; return; }
    box.hidden = false;
    const last = records[records.length - 1].values;
    const all = records.flatMap((r) => r.values.changes || []);
    summary.textContent = last.adaptive
      ? `Each layer's factor and inverse intervals adapt to how stale its curvature is: ${all.length} change(s) so far, to step ${fmt(last.step)}.`
      : `Fixed intervals, staleness measured: to step ${fmt(last.step)}.`;
    if (typeof Plotly !== "undefined") {
      const traces = [...series()].map(([name, points]) => {
        points.sort((a, b) => a.step - b.step);
        return { x: points.map((p) => p.step), y: points.map((p) => p.inv), name, mode: "lines",
                 line: { shape: "hv" }, type: "scatter" };
      });
      Plotly.react(chart, traces, {
        title: { text: "Inverse-update interval", font: { size: 14 }, x: 0.02, xanchor: "left" },
        margin: { l: 50, r: 10, t: 40, b: 40 }, height: 260,
        legend: { orientation: "h", x: 1, xanchor: "right", y: 1.02, yanchor: "bottom" },
        xaxis: { title: { text: "step" } }, yaxis: { title: { text: "steps" }, type: "log" },
      }, { displayModeBar: false, responsive: true });
      chart.dataset.points = traces.reduce((n, t) => n + t.x.length, 0);
    }
    layers.replaceChildren(
      h("thead", {}, h("tr", {}, ["layer", "factor / inverse every", "staleness (angle)",
        "A moved", "G moved", "why"].map((c) => h("th", {}, c)))),
      h("tbody", {}, (last.layers || []).map((layer) => h("tr", { "data-layer": layer.layer },
        h("td", {}, layer.layer),
        h("td", { class: "num" }, rung([layer.factor_update_steps, layer.inv_update_steps])),
        h("td", { class: "num" }, degrees(layer.angle)),
        h("td", { class: "num" }, layer.interval_change_a < 0 ? "–" : fmt(layer.interval_change_a)),
        h("td", { class: "num" }, layer.interval_change_g < 0 ? "–" : fmt(layer.interval_change_g)),
        h("td", {}, layer.reason)))));
    changes.replaceChildren(...all.map((c) => h("li", {},
      h("b", {}, `step ${fmt(c.step)}: ${c.layer} ${rung(c.before)} → ${rung(c.after)}`), ` ${c.reason}`)));
  }

  function add(record) {
    if (record.kind !== kind) return false;
    const point = { step: record.step, values: record };
    if (!loaded) { early.push(point); return true; }
    if (records.length && point.step <= records[records.length - 1].step) return true;
    records.push(point);
    draw();
    return true;
  }

  async function load() {
    loaded = false;
    early = [];
    const fresh = [];
    let since = 0;
    for (;;) {
      const page = await api(`/v1/jobs/${id}/metrics?kind=${kind}&since=${since}&limit=10000`, { signal });
      for (const p of page.points) fresh.push({ step: p.step, values: p.values });
      if (page.points.length < 10000) break;
      since = page.next_since;
    }
    records = fresh;
    const lastStep = records.length ? records[records.length - 1].step : -1;
    for (const point of early) if (point.step > lastStep) records.push(point);
    loaded = true;
    draw();
  }

  return { add, load };
}
