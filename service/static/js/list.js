// The job list: every job, newest first, live from the stream of every job; filters by state
// (the states from the registry).

import { api, follow } from "./api.js";
import { badge, columnValue, elapsedText, progressBar, strategy } from "./display.js";
import { every, h, when } from "./dom.js";
import { registry } from "./registry.js";

export async function listPage(view, hash, signal) {
  const sets = await registry();
  const query = new URLSearchParams(hash.split("?")[1] || "");
  const wanted = new Set(query.getAll("state").filter((s) => sets.job_states.includes(s)));
  const filters = h("div", { class: "filters", role: "group", "aria-label": "filter by state" },
    h("a", { href: "#/", class: wanted.size ? "chip" : "chip on" }, "all"),
    sets.job_states.map((state) => {
      const next = new Set(wanted);
      if (next.has(state)) next.delete(state); else next.add(state);
      const params = new URLSearchParams([...next].map((s) => ["state", s]));
      return h("a", { href: `#/?${params}`, class: wanted.has(state) ? "chip on" : "chip",
                      "data-filter": state }, state.toLowerCase());
    }));
  const body = h("tbody", { id: "jobs" });
  const empty = h("p", { class: "empty", hidden: true }, "No jobs here yet. ",
    h("a", { href: "#/new" }, "Submit one."));
  const loading = h("p", { class: "empty", id: "jobs-loading" }, "Loading the jobs…");
  view.append(
    h("section", {},
      h("div", { class: "heading" }, h("h1", {}, "Jobs"), filters),
      h("table", { class: "jobs" },
        h("thead", {}, h("tr", {},
          ["name", "state", "progress", ...sets.columns.map((c) => c.label), "strategy",
            "started", "elapsed"].map((c) => h("th", {}, c)))),
        body),
      loading, empty));

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
    const cells = [
      h("td", {}, h("a", { href: `#/jobs/${job.id}`, class: "job-link" }, job.name)),
      h("td", {}, badge(job.state)),
      h("td", { class: "progress" }, progressBar(job, sets)),
      ...sets.columns.map((c) => h("td", { class: "num", "data-col": c.id }, columnValue(c, m, sets))),
      h("td", {}, strategy(job)),
      h("td", {}, when(job.started_at)),
      h("td", { class: "num", "data-col": "elapsed" }, elapsedText(job)),
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
      loading.remove();
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
    if (data.kind === sets.kind.trial || data.kind === sets.kind.sweep) {
      // A sweep's progress is its trials that are over: read the job again when one ends
      // (its evaluations are a trial's, not the job's).
      if (data.kind === sets.kind.sweep || sets.trialEnded.has(data.state)) {
        api(`/v1/jobs/${data.job_id}`, { signal }).then((fresh) => {
          if (jobs.has(fresh.id)) render(fresh);
        }).catch(() => {});
      }
      return;
    }
    const metrics = { ...job.metrics };
    for (const { kind, field } of sets.metrics) {
      if (kind === data.kind && data[field] !== undefined) metrics[field] = data[field];
    }
    const step = data.step ?? job.progress.step;
    const total = job.progress.total;
    render({ ...job, metrics,
             progress: { step, total, percent: total ? Math.round(10000 * step / total) / 100 : null } });
  }

  every(1000, () => {
    for (const [id, row] of rows) {
      const job = jobs.get(id);
      if (job && !sets.finished.has(job.state)) {
        row.querySelector('[data-col="elapsed"]').textContent = elapsedText(job);
      }
    }
  });

  // The list at once, so that the page shows the jobs while the stream connects (through a
  // slow proxy, say); then on the stream's "ready" (and on every reconnection) the list is read
  // again, so that no change between the list and the stream is missed.
  load();
  await follow("/v1/events", onEvent, signal);
}
