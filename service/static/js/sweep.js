// A sweep job's trials: its plan, every trial (its draw, state and metrics), and the best
// trial with its checkpoint and spec (a job file, as the service renders it), which can be
// submitted as a job of its own.

import { badge, metricText, valueText } from "./display.js";
import { fmt, h, short } from "./dom.js";
import { submitJob } from "./form.js";

/** The sweep section of ``job`` (empty and hidden for a job without a sweep). */
export function renderSweep(box, job, sets) {
  const sweep = job.sweep;
  box.hidden = !sweep;
  if (!sweep) return;
  const paths = Object.keys(sweep.space || {});
  const best = sweep.best;
  const isBest = (t) => Boolean(best) && t.trial_id === best.trial_id;
  const note = (t) => {
    if (t.state === sets.trial.FAILED) return h("span", { class: "error" }, t.error || "failed");
    if (t.state === sets.trial.STOPPED) return "stopped early by the scheduler (ASHA)";
    return isBest(t) ? "best" : "";
  };
  const space = paths.map((path) => {
    const [kind, values] = Object.entries(sweep.space[path])[0] || ["?", []];
    return `${path} ~ ${kind} [${(values || []).map((v) => short(v)).join(", ")}]`;
  }).join("; ");
  const ended = sweep.seconds !== null && sweep.seconds !== undefined;
  const shown = sets.metrics.filter((m) => m.kind === sets.kind.trial);
  box.replaceChildren(...[
    h("h2", {}, "Trials"),
    h("p", { class: "plan" },
      `${sweep.trials_ended} of ${fmt(sweep.trials_planned)} trials over, ${fmt(sweep.concurrent)} at once, `,
      `ranked by ${sweep.metric} (${sweep.mode === "max" ? "higher" : "lower"} is better). Space: `,
      space || "–", "."),
    h("table", { class: "trials", id: "trials" },
      h("thead", {}, h("tr", {}, ["trial", "state", ...paths, "step", ...shown.map((m) => m.label),
        ""].map((c) => h("th", {}, c)))),
      h("tbody", {}, sweep.trials.map((t) => h("tr", {
        class: isBest(t) ? "best" : "", "data-trial": t.trial_id, "data-state": t.state,
      },
        h("td", {}, h("code", {}, t.trial_id)),
        h("td", {}, badge(t.state)),
        paths.map((path) => h("td", { class: "num" }, short((t.params || {})[path]))),
        h("td", { class: "num" }, fmt(t.step)),
        shown.map((m) => h("td", { class: "num" }, valueText(m.unit, (t.metrics || {})[m.field], sets))),
        h("td", { class: "note" }, note(t)))))),
    sweep.trials.length ? null : h("p", { class: "empty" }, "No trial has started yet."),
    best ? bestBlock(sweep, sets) : ended
      ? h("p", { class: "muted" }, `The sweep ended without a best trial: no trial has ${sweep.metric}.`)
      : null,
  ].filter(Boolean));
}

function bestBlock(sweep, sets) {
  const best = sweep.best;
  const problems = h("div", { class: "error", id: "submit-best-errors", role: "alert" });
  const button = h("button", { type: "button", id: "submit-best", disabled: !sweep.best_spec,
                               onclick: () => submitBest(sweep.best_spec, button, problems) },
    "Submit best spec");
  const params = Object.entries(best.params || {}).map(([k, v]) => `${k} = ${short(v, 4)}`);
  return h("div", { class: "best-trial" },
    h("h2", {}, "Best trial"),
    h("p", {}, h("code", {}, best.trial_id), `: ${sweep.metric} ${metricText(sweep.metric, best.value, sets)}`,
      params.length ? ` with ${params.join(", ")}` : "", "."),
    h("p", {}, "Checkpoint: ", h("code", { id: "best-checkpoint" }, best.checkpoint || "–")),
    sweep.best_spec_yaml ? h("p", { class: "muted" }, "Its spec, a job file (kaisa-ray train --config):") : null,
    sweep.best_spec_yaml ? h("pre", { class: "spec", id: "best-spec" }, sweep.best_spec_yaml) : null,
    h("div", { class: "actions" }, button,
      h("small", {}, " a job of its own: the best trial's spec, trained as one run")),
    problems);
}

async function submitBest(spec, button, problems) {
  button.disabled = true;
  problems.replaceChildren();
  try {
    await submitJob(spec);
  } catch (err) {
    button.disabled = false;
    const listed = (err.body && err.body.problems) || [];
    problems.append(...(listed.length
      ? listed.map((p) => h("p", {}, `${p.field}: ${p.message}`)) : [h("p", {}, err.message)]));
  }
}

/** ``job`` with a streamed trial record merged into its sweep (a new value; the read of the
 *  job that follows a burst of them is the truth). */
export function withTrial(job, record, sets) {
  const sweep = job.sweep;
  if (!sweep) return job;
  const trials = sweep.trials.slice();
  let index = trials.findIndex((t) => t.trial_id === record.trial);
  if (index < 0) {
    trials.push({ trial_id: record.trial, state: sets.trial.RUNNING, params: {}, step: null,
                  metrics: {}, value: null, error: null, checkpoint: null });
    trials.sort((a, b) => (a.trial_id < b.trial_id ? -1 : a.trial_id > b.trial_id ? 1 : 0));
    index = trials.findIndex((t) => t.trial_id === record.trial);
  }
  const trial = { ...trials[index], metrics: { ...trials[index].metrics } };
  if (record.state && !(sets.trialEnded.has(trial.state) && record.state === sets.trial.RUNNING)) {
    trial.state = record.state;
  }
  if (record.params) trial.params = record.params;
  if (record.step !== undefined && record.step !== null) trial.step = record.step;
  for (const key of sets.trial_metrics) {
    if (record[key] !== undefined) trial.metrics[key] = record[key];
  }
  if (record.error) trial.error = record.error;
  trials[index] = trial;
  const ended = trials.filter((t) => sets.trialEnded.has(t.state)).length;
  return { ...job, sweep: { ...sweep, trials, trials_ended: ended },
           progress: { ...job.progress, step: ended,
                       percent: job.progress.total ? Math.round(10000 * ended / job.progress.total) / 100 : null } };
}
