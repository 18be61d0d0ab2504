// A job as the list and its page show it: its state badge, progress bar, strategy, elapsed
// time, and a sweep metric's value.

import { duration, fmt, h, percent } from "./dom.js";

export function badge(state) {
  return h("span", { class: `badge state-${state.toLowerCase()}`, "data-state": state }, state);
}

export function elapsed(job) {
  if (!job.started_at) return null;
  const end = job.finished_at ? Date.parse(job.finished_at) : Date.now();
  return (end - Date.parse(job.started_at)) / 1000;
}

export function elapsedText(job) {
  return duration(elapsed(job));
}

/** What trains a job: a sweep's trials, the optimizer alone, or K-FAC's strategy (with
 *  kfac: auto, what the tuner chose once it has). */
export function strategy(job) {
  if (job.spec.sweep) return `sweep: ${job.spec.sweep.trials} trials`;
  const kfac = job.spec.kfac;
  const optimizer = job.spec.optimizer && job.spec.optimizer.name;
  if (kfac === "off") return `${optimizer} (no K-FAC)`;
  const chosen = job.decision;
  const fraction = (f) => (typeof f === "number" ? `f=${f}` : f);
  if (kfac.strategy === "auto") {
    if (!chosen) return "auto (choosing…)";
    return `auto → ${fraction(chosen.grad_worker_fraction)}, ` +
      `${chosen.factor_update_steps}/${chosen.inv_update_steps}`;
  }
  return `${fraction(kfac.strategy)}, ${kfac.factor_update_steps}/${kfac.inv_update_steps}`;
}

export function progressBar(job, sets) {
  // A job that SUCCEEDED is done (100%), also when it met its target early.
  const done = job.state === sets.state.SUCCEEDED;
  const pct = done ? 100 : job.progress.percent;
  let label = job.progress.total
    ? `${fmt(job.progress.step)} / ${fmt(job.progress.total)}`
    : job.progress.step ? `step ${fmt(job.progress.step)}` : "";
  if (done) {
    label = job.progress.target_met
      ? `done: target met at step ${fmt(job.progress.step)} of ${fmt(job.progress.total)}`
      : "done";
  } else if (job.state === sets.state.QUEUED && job.queue_position) {
    label = `queued: #${job.queue_position} in line`;
  }
  return h("div", { class: "bar", title: label, role: "progressbar",
                    "aria-valuenow": pct ?? 0, "aria-valuemin": 0, "aria-valuemax": 100 },
    h("div", { class: "fill", style: `width: ${Math.min(pct ?? 0, 100)}%` }),
    h("span", { class: "bar-label" },
      pct === null || done ? label : `${pct.toFixed(0)}%  ${label}`));
}

/** A sweep metric's value in its unit (the registry says which). */
/** A value as its unit reads (the registry's units): a fraction in percent, seconds with
 *  their unit, anything else as a number. */
export function valueText(unit, value, sets, digits = 3) {
  if (value === null || value === undefined) return "–";
  if (unit === sets.unit.fraction) return percent(value);
  if (unit === sets.unit.seconds) return `${fmt(value)} s`;
  return fmt(value, digits);
}

export function metricText(metric, value, sets) {
  return valueText((sets.metric[metric] || {}).unit, value, sets, 4);
}

/** A job's value for a column of the list (the first of the column's metrics it has). */
export function columnValue(column, metrics, sets) {
  const shown = sets.metrics.find((m) => m.column === column.id &&
    metrics[m.field] !== undefined && metrics[m.field] !== null);
  return shown ? valueText(shown.unit, metrics[shown.field], sets) : "–";
}
