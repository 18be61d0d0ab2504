// "What would this cost?" beside the submit form: the job the form describes, priced by
// POST /v1/plan on a hardware preset (memory and collectives per strategy, the predicted step,
// the tuner's choice under the budget) before anything is submitted.

import { api } from "./api.js";
import { fmt, h, mib } from "./dom.js";
import { formSpec } from "./form.js";

const GiB = 2 ** 30;
let presets = null;

const gib = (bytes) => `${(bytes / GiB).toFixed(2)} GiB`;
const ms = (seconds) => `${fmt(seconds * 1e3, 4)} ms`;

function chosenText(c) {
  return `${c.strategy} (f = ${fmt(c.grad_worker_fraction)}) at ${c.factor_update_steps}/` +
    `${c.inv_update_steps}: ${ms(c.step_s)} per step, K-FAC +${Math.round(100 * c.overhead)}% ` +
    `over the plain step, ${gib(c.memory_bytes)} per GPU`;
}

function render(out, report) {
  const inputs = report.inputs;
  const choice = report.choices[0];
  const best = (s) => s.candidates.reduce((a, b) => (b.step_s < a.step_s ? b : a));
  const rows = report.strategies.map((s) => {
    const c = best(s);
    const fits = c.memory_bytes <= choice.budget_bytes;
    return h("tr", { class: choice.chosen && choice.chosen.grad_worker_fraction === s.grad_worker_fraction ? "chosen" : "" },
      h("td", {}, s.strategy), h("td", { class: "num" }, fmt(s.grad_worker_fraction)),
      h("td", { class: "num" }, mib(s.memory.factors)), h("td", { class: "num" }, mib(s.memory.decompositions)),
      h("td", { class: "num" }, mib(s.memory.total)),
      h("td", { class: "num" }, `${c.factor_update_steps}/${c.inv_update_steps}`),
      h("td", { class: "num" }, ms(c.step_s)), h("td", { class: "num" }, ms(c.parts_s.communication)),
      h("td", {}, fits ? "fits" : "over the budget"));
  });
  out.replaceChildren(
    h("p", { id: "plan-choice" },
      `${inputs.workers} x ${inputs.gpu} (${inputs.nodes} node(s) of ${inputs.gpus_per_node}), `,
      `budget ${gib(choice.budget_bytes)} per GPU: `,
      choice.chosen ? h("strong", {}, `the tuner would choose ${chosenText(choice.chosen)}`)
        : h("strong", { class: "error" }, choice.reason)),
    h("table", { id: "plan-table" },
      h("thead", {}, h("tr", {}, ["strategy", "f", "factors", "decomp.", "K-FAC", "intervals",
        "step", "comm.", "budget"].map((t) => h("th", {}, t)))),
      h("tbody", {}, rows)),
    h("p", { class: "muted" },
      `K-FAC memory in MiB on the worst rank; the fastest interval pair of each strategy. `,
      `Plain step ${ms(report.basis.plain_step_s)} (${report.basis.plain_step_source}); `,
      `base ${gib(report.basis.base_memory_bytes)} per GPU. Predicted from the model's shapes `,
      `and the hardware profile (numbers: ${Object.entries(report.basis.hardware_numbers_by_kind)
        .map(([k, n]) => `${n} ${k}`).join(", ")}); nothing ran.`),
    h("p", { class: "muted" }, "Where the choice changes as the budget grows: ",
      report.changes.map((c) => `from ${gib(c.from_budget_bytes)}: ${c.strategy} ` +
        `${c.factor_update_steps}/${c.inv_update_steps}`).join("; ") || "nowhere"));
}

async function attach(form) {
  if (document.getElementById("plan-box")) return;
  const box = h("section", { id: "plan-box" });
  form.closest("section").after(box);
  presets = presets || await api("/v1/plan/hardware");
  const hardware = h("select", { id: "plan-hardware" },
    presets.map((p) => h("option", { value: p.name }, `${p.name}: ${p.gpus_per_node} x ${p.gpu}`)));
  const workers = h("input", { id: "plan-workers", type: "number", step: 1, min: 1,
    placeholder: "the job's workers" });
  const budget = h("input", { id: "plan-budget", placeholder: "the job's memory budget" });
  const button = h("button", { type: "button", id: "plan-button" }, "What would this cost?");
  const out = h("div", { id: "plan-result", role: "status" });
  box.append(h("h2", {}, "What would this cost?"),
    h("p", { class: "muted" }, "This job on GPUs of a hardware profile: K-FAC's memory and ",
      "communication per strategy and the tuner's choice, priced from the model's shapes ",
      "(kaisa-ray plan). Nothing is submitted."),
    h("form", { id: "plan-form", novalidate: true, onsubmit: (e) => e.preventDefault() },
      h("fieldset", {}, h("legend", {}, "Priced on"),
        h("div", { class: "field" }, h("label", { for: "plan-hardware" }, "Hardware"), hardware),
        h("div", { class: "field" }, h("label", { for: "plan-workers" }, "GPUs"), workers),
        h("div", { class: "field" }, h("label", { for: "plan-budget" }, "Budget per GPU"), budget)),
      button),
    out);
  button.addEventListener("click", async () => {
    const body = { spec: formSpec(form), hardware: hardware.value };
    if (workers.value.trim()) body.workers = Number(workers.value);
    if (budget.value.trim()) body.budgets = [budget.value.trim()];
    button.disabled = true;
    out.replaceChildren(h("p", { class: "muted" }, "pricing…"));
    try {
      render(out, await api("/v1/plan", { method: "POST", json: body }));
      out.scrollIntoView({ block: "nearest" });
    } catch (err) {
      const problems = (err.body && err.body.problems) || [];
      out.replaceChildren(h("p", { class: "error", id: "plan-error" },
        problems.length ? problems.map((p) => `${p.field}: ${p.message}`).join("; ")
          : (err.body && err.body.detail) || err.message));
    } finally {
      button.disabled = false;
    }
  });
}


/** Add the box beside the form, once (the router calls it when the form is shown). */
export function planBox(form) {
  attach(form).catch((err) => console.warn("plan box:", err));
}
