// What the service says a job may name, every closed set its answers use (job and trial
// states, strategies, optimizers, sweep metrics, record kinds, units), and which fields of the
// records the page shows (metrics, charts, the list's columns), read once from
// GET /v1/registry: the page keeps no copy of them.

import { api } from "./api.js";

let loading = null;

const byName = (names) => Object.fromEntries(names.map((name) => [name, name]));

/** The registry, and its sets in the shapes the views use. */
export function registry() {
  loading = loading || api("/v1/registry").then((r) => ({
    ...r,
    state: byName(r.job_states), // a state by its name: sets.state.SUCCEEDED
    finished: new Set(r.finished_states),
    trial: byName(r.trial_states),
    trialEnded: new Set(r.ended_trial_states),
    kind: byName(r.record_kinds), // a record kind by its name: sets.kind.step
    metric: Object.fromEntries(r.sweep_metrics.map((m) => [m.name, m])),
    unit: byName(r.units), // a unit by its name: sets.unit.fraction
  })).catch((err) => {
    loading = null; // asked again by the next view
    throw err;
  });
  return loading;
}
