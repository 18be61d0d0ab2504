// A job's page: its state and facts, its curves (charts.js), a sweep's trials (sweep.js),
// the tuner's decision (tuner.js), each layer's K-FAC intervals over time (intervals.js), its
// spec, the tail of its log and its history, all kept live by the job's event stream (and read
// again after a reconnection).

import { api, follow } from "./api.js";
import { curves } from "./charts.js";
import { badge, elapsedText, metricText, progressBar, strategy, valueText } from "./display.js";
import { every, fmt, h, sleep, when } from "./dom.js";
import { intervals } from "./intervals.js";
import { registry } from "./registry.js";
import { renderSweep, withTrial } from "./sweep.js";
import { renderTuner } from "./tuner.js";

function facts(job, sets) {
  const m = job.metrics || {};
  const sweep = job.sweep;
  return [
    ["job", job.id], ["Ray job", job.submission_id || "–"], ["strategy", strategy(job)],
    ["created", when(job.created_at)], ["started", when(job.started_at)],
    ["finished", when(job.finished_at)], ["elapsed", elapsedText(job)],
    ...(sweep ? [
      ["trials over", `${sweep.trials_ended} / ${fmt(sweep.trials_planned)}`],
      ["at once", fmt(sweep.concurrent)], ["metric", `${sweep.metric} (${sweep.mode})`],
      ["best", sweep.best ? metricText(sweep.metric, sweep.best.value, sets) : "–"],
      ["sweep took", sweep.seconds === null || sweep.seconds === undefined ? "–" : `${fmt(sweep.seconds)} s`],
    ] : sets.metrics.filter((x) => x.fact).map((x) => [x.label, valueText(x.unit, m[x.field], sets)])),
  ];
}

export async function jobPage(view, id, signal) {
  const sets = await registry();
  let job = await api(`/v1/jobs/${id}`, { signal });

  const header = h("div", { class: "job-head" });
  const factList = h("dl", { class: "facts" });
  const tuner = h("section", { class: "tuner" });
  const specBox = h("pre", { class: "spec", id: "spec" });
  const logBox = h("pre", { class: "log", id: "log" }, "…");
  const history = h("ol", { class: "history" });
  const sweepBox = h("section", { class: "sweep", id: "sweep", hidden: true });
  const curveBox = h("section", { hidden: Boolean(job.spec.sweep) });
  const chart = curves(curveBox, id, sets, signal);
  const intervalBox = h("section", { class: "intervals", id: "intervals" });
  const layerIntervals = intervals(intervalBox, id, sets, signal);
  view.append(
    header, factList, sweepBox, curveBox, tuner, intervalBox,
    h("div", { class: "two" },
      h("section", {}, h("h2", {}, "Spec"), specBox),
      h("section", {}, h("h2", {}, "Log (tail)"), logBox)),
    h("section", {}, h("h2", {}, "History"), history));

  function renderHead() {
    const finished = sets.finished.has(job.state);
    const cancelling = job.state === sets.state.CANCELLING;
    header.replaceChildren(...[
      h("div", { class: "title" }, h("h1", {}, job.name), badge(job.state),
        // A finished job has nothing to cancel: no button at all.
        finished ? null
          : h("button", { type: "button", id: "cancel", class: "danger", disabled: cancelling,
                          onclick: cancel }, cancelling ? "Cancelling…" : "Cancel")),
      progressBar(job, sets),
      job.failure_reason
        ? h("p", { class: "error failure", role: "alert" }, job.failure_reason) : null,
    ].filter(Boolean));
    factList.replaceChildren(...facts(job, sets).flatMap(([k, v]) => [
      h("dt", {}, k), h("dd", { "data-fact": k }, v)]));
    specBox.textContent = JSON.stringify(job.spec, null, 2);
    history.replaceChildren(...(job.transitions || []).map((t) => h("li", {},
      h("time", {}, when(t.at)), " ", t.from_state || "∅", " → ", h("b", {}, t.to_state),
      ` (${t.event})`, t.reason ? ` ${t.reason}` : "")));
    renderSweep(sweepBox, job, sets);
    renderTuner(tuner, job);
  }

  async function cancel() {
    document.getElementById("cancel").disabled = true;
    try {
      job = { ...job, ...(await api(`/v1/jobs/${id}/cancel`, { method: "POST" })) };
      renderHead();
    } catch (err) {
      header.append(h("p", { class: "error", role: "alert" }, err.message));
    }
  }

  // A sweep's trials come from the job (GET /v1/jobs/{id}), kept live by its trial events
  // (merged at once) and a read of the job after each burst of them: the read is the truth,
  // and one always starts after the last event, so the page ends where the job does.
  let sweepRead = null;
  let sweepAgain = false;
  function refreshSweep() {
    if (sweepRead) { sweepAgain = true; return; }
    sweepRead = (async () => {
      do {
        sweepAgain = false;
        await sleep(300);
        if (signal.aborted) return;
        try {
          const fresh = await api(`/v1/jobs/${id}`, { signal });
          job = { ...job, sweep: fresh.sweep, progress: fresh.progress };
          renderHead();
        } catch (err) {
          if (signal.aborted) return;
        }
      } while (sweepAgain);
    })().finally(() => { sweepRead = null; });
  }

  async function loadLog() {
    try {
      const text = await api(`/v1/jobs/${id}/logs`, { signal });
      // Ray colours its workers' prefixes with ANSI escapes: drop them.
      const lines = String(text).replace(/\x1b\[[0-9;]*m/g, "").split("\n");
      logBox.textContent = lines.slice(-200).join("\n") || "(empty: the job has not reached Ray yet)";
      logBox.scrollTop = logBox.scrollHeight;
    } catch (err) {
      if (!signal.aborted) logBox.textContent = `(no log: ${err.message})`;
    }
  }

  renderHead();
  loadLog();
  every(3000, () => { if (!sets.finished.has(job.state)) loadLog(); });
  every(1000, () => {
    const node = factList.querySelector('[data-fact="elapsed"]');
    if (node && !sets.finished.has(job.state)) node.textContent = elapsedText(job);
  });

  // The history is read once the stream is subscribed (on its first event, the job's state)
  // and again on every reconnection (what happened while the stream was down, a restart of
  // the service say); events that come while it loads are kept and merged after it.
  let opened = false;
  let loading = null;
  const streamed = follow(`/v1/jobs/${id}/events`, (name, data) => {
    if (opened) {
      opened = false;
      loading = Promise.all([chart.load(), layerIntervals.load()]).catch((err) => {
        if (!signal.aborted) header.append(h("p", { class: "error", role: "alert" }, err.message));
      });
    }
    if (name === "state") {
      const was = job.state;
      job = { ...job, ...data };
      renderHead();
      if (sets.finished.has(job.state) && !sets.finished.has(was)) {
        loadLog();
        api(`/v1/jobs/${id}`, { signal }).then((j) => { job = j; renderHead(); });
      }
      return;
    }
    if (data.kind === sets.kind.tuner) { job = { ...job, tuner: data }; renderTuner(tuner, job); return; }
    if (layerIntervals.add(data)) return;
    if (data.kind === sets.kind.trial) { job = withTrial(job, data, sets); renderHead(); refreshSweep(); return; }
    if (data.kind === sets.kind.sweep) { refreshSweep(); return; }
    if (chart.add(data) && data.kind === sets.kind.step) {
      job.progress = { ...job.progress, step: data.step };
    }
  }, signal, () => { opened = true; });

  await streamed;
  if (loading) await loading;
  return chart.state.drawn;
}
