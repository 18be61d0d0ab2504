// kfac: auto's decision on a job's page: what the tuner chose and how, and every candidate
// with its predicted memory and time, and why the budget ruled it out.

import { fmt, h, mib } from "./dom.js";

export function renderTuner(box, job) {
  const auto = job.spec.kfac !== "off" && job.spec.kfac.strategy === "auto";
  // A fixed strategy has no tuner: no box at all, rather than an empty one.
  box.hidden = !auto && !job.tuner;
  if (job.spec.sweep) {
    box.replaceChildren(auto
      ? h("p", { class: "muted" }, "Every trial runs with kfac: auto: its own tuner chooses its K-FAC strategy under the memory budget.")
      : "");
    return;
  }
  const record = job.tuner;
  if (!record) {
    box.replaceChildren(auto
      ? h("p", { class: "muted" }, "kfac: auto: the tuner's decision appears once it has profiled the workers.")
      : "");
    return;
  }
  const chosen = record.chosen;
  const same = (c) => c.grad_worker_fraction === chosen.grad_worker_fraction &&
    c.factor_update_steps === chosen.factor_update_steps &&
    c.inv_update_steps === chosen.inv_update_steps;
  const candidates = record.candidates || [];
  const fits = candidates.filter((c) => !c.rejected).length;
  box.replaceChildren(
    h("h2", {}, "The tuner's decision"),
    h("p", { class: "decision" },
      `Chose gradient worker fraction ${chosen.grad_worker_fraction}, factors every ${chosen.factor_update_steps} `,
      `and inverses every ${chosen.inv_update_steps} steps`,
      chosen.adaptive
        ? `, from where each layer's intervals adapt over ${chosen.adaptive.rungs.map((r) => r.join("/")).join(", ")} `
          + `to keep its staleness within ${chosen.adaptive.target_angle}° (K-FAC intervals per layer, below)`
        : "",
      ` (${record.how}). Budget `,
      record.budget_bytes ? mib(record.budget_bytes) : "none",
      `; ${fits} of ${candidates.length} candidates fit. Profiling `,
      record.cache === "hit" ? "came from the tuner's cache" : `took ${fmt(record.profile_s)} s`,
      `; the plain step (no K-FAC) takes ${fmt(record.plain_ms_per_step)} ms.`),
    h("table", { class: "candidates" },
      h("thead", {}, h("tr", {}, ["worker fraction", "factor / inverse every", "predicted memory",
        "K-FAC state", "predicted ms / step", "verdict"].map((c) => h("th", {}, c)))),
      h("tbody", {}, candidates.map((c) => h("tr", {
        class: same(c) ? "chosen" : c.rejected ? "rejected" : "",
      },
        h("td", { class: "num" }, c.grad_worker_fraction),
        h("td", { class: "num" }, `${c.factor_update_steps} / ${c.inv_update_steps}`),
        h("td", { class: "num" }, mib(c.memory_bytes)),
        h("td", { class: "num" }, mib(c.kfac_state_bytes)),
        h("td", { class: "num" }, fmt(c.ms_per_step)),
        h("td", {}, same(c) ? "chosen" : c.rejected ? `ruled out: ${c.rejected}` : "fits"))))));
}
