// The kaisa-ray dashboard: the job list, a job's page and the submit form, on the service's
// own REST API and event streams. No build step and no third-party code but Plotly, which
// the service serves from the plotly package installed beside it.
"use strict";

const STATES = [
  "QUEUED", "PROFILING", "RUNNING", "RECOVERING", "CANCELLING",
  "SUCCEEDED", "FAILED", "CANCELLED",
];
const FINISHED = new Set(["SUCCEEDED", "FAILED", "CANCELLED"]);
const TRIAL_ENDED = new Set(["SUCCEEDED", "STOPPED", "FAILED"]);
const TOKEN_KEY = "kaisa-ray-token";

// -- small helpers ------------------------------------------------------------------------

/** An element: h("td", {class: "x"}, "text", child, ...). Text is always text, never HTML. */
function h(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === undefined || value === null || value === false) continue;
    if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else if (key === "dataset") Object.assign(node.dataset, value);
    else node.setAttribute(key, value === true ? "" : String(value));
  }
  for (const child of children.flat()) {
    if (child === undefined || child === null || child === false) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

function fmt(value, digits = 3) {
  if (value === undefined || value === null || Number.isNaN(value)) return "–";
  if (typeof value !== "number") return String(value);
  if (Number.isInteger(value)) return value.toLocaleString("en-US");
  return value.toPrecision(digits);
}

function percent(value) {
  return value === undefined || value === null ? "–" : `${(100 * value).toFixed(1)}%`;
}

function mib(bytes) {
  return bytes === undefined || bytes === null ? "–" : `${(bytes / 2 ** 20).toFixed(2)} MiB`;
}

function when(iso) {
  return iso ? new Date(iso).toLocaleString(undefined, { hour12: false }) : "–";
}

function duration(seconds) {
  if (seconds === null || seconds === undefined || seconds < 0) return "–";
  const s = Math.round(seconds);
  const hours = Math.floor(s / 3600);
  const minutes = Math.floor((s % 3600) / 60);
  const rest = s % 60;
  if (hours) return `${hours} h ${String(minutes).padStart(2, "0")} min`;
  if (minutes) return `${minutes} min ${String(rest).padStart(2, "0")} s`;
  return `${rest} s`;
}

function elapsed(job) {
  if (!job.started_at) return null;
  const end = job.finished_at ? Date.parse(job.finished_at) : Date.now();
  return (end - Date.parse(job.started_at)) / 1000;
}

function strategy(job) {
  if (job.spec.sweep) return `sweep: ${job.spec.sweep.trials} trials`;
  const kfac = job.spec.kfac;
  const optimizer = (job.spec.optimizer && job.spec.optimizer.name) || "sgd";
  if (kfac === "off") return `${optimizer} (no K-FAC)`;
  const chosen = job.decision;
  const fraction = (f) => (typeof f === "number" ? `f=${f}` : f);
  if (kfac.strategy === "auto") {
    if (!chosen) return "auto (choosing…)";
    return `auto → ${fraction(chosen.strategy)}, ` +
      `${chosen.factor_update_steps}/${chosen.inv_update_steps}`;
  }
  return `${fraction(kfac.strategy)}, ${kfac.factor_update_steps}/${kfac.inv_update_steps}`;
}

function badge(state) {
  return h("span", { class: `badge state-${state.toLowerCase()}`, "data-state": state }, state);
}

function progressBar(job) {
  // A job that SUCCEEDED is done (100%), also when it met its target early.
  const pct = job.state === "SUCCEEDED" ? 100 : job.progress.percent;
  let label = job.progress.total
    ? `${fmt(job.progress.step)} / ${fmt(job.progress.total)}`
    : job.progress.step ? `step ${fmt(job.progress.step)}` : "";
  if (job.state === "SUCCEEDED") {
    label = job.progress.target_met
      ? `done: target met at step ${fmt(job.progress.step)} of ${fmt(job.progress.total)}`
      : "done";
  } else if (job.state === "QUEUED" && job.queue_position) {
    label = `queued: #${job.queue_position} in line`;
  }
  return h("div", { class: "bar", title: label, role: "progressbar",
                    "aria-valuenow": pct ?? 0, "aria-valuemin": 0, "aria-valuemax": 100 },
    h("div", { class: "fill", style: `width: ${Math.min(pct ?? 0, 100)}%` }),
    h("span", { class: "bar-label" },
      pct === null || job.state === "SUCCEEDED" ? label : `${pct.toFixed(0)}%  ${label}`));
}

/** A sweep job's sweep (the job's view, else the plan in its spec); null for other jobs. */
function sweepOf(job) {
  if (job.sweep) return job.sweep;
  const section = job.spec.sweep;
  if (!section) return null;
  const space = {};
  for (const [path, d] of Object.entries(section.space || {})) {
    space[path] = Object.fromEntries(Object.entries(d).filter(([, v]) => v !== null));
  }
  const metric = section.metric || "test_accuracy";
  return {
    metric, mode: section.mode || (metric === "test_accuracy" ? "max" : "min"),
    trials_planned: section.trials, concurrent: section.concurrent, space,
    trials_ended: 0, trials: [], best: null, best_spec: null, seconds: null,
  };
}

/** A drawn hyperparameter, short: 0.05, 0.00231, 1.2e-5 (not toPrecision's 0.0500). */
function short(value, digits = 3) {
  if (typeof value !== "number" || Number.isInteger(value)) return fmt(value);
  return String(Number(value.toPrecision(digits)));
}

function metricText(metric, value) {
  if (value === null || value === undefined) return "–";
  if (metric === "test_accuracy") return percent(value);
  if (metric === "time_to_target") return `${fmt(value)} s`;
  return fmt(value, 4);
}

/** A JobSpec as YAML (a job file for kaisa-ray train --config): block mappings, flow lists of
 *  plain values; strings quoted where YAML would read them as something else. */
function yamlish(value, indent = "") {
  const scalar = (v) => {
    if (v === null || v === undefined) return "null";
    if (typeof v === "boolean") return String(v);
    if (typeof v === "number") {
      if (!Number.isFinite(v)) return "null";
      const text = String(v);
      if (!text.includes("e")) return text;
      // YAML 1.1 (PyYAML) reads a float only with a dot and a signed exponent: 1.0e-07.
      const [mantissa, exponent] = text.split("e");
      const sign = /^[+-]/.test(exponent) ? "" : "+";
      return `${mantissa.includes(".") ? mantissa : `${mantissa}.0`}e${sign}${exponent}`;
    }
    const text = String(v);
    const plain = /^[A-Za-z_][A-Za-z0-9_./-]*$/.test(text) &&
      !/^(true|false|yes|no|on|off|y|n|null|~)$/i.test(text);
    return plain ? text : JSON.stringify(text);
  };
  const isPlain = (v) => v === null || typeof v !== "object";
  if (isPlain(value)) return scalar(value);
  if (Array.isArray(value)) {
    if (value.every(isPlain)) return `[${value.map(scalar).join(", ")}]`;
    return value.map((item) => `\n${indent}- ${yamlish(item, `${indent}  `).trimStart()}`).join("");
  }
  const entries = Object.entries(value);
  if (!entries.length) return "{}";
  const lines = entries.map(([key, v]) => {
    const nested = !isPlain(v) && !(Array.isArray(v) && v.every(isPlain)) && Object.keys(v).length;
    return nested ? `${indent}${scalar(key)}:\n${yamlish(v, `${indent}  `).replace(/^\n/, "")}`
      : `${indent}${scalar(key)}: ${yamlish(v, indent)}`;
  });
  return lines.join("\n");
}

// -- the API, with the token --------------------------------------------------------------

class ApiError extends Error {
  constructor(status, body) {
    const detail = body && typeof body === "object" ? body.detail : body;
    super(detail || `HTTP ${status}`);
    this.status = status;
    this.body = body;
  }
}

let token = localStorage.getItem(TOKEN_KEY);
let asking = null;

/** Ask for the token once: every request that met a 401 waits for the same answer. */
function askToken(message) {
  if (!asking) {
    asking = new Promise((resolve) => {
      const dialog = document.getElementById("token-dialog");
      const input = document.getElementById("token-input");
      document.getElementById("token-error").textContent = message || "";
      input.value = "";
      dialog.addEventListener("close", function done() {
        dialog.removeEventListener("close", done);
        const given = input.value.trim();
        if (given) {
          token = given;
          localStorage.setItem(TOKEN_KEY, token);
        }
        document.getElementById("forget-token").hidden = !token;
        asking = null;
        resolve();
      });
      dialog.showModal();
      input.focus();
    });
  }
  return asking;
}

function authHeaders() {
  return token ? { Authorization: `Bearer ${token}` } : {};
}

async function api(path, { method = "GET", json, signal } = {}) {
  for (;;) {
    const headers = authHeaders();
    if (json !== undefined) headers["Content-Type"] = "application/json";
    const response = await fetch(path, {
      method, headers, signal, body: json === undefined ? undefined : JSON.stringify(json),
    });
    if (response.status === 401) {
      await askToken(token ? "The service refused that token; check it and try again." : "");
      continue;
    }
    const type = response.headers.get("content-type") || "";
    const body = response.status === 204 ? null
      : type.includes("json") ? await response.json() : await response.text();
    if (!response.ok) throw new ApiError(response.status, body);
    return body;
  }
}

/** Follow a server-sent event stream (fetch, so that it can carry the token). Calls
 *  onEvent(name, data) for each event; reconnects after a network error; returns when the
 *  stream ends (a job's stream ends with the job) or the signal aborts. */
async function follow(path, onEvent, signal, onOpen) {
  let wait = 500;
  while (!signal.aborted) {
    try {
      const response = await fetch(path, { headers: authHeaders(), signal });
      if (response.status === 401) {
        await askToken(token ? "The service refused that token; check it and try again." : "");
        continue;
      }
      if (!response.ok) throw new ApiError(response.status, await response.text());
      live(true);
      wait = 500;
      if (onOpen) onOpen();
      const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
      let buffer = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) return;
        buffer += value.replace(/\r\n?/g, "\n");
        let end;
        while ((end = buffer.indexOf("\n\n")) >= 0) {
          const block = buffer.slice(0, end);
          buffer = buffer.slice(end + 2);
          let name = "message";
          const data = [];
          for (const line of block.split("\n")) {
            if (line.startsWith(":")) continue; // a ping
            const colon = line.indexOf(":");
            const field = colon < 0 ? line : line.slice(0, colon);
            const text = colon < 0 ? "" : line.slice(colon + 1).replace(/^ /, "");
            if (field === "event") name = text;
            else if (field === "data") data.push(text);
          }
          if (data.length) onEvent(name, JSON.parse(data.join("\n")));
        }
      }
    } catch (err) {
      if (signal.aborted) return;
      if (err instanceof ApiError && err.status === 404) throw err;
      live(false);
      await sleep(wait);
      wait = Math.min(wait * 2, 10000);
    }
  }
}

function live(on) {
  const node = document.getElementById("live");
  node.textContent = on ? "live" : "reconnecting…";
  node.classList.toggle("on", on);
}

// -- routing -------------------------------------------------------------------------------

let current = null; // the shown view's AbortController: leaving a view stops its streams
const timers = new Set();

function every(ms, fn) {
  const id = setInterval(fn, ms);
  timers.add(id);
  return id;
}

function route() {
  if (current) current.abort();
  for (const id of timers) clearInterval(id);
  timers.clear();
  current = new AbortController();
  const view = document.getElementById("view");
  view.replaceChildren();
  const hash = location.hash || "#/";
  const job = hash.match(/^#\/jobs\/([A-Za-z0-9]+)$/);
  document.getElementById("nav-new").classList.toggle("here", hash === "#/new");
  document.getElementById("nav-jobs").classList.toggle("here", !job && hash !== "#/new");
  const show = job ? jobPage(view, job[1], current.signal)
    : hash === "#/new" ? formPage(view, current.signal)
    : listPage(view, hash, current.signal);
  show.catch((err) => {
    if (current.signal.aborted) return;
    view.append(h("p", { class: "error", role: "alert" }, err.message));
  });
}

// -- the job list ---------------------------------------------------------------------------

async function listPage(view, hash, signal) {
  const query = new URLSearchParams(hash.split("?")[1] || "");
  const wanted = new Set(query.getAll("state").filter((s) => STATES.includes(s)));
  const filters = h("div", { class: "filters", role: "group", "aria-label": "filter by state" },
    h("a", { href: "#/", class: wanted.size ? "chip" : "chip on" }, "all"),
    STATES.map((state) => {
      const next = new Set(wanted);
      if (next.has(state)) next.delete(state); else next.add(state);
      const params = new URLSearchParams([...next].map((s) => ["state", s]));
      return h("a", { href: `#/?${params}`, class: wanted.has(state) ? "chip on" : "chip",
                      "data-filter": state }, state.toLowerCase());
    }));
  const body = h("tbody", { id: "jobs" });
  const empty = h("p", { class: "empty", hidden: true }, "No jobs here yet. ",
    h("a", { href: "#/new" }, "Submit one."));
  view.append(
    h("section", {},
      h("div", { class: "heading" }, h("h1", {}, "Jobs"), filters),
      h("table", { class: "jobs" },
        h("thead", {}, h("tr", {},
          ["name", "state", "progress", "loss", "accuracy", "strategy", "started", "elapsed"]
            .map((c) => h("th", {}, c)))),
        body),
      empty));

  const params = new URLSearchParams([...wanted].map((s) => ["state", s]));
  params.set("limit", "200");
  const rows = new Map();
  const jobs = new Map();
  const shows = (job) => !wanted.size || wanted.has(job.state);

  function render(job) {
    jobs.set(job.id, job);
    let row = rows.get(job.id);
    if (!shows(job)) {
      if (row) { row.remove(); rows.delete(job.id); }
      empty.hidden = rows.size > 0;
      return;
    }
    const m = job.metrics || {};
    const accuracy = m.test_accuracy ?? m.accuracy;
    const cells = [
      h("td", {}, h("a", { href: `#/jobs/${job.id}`, class: "job-link" }, job.name)),
      h("td", {}, badge(job.state)),
      h("td", { class: "progress" }, progressBar(job)),
      h("td", { class: "num", "data-col": "loss" }, fmt(m.loss)),
      h("td", { class: "num", "data-col": "accuracy" }, accuracy === undefined ? "–" : percent(accuracy)),
      h("td", {}, strategy(job)),
      h("td", {}, when(job.started_at)),
      h("td", { class: "num", "data-col": "elapsed" }, duration(elapsed(job))),
    ];
    if (!row) {
      row = h("tr", { "data-job": job.id });
      rows.set(job.id, row);
      // Newest first, as the API lists them (ids sort by creation time).
      const after = [...body.children].find((r) => r.dataset.job < job.id);
      body.insertBefore(row, after || null);
    }
    row.dataset.state = job.state;
    row.replaceChildren(...cells);
    empty.hidden = true;
  }

  function load() {
    api(`/v1/jobs?${params}`, { signal }).then((page) => {
      for (const job of page.jobs.reverse()) render(job);
      empty.hidden = rows.size > 0;
    }).catch((err) => {
      if (!signal.aborted) view.append(h("p", { class: "error" }, err.message));
    });
  }

  function onEvent(name, data) {
    if (name === "ready") { load(); return; } // subscribed: from here on, nothing is missed
    if (name === "state") { render(data); return; }
    if (name === "deleted") {
      const row = rows.get(data.job_id);
      if (row) { row.remove(); rows.delete(data.job_id); }
      jobs.delete(data.job_id);
      return;
    }
    const job = jobs.get(data.job_id);
    if (!job) return;
    if (name === "trial" || name === "sweep") {
      // A sweep's progress is its trials that are over: read the job again when one ends
      // (its evaluations are a trial's, not the job's).
      if (name === "sweep" || TRIAL_ENDED.has(data.state)) {
        api(`/v1/jobs/${data.job_id}`, { signal }).then((fresh) => {
          if (jobs.has(fresh.id)) render(fresh);
        }).catch(() => {});
      }
      return;
    }
    const metrics = { ...job.metrics };
    for (const key of ["loss", "accuracy", "samples_per_s", "test_accuracy", "test_loss"]) {
      if (data[key] !== undefined) metrics[key] = data[key];
    }
    const step = data.step ?? job.progress.step;
    const total = job.progress.total;
    render({ ...job, metrics,
             progress: { step, total, percent: total ? Math.round(10000 * step / total) / 100 : null } });
  }

  every(1000, () => {
    for (const [id, row] of rows) {
      const job = jobs.get(id);
      if (job && !FINISHED.has(job.state)) {
        row.querySelector('[data-col="elapsed"]').textContent = duration(elapsed(job));
      }
    }
  });

  // The stream first: on its "ready" (and on every reconnection) the list is read, so no
  // change between the list and the stream is missed.
  await follow("/v1/events", onEvent, signal);
}

// -- a job's page ---------------------------------------------------------------------------

const CHARTS = [
  { id: "chart-loss", title: "Loss", y: "loss", traces: [
    { kind: "step", field: "loss", name: "training loss" },
    { kind: "eval", field: "test_loss", name: "test loss" },
  ] },
  { id: "chart-accuracy", title: "Accuracy", y: "accuracy", percent: true, traces: [
    { kind: "eval", field: "test_accuracy", name: "test accuracy" },
    { kind: "step", field: "accuracy", name: "training accuracy" },
  ] },
  { id: "chart-throughput", title: "Throughput", y: "samples / s", traces: [
    { kind: "step", field: "samples_per_s", name: "samples / s" },
  ] },
];

async function jobPage(view, id, signal) {
  let job = await api(`/v1/jobs/${id}`, { signal });
  const points = { step: [], eval: [] };
  let xAxis = "step";
  let lastTime = 0;

  const header = h("div", { class: "job-head" });
  const facts = h("dl", { class: "facts" });
  const charts = h("div", { class: "charts" });
  const tuner = h("section", { class: "tuner" });
  const specBox = h("pre", { class: "spec", id: "spec" });
  const logBox = h("pre", { class: "log", id: "log" }, "…");
  const history = h("ol", { class: "history" });
  const axisToggle = h("div", { class: "axis", role: "group", "aria-label": "x axis" },
    ["step", "time"].map((axis) => h("button", {
      type: "button", class: axis === xAxis ? "chip on" : "chip", "data-axis": axis,
      onclick: (event) => {
        xAxis = axis;
        for (const b of axisToggle.children) b.classList.toggle("on", b === event.target);
        drawCharts(true);
      },
    }, axis === "step" ? "against step" : "against wall-clock time")));
  const sweepBox = h("section", { class: "sweep", id: "sweep", hidden: true });
  const curves = h("section", { hidden: Boolean(job.spec.sweep) },
    h("div", { class: "heading" }, h("h2", {}, "Training curves"), axisToggle), charts);
  view.append(
    header, facts, sweepBox, curves,
    tuner,
    h("div", { class: "two" },
      h("section", {}, h("h2", {}, "Spec"), specBox),
      h("section", {}, h("h2", {}, "Log (tail)"), logBox)),
    h("section", {}, h("h2", {}, "History"), history));
  for (const chart of CHARTS) charts.append(h("div", { class: "chart", id: chart.id }));

  function renderHead() {
    const cancellable = !FINISHED.has(job.state) && job.state !== "CANCELLING";
    header.replaceChildren(...[
      h("div", { class: "title" }, h("h1", {}, job.name), badge(job.state),
        // A finished job has nothing to cancel: no button at all.
        FINISHED.has(job.state) ? null
          : h("button", { type: "button", id: "cancel", class: "danger", disabled: !cancellable,
                          onclick: cancel }, job.state === "CANCELLING" ? "Cancelling…" : "Cancel")),
      progressBar(job),
      job.failure_reason
        ? h("p", { class: "error failure", role: "alert" }, job.failure_reason) : null,
    ].filter(Boolean));
    const m = job.metrics || {};
    const sweep = sweepOf(job);
    const rows = [
      ["job", job.id], ["Ray job", job.submission_id || "–"], ["strategy", strategy(job)],
      ["created", when(job.created_at)], ["started", when(job.started_at)],
      ["finished", when(job.finished_at)], ["elapsed", duration(elapsed(job))],
      ...(sweep ? [
        ["trials over", `${sweep.trials_ended} / ${fmt(sweep.trials_planned)}`],
        ["at once", fmt(sweep.concurrent)], ["metric", `${sweep.metric} (${sweep.mode})`],
        ["best", sweep.best ? metricText(sweep.metric, sweep.best.value) : "–"],
        ["sweep took", duration(sweep.seconds)],
      ] : [
        ["loss", fmt(m.loss)], ["test accuracy", m.test_accuracy === undefined ? "–" : percent(m.test_accuracy)],
        ["samples / s", fmt(m.samples_per_s)], ["ms / step", fmt(m.ms_per_step)],
        ["K-FAC ms / step", fmt(m.kfac_ms_per_step)],
      ]),
    ];
    facts.replaceChildren(...rows.flatMap(([k, v]) => [h("dt", {}, k), h("dd", { "data-fact": k }, v)]));
    specBox.textContent = JSON.stringify(job.spec, null, 2);
    history.replaceChildren(...(job.transitions || []).map((t) => h("li", {},
      h("time", {}, when(t.at)), " ", t.from_state || "∅", " → ", h("b", {}, t.to_state),
      ` (${t.event})`, t.reason ? ` ${t.reason}` : "")));
    renderSweep();
    renderTuner();
  }

  function renderSweep() {
    const sweep = sweepOf(job);
    sweepBox.hidden = !sweep;
    if (!sweep) return;
    const paths = Object.keys(sweep.space || {});
    const best = sweep.best;
    const isBest = (t) => Boolean(best) && t.trial_id === best.trial_id;
    const note = (t) => {
      if (t.state === "FAILED") return h("span", { class: "error" }, t.error || "failed");
      if (t.state === "STOPPED") return "stopped early by the scheduler (ASHA)";
      return isBest(t) ? "best" : "";
    };
    const space = paths.map((path) => {
      const [kind, values] = Object.entries(sweep.space[path])[0] || ["?", []];
      return `${path} ~ ${kind} [${(values || []).map((v) => short(v)).join(", ")}]`;
    }).join("; ");
    const ended = sweep.seconds !== null && sweep.seconds !== undefined;
    sweepBox.replaceChildren(...[
      h("h2", {}, "Trials"),
      h("p", { class: "plan" },
        `${sweep.trials_ended} of ${fmt(sweep.trials_planned)} trials over, ${fmt(sweep.concurrent)} at once, `,
        `ranked by ${sweep.metric} (${sweep.mode === "max" ? "higher" : "lower"} is better). Space: `,
        space || "–", "."),
      h("table", { class: "trials", id: "trials" },
        h("thead", {}, h("tr", {}, ["trial", "state", ...paths, "step", "test accuracy",
          "test loss", "train s", ""].map((c) => h("th", {}, c)))),
        h("tbody", {}, sweep.trials.map((t) => h("tr", {
          class: isBest(t) ? "best" : "", "data-trial": t.trial_id, "data-state": t.state,
        },
          h("td", {}, h("code", {}, t.trial_id)),
          h("td", {}, badge(t.state)),
          paths.map((path) => h("td", { class: "num" }, short((t.params || {})[path]))),
          h("td", { class: "num" }, fmt(t.step)),
          h("td", { class: "num" }, (t.metrics || {}).test_accuracy === undefined ||
            t.metrics.test_accuracy === null ? "–" : percent(t.metrics.test_accuracy)),
          h("td", { class: "num" }, fmt((t.metrics || {}).test_loss)),
          h("td", { class: "num" }, fmt((t.metrics || {}).train_s)),
          h("td", { class: "note" }, note(t)))))),
      sweep.trials.length ? null : h("p", { class: "empty" }, "No trial has started yet."),
      best ? bestBlock(sweep) : ended
        ? h("p", { class: "muted" }, `The sweep ended without a best trial: no trial has ${sweep.metric}.`)
        : null,
    ].filter(Boolean));
  }

  function bestBlock(sweep) {
    const best = sweep.best;
    const problems = h("div", { class: "error", id: "submit-best-errors", role: "alert" });
    const button = h("button", { type: "button", id: "submit-best", disabled: !sweep.best_spec,
                                 onclick: () => submitBest(sweep.best_spec, button, problems) },
      "Submit best spec");
    const params = Object.entries(best.params || {}).map(([k, v]) => `${k} = ${short(v, 4)}`);
    return h("div", { class: "best-trial" },
      h("h2", {}, "Best trial"),
      h("p", {}, h("code", {}, best.trial_id), `: ${sweep.metric} ${metricText(sweep.metric, best.value)}`,
        params.length ? ` with ${params.join(", ")}` : "", "."),
      h("p", {}, "Checkpoint: ", h("code", { id: "best-checkpoint" }, best.checkpoint || "–")),
      sweep.best_spec ? h("p", { class: "muted" }, "Its spec, a job file (kaisa-ray train --config):") : null,
      sweep.best_spec ? h("pre", { class: "spec", id: "best-spec" }, yamlish(sweep.best_spec)) : null,
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

  // A sweep's trials come from the job (GET /v1/jobs/{id}), kept live by its trial events
  // (merged here at once) and a read of the job after each burst of them: the read is the
  // truth, and one always starts after the last event, so the page ends where the job does.
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

  function onTrial(record) {
    const sweep = sweepOf(job);
    if (!sweep) return;
    const trials = sweep.trials.slice();
    let index = trials.findIndex((t) => t.trial_id === record.trial);
    if (index < 0) {
      trials.push({ trial_id: record.trial, state: "RUNNING", params: {}, step: null,
                    metrics: {}, value: null, error: null, checkpoint: null });
      trials.sort((a, b) => (a.trial_id < b.trial_id ? -1 : a.trial_id > b.trial_id ? 1 : 0));
      index = trials.findIndex((t) => t.trial_id === record.trial);
    }
    const trial = { ...trials[index], metrics: { ...trials[index].metrics } };
    if (record.state && !(TRIAL_ENDED.has(trial.state) && record.state === "RUNNING")) {
      trial.state = record.state;
    }
    if (record.params) trial.params = record.params;
    if (record.step !== undefined && record.step !== null) trial.step = record.step;
    for (const key of ["test_accuracy", "test_loss", "train_s", "time_to_target_s"]) {
      if (record[key] !== undefined) trial.metrics[key] = record[key];
    }
    if (record.error) trial.error = record.error;
    trials[index] = trial;
    const ended = trials.filter((t) => TRIAL_ENDED.has(t.state)).length;
    job = { ...job, sweep: { ...sweep, trials, trials_ended: ended },
            progress: { ...job.progress, step: ended,
                        percent: job.progress.total ? Math.round(10000 * ended / job.progress.total) / 100 : null } };
    renderHead();
  }

  function renderTuner() {
    const auto = job.spec.kfac !== "off" && job.spec.kfac.strategy === "auto";
    // A fixed strategy has no tuner: no box at all, rather than an empty one.
    tuner.hidden = !auto && !job.tuner;
    if (job.spec.sweep) {
      tuner.replaceChildren(auto
        ? h("p", { class: "muted" }, "Every trial runs with kfac: auto: its own tuner chooses its K-FAC strategy under the memory budget.")
        : "");
      return;
    }
    const record = job.tuner;
    if (!record) {
      tuner.replaceChildren(auto
        ? h("p", { class: "muted" }, "kfac: auto: the tuner's decision appears once it has profiled the workers.")
        : "");
      return;
    }
    const chosen = record.chosen || {};
    const same = (c) => c.grad_worker_fraction === chosen.strategy &&
      c.factor_update_steps === chosen.factor_update_steps &&
      c.inv_update_steps === chosen.inv_update_steps;
    const fits = (record.candidates || []).filter((c) => !c.rejected).length;
    tuner.replaceChildren(
      h("h2", {}, "The tuner's decision"),
      h("p", { class: "decision" },
        `Chose gradient worker fraction ${chosen.strategy}, factors every ${chosen.factor_update_steps} `,
        `and inverses every ${chosen.inv_update_steps} steps (${record.how}). Budget `,
        record.budget_bytes ? mib(record.budget_bytes) : "none",
        `; ${fits} of ${(record.candidates || []).length} candidates fit. Profiling `,
        record.cache === "hit" ? "came from the tuner's cache" : `took ${fmt(record.profile_s)} s`,
        `; the plain step (no K-FAC) takes ${fmt(record.plain_ms_per_step)} ms.`),
      h("table", { class: "candidates" },
        h("thead", {}, h("tr", {}, ["fraction", "factor / inverse every", "predicted memory",
          "K-FAC state", "predicted ms / step", "verdict"].map((c) => h("th", {}, c)))),
        h("tbody", {}, (record.candidates || []).map((c) => h("tr", {
          class: same(c) ? "chosen" : c.rejected ? "rejected" : "",
        },
          h("td", { class: "num" }, c.grad_worker_fraction),
          h("td", { class: "num" }, `${c.factor_update_steps} / ${c.inv_update_steps}`),
          h("td", { class: "num" }, mib(c.memory_bytes)),
          h("td", { class: "num" }, mib(c.kfac_state_bytes)),
          h("td", { class: "num" }, fmt(c.ms_per_step)),
          h("td", {}, same(c) ? "chosen" : c.rejected ? `ruled out: ${c.rejected}` : "fits"))))));
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

  let drawn = false;
  let pending = null;
  function drawCharts(now) {
    if (typeof Plotly === "undefined") return;
    if (!now) { // at most twice a second while events stream in
      pending = pending || setTimeout(() => { pending = null; drawCharts(true); }, 500);
      return;
    }
    for (const chart of CHARTS) {
      const traces = chart.traces.map((t) => {
        const series = points[t.kind].filter((p) => typeof p.values[t.field] === "number");
        return {
          x: series.map((p) => (xAxis === "step" ? p.step : new Date(p.time * 1000))),
          y: series.map((p) => p.values[t.field]),
          name: t.name, mode: t.kind === "eval" ? "lines+markers" : "lines", type: "scatter",
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
    drawn = true;
    charts.dataset.drawn = "true";
  }

  function add(kind, point) {
    if (point.time <= lastTime && kind === "step") return; // already in the history
    points[kind].push(point);
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
  every(3000, () => { if (!FINISHED.has(job.state)) loadLog(); });
  every(1000, () => {
    const node = facts.querySelector('[data-fact="elapsed"]');
    if (node && !FINISHED.has(job.state)) node.textContent = duration(elapsed(job));
  });

  // The history is read once the stream is subscribed (on its first event, the job's state)
  // and again on every reconnection (what happened while the stream was down, a restart of
  // the service say); events that come while it loads are kept and merged after it.
  let early = [];
  let historyLoaded = false;
  let opened = false;
  let loading = null;

  async function loadHistory() {
    historyLoaded = false;
    early = [];
    const fresh = { step: [], eval: [] };
    let last = 0;
    let since = 0;
    for (;;) {
      const page = await api(`/v1/jobs/${id}/metrics?since=${since}&limit=10000`, { signal });
      for (const p of page.points) {
        const point = { step: p.step, time: Date.parse(p.at) / 1000, values: p.values };
        fresh[p.kind].push(point);
        if (p.kind === "step") last = Math.max(last, point.time);
      }
      if (page.points.length < 10000) break;
      since = page.next_since;
    }
    points.step = fresh.step;
    points.eval = fresh.eval;
    lastTime = last;
    const lastEval = points.eval.length ? points.eval[points.eval.length - 1].time : 0;
    for (const [kind, point] of early) {
      if (kind === "eval" && point.time <= lastEval) continue;
      add(kind, point);
    }
    historyLoaded = true;
    drawCharts(true);
  }

  const streamed = follow(`/v1/jobs/${id}/events`, (name, data) => {
    if (opened) {
      opened = false;
      loading = loadHistory().catch((err) => {
        if (!signal.aborted) header.append(h("p", { class: "error", role: "alert" }, err.message));
      });
    }
    if (name === "state") {
      const was = job.state;
      job = { ...job, ...data };
      renderHead();
      if (FINISHED.has(job.state) && !FINISHED.has(was)) {
        loadLog();
        api(`/v1/jobs/${id}`, { signal }).then((j) => { job = j; renderHead(); });
      }
      return;
    }
    if (name === "tuner") { job = { ...job, tuner: data }; renderTuner(); return; }
    if (name === "trial") { onTrial(data); refreshSweep(); return; }
    if (name === "sweep") { refreshSweep(); return; }
    const kind = name === "eval" ? "eval" : "step";
    const point = { step: data.step, time: data.time, values: data };
    if (!historyLoaded) { early.push([kind, point]); return; }
    add(kind, point);
    if (kind === "step") job.progress = { ...job.progress, step: data.step };
    drawCharts(false);
  }, signal, () => { opened = true; });

  await streamed;
  if (loading) await loading;
  return drawn;
}

// -- the submit form ------------------------------------------------------------------------

/** POST a JobSpec (with the token, as every call) and show the new job's page. */
async function submitJob(spec) {
  const job = await api("/v1/jobs", { method: "POST", json: spec });
  location.hash = `#/jobs/${job.id}`;
  return job;
}

const KFAC_CHOICES = [
  ["comm-opt", "COMM-OPT (f = 1)"], ["hybrid-opt", "HYBRID-OPT (f = 1/2)"],
  ["mem-opt", "MEM-OPT (f = 1/world)"], ["auto", "auto (the tuner chooses)"], ["off", "off"],
];

async function formPage(view, signal) {
  const registry = await api("/v1/registry", { signal });
  const field = (label, name, input, help) => h("div", { class: "field", "data-field": name },
    h("label", { for: `f-${name}` }, label), input,
    help ? h("small", {}, help) : null,
    h("span", { class: "field-error", role: "alert" }));
  const text = (name, value, attrs) => h("input", { id: `f-${name}`, name, value, ...attrs });
  const number = (name, value, attrs) => text(name, value, { type: "number", step: "any", ...attrs });
  const select = (name, options, value) => h("select", { id: `f-${name}`, name },
    options.map(([v, label]) => h("option", { value: v, selected: v === value }, label)));

  const form = h("form", { id: "submit-form", novalidate: true },
    h("fieldset", {}, h("legend", {}, "Job"),
      field("Name", "name", text("name", "my-kfac-job", { required: true }),
        "letters, digits, '.', '_' and '-'"),
      field("Model", "model.name", select("model.name",
        registry.models.map((m) => [m, m]), registry.models.includes("lenet") ? "lenet" : registry.models[0])),
      field("Dataset", "dataset.name", select("dataset.name",
        registry.datasets.map((d) => [d, d]),
        registry.datasets.includes("fashion-mnist") ? "fashion-mnist" : registry.datasets[0])),
      field("Batch size", "dataset.batch_size", number("dataset.batch_size", 128, { step: 1 })),
      field("Samples (limit)", "dataset.limit", number("dataset.limit", "", { step: 1 }),
        "empty: the whole dataset")),
    h("fieldset", {}, h("legend", {}, "Optimizer and K-FAC"),
      field("Optimizer", "optimizer.name",
        select("optimizer.name", [["sgd", "SGD (Nesterov)"], ["adam", "Adam"], ["adamw", "AdamW"]], "sgd")),
      field("Learning rate", "optimizer.lr", number("optimizer.lr", 0.05)),
      field("K-FAC strategy", "kfac.strategy", select("kfac.strategy", KFAC_CHOICES, "comm-opt")),
      field("Damping", "kfac.damping", number("kfac.damping", 0.1)),
      field("Factors every (steps)", "kfac.factor_update_steps",
        number("kfac.factor_update_steps", 5, { step: 1 })),
      field("Inverses every (steps)", "kfac.inv_update_steps",
        number("kfac.inv_update_steps", 50, { step: 1 })),
      field("Memory budget", "memory_budget", text("memory_budget", "2GiB"),
        "per worker, e.g. 512MiB; what kfac: auto must stay under")),
    h("fieldset", {}, h("legend", {}, "Run"),
      field("Workers", "scaling.workers", number("scaling.workers", 2, { step: 1 })),
      field("Steps", "stop.max_steps", number("stop.max_steps", 1000, { step: 1 })),
      field("Stop at test accuracy", "stop.target.value", number("stop.target.value", "", { step: "any" }),
        "e.g. 0.88; empty: run all the steps"),
      field("Evaluate every (steps)", "eval_every", number("eval_every", 25, { step: 1 }))),
    h("div", { class: "form-errors error", id: "form-errors", role: "alert" }),
    h("button", { type: "submit", id: "submit" }, "Submit job"));
  view.append(h("section", {}, h("h1", {}, "New job"),
    h("p", { class: "muted" }, "A declarative JobSpec from the registered models and datasets. ",
      "The service checks it and names every field it refuses."), form));

  const kfacFields = ["kfac.damping", "kfac.factor_update_steps", "kfac.inv_update_steps"];
  const strategySelect = form.querySelector('[name="kfac.strategy"]');
  const syncKfac = () => {
    for (const name of kfacFields) {
      form.querySelector(`[data-field="${name}"]`).hidden = strategySelect.value === "off";
    }
  };
  strategySelect.addEventListener("change", syncKfac);
  syncKfac();

  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    for (const node of form.querySelectorAll(".field-error")) node.textContent = "";
    for (const node of form.querySelectorAll(".field.invalid")) node.classList.remove("invalid");
    const errors = document.getElementById("form-errors");
    errors.replaceChildren();
    const spec = {};
    const set = (path, value) => {
      const parts = path.split(".");
      let node = spec;
      for (const part of parts.slice(0, -1)) node = node[part] = node[part] || {};
      node[parts[parts.length - 1]] = value;
    };
    for (const input of form.querySelectorAll("input, select")) {
      if (input.closest(".field").hidden) continue;
      const raw = input.value.trim();
      if (raw === "") continue; // optional: left to the spec's default
      const isNumber = input.type === "number";
      set(input.name, isNumber && !Number.isNaN(Number(raw)) ? Number(raw) : raw);
    }
    if (spec.kfac && spec.kfac.strategy === "off") spec.kfac = "off";
    if (spec.stop && spec.stop.target) spec.stop.target.metric = "test_accuracy";
    const button = document.getElementById("submit");
    button.disabled = true;
    try {
      await submitJob(spec);
    } catch (err) {
      button.disabled = false;
      const problems = (err.body && err.body.problems) || [];
      if (!problems.length) errors.append(h("p", {}, err.message));
      for (const problem of problems) {
        // The field itself, else the closest enclosing one shown (kfac for kfac.strategy...).
        let name = problem.field;
        let box = null;
        while (name && !(box = form.querySelector(`[data-field="${name}"]:not([hidden])`))) {
          name = name.includes(".") ? name.slice(0, name.lastIndexOf(".")) : "";
        }
        if (box) {
          box.classList.add("invalid");
          const slot = box.querySelector(".field-error");
          slot.textContent = slot.textContent ? `${slot.textContent}; ${problem.message}` : problem.message;
        } else {
          errors.append(h("p", {}, `${problem.field}: ${problem.message}`));
        }
      }
    }
  });
}

// -- start ----------------------------------------------------------------------------------

document.getElementById("token-form").addEventListener("submit", () => {});
document.getElementById("forget-token").hidden = !token;
document.getElementById("forget-token").addEventListener("click", () => {
  localStorage.removeItem(TOKEN_KEY);
  token = null;
  document.getElementById("forget-token").hidden = true;
  route();
});
window.addEventListener("hashchange", route);
route();
