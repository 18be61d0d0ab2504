// A job's training curves: its metric history (GET /v1/jobs/{id}/metrics) and the step and
// eval records its event stream brings, drawn with Plotly against the step or the time.

import { api } from "./api.js";
import { h } from "./dom.js";

/** The charts of a job as the registry describes them: each trace a metric (its record kind
 *  and field) that names the chart. */
function chartsOf(sets) {
  return sets.charts.map((chart) => ({
    id: `chart-${chart.id}`, title: chart.title, y: chart.y,
    percent: chart.unit === sets.unit.fraction,
    traces: sets.metrics.filter((m) => m.chart === chart.id)
      .map((m) => ({ kind: m.kind, field: m.field, name: m.label })),
  }));
}

/** The curves of job ``id`` in ``box``: ``load()`` reads the history (again after a
 *  reconnection); ``add(kind, point)`` takes a streamed record (kept until the history is
 *  in, then merged after it); ``draw(now)`` redraws (at most twice a second unless now). */
export function curves(box, id, sets, signal) {
  const kind = sets.kind;
  const charts = chartsOf(sets);
  const points = { [kind.step]: [], [kind.eval]: [] };
  let xAxis = "step";
  let lastSeq = -1; // the history's last record (both kinds share the job's sequence)
  let early = [];
  let loaded = false;
  let pending = null;
  const state = { drawn: false };

  const plots = h("div", { class: "charts" });
  for (const chart of charts) plots.append(h("div", { class: "chart", id: chart.id }));
  const axisToggle = h("div", { class: "axis", role: "group", "aria-label": "x axis" },
    ["step", "time"].map((axis) => h("button", {
      type: "button", class: axis === xAxis ? "chip on" : "chip", "data-axis": axis,
      onclick: (event) => {
        xAxis = axis;
        for (const b of axisToggle.children) b.classList.toggle("on", b === event.target);
        draw(true);
      },
    }, axis === "step" ? "against step" : "against wall-clock time")));
  box.append(h("div", { class: "heading" }, h("h2", {}, "Training curves"), axisToggle), plots);

  function draw(now) {
    if (typeof Plotly === "undefined") return;
    if (!now) { // at most twice a second while events stream in
      pending = pending || setTimeout(() => { pending = null; draw(true); }, 500);
      return;
    }
    for (const chart of charts) {
      const traces = chart.traces.map((t) => {
        const series = points[t.kind].filter((p) => typeof p.values[t.field] === "number");
        return {
          x: series.map((p) => (xAxis === "step" ? p.step : new Date(p.time * 1000))),
          y: series.map((p) => p.values[t.field]),
          name: t.name, mode: t.kind === kind.eval ? "lines+markers" : "lines", type: "scatter",
        };
      }).filter((t) => t.x.length);
      const layout = {
        title: { text: chart.title, font: { size: 14 }, x: 0.02, xanchor: "left" },
        margin: { l: 50, r: 10, t: 40, b: 40 }, height: 260,
        legend: { orientation: "h", x: 1, xanchor: "right", y: 1.02, yanchor: "bottom" },
        xaxis: { title: { text: xAxis === "step" ? "step" : "wall-clock time" } },
        yaxis: { title: { text: chart.y }, tickformat: chart.percent ? ".0%" : "" },
      };
      Plotly.react(chart.id, traces, layout, { displayModeBar: false, responsive: true });
      const node = document.getElementById(chart.id);
      node.dataset.points = traces.reduce((n, t) => n + t.x.length, 0);
    }
    state.drawn = true;
    plots.dataset.drawn = "true";
  }

  function put(recordKind, point) {
    if (point.seq <= lastSeq) return; // already in the history
    points[recordKind].push(point);
  }

  /** A streamed step or eval record; true if it was one. */
  function add(record) {
    if (record.kind !== kind.step && record.kind !== kind.eval) return false;
    const point = { seq: record.seq, step: record.step, time: record.time, values: record };
    if (!loaded) { early.push([record.kind, point]); return true; }
    put(record.kind, point);
    draw(false);
    return true;
  }

  async function load() {
    loaded = false;
    early = [];
    const fresh = { [kind.step]: [], [kind.eval]: [] };
    let last = -1;
    let since = 0;
    for (;;) {
      const page = await api(
        `/v1/jobs/${id}/metrics?kind=${kind.step}&kind=${kind.eval}&since=${since}&limit=10000`,
        { signal });
      for (const p of page.points) {
        const point = { seq: p.seq, step: p.step, time: Date.parse(p.at) / 1000, values: p.values };
        fresh[p.kind].push(point);
        last = Math.max(last, p.seq);
      }
      if (page.points.length < 10000) break;
      since = page.next_since;
    }
    points[kind.step] = fresh[kind.step];
    points[kind.eval] = fresh[kind.eval];
    lastSeq = last;
    for (const [recordKind, point] of early) put(recordKind, point);
    loaded = true;
    draw(true);
  }

  return { add, load, draw, state };
}
