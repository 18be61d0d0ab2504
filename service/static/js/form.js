// The submit form: a JobSpec from the registered models and datasets and the registry's
// optimizers and strategies; the service checks it and every field it refuses is named
// next to that field.

import { api } from "./api.js";
import { h } from "./dom.js";
import { registry } from "./registry.js";

/** POST a JobSpec (with the token, as every call) and show the new job's page. */
export async function submitJob(spec) {
  const job = await api("/v1/jobs", { method: "POST", json: spec });
  location.hash = `#/jobs/${job.id}`;
  return job;
}

/** The JobSpec the form holds: each shown field by its dotted name (empty ones are left to
 *  the spec's defaults); plan.js prices the same spec. */
export function formSpec(form) {
  const spec = {};
  for (const input of form.querySelectorAll("input, select")) {
    const field = input.closest(".field");
    if (!field || field.hidden) continue;
    const raw = input.value.trim();
    if (raw === "") continue; // optional: left to the spec's default
    const value = input.type === "number" && !Number.isNaN(Number(raw)) ? Number(raw) : raw;
    const parts = input.name.split(".");
    let node = spec;
    for (const part of parts.slice(0, -1)) node = node[part] = node[part] || {};
    node[parts[parts.length - 1]] = value;
  }
  if (spec.kfac && spec.kfac.strategy === "off") spec.kfac = "off";
  return spec; // a stop.target's metric is the spec's default: the test accuracy
}

export async function formPage(view, signal) {
  const sets = await registry();
  const field = (label, name, input, help) => h("div", { class: "field", "data-field": name },
    h("label", { for: `f-${name}` }, label), input,
    help ? h("small", {}, help) : null,
    h("span", { class: "field-error", role: "alert" }));
  const text = (name, value, attrs) => h("input", { id: `f-${name}`, name, value, ...attrs });
  const number = (name, value, attrs) => text(name, value, { type: "number", step: "any", ...attrs });
  const select = (name, options, value) => h("select", { id: `f-${name}`, name },
    options.map(([v, label]) => h("option", { value: v, selected: v === value }, label)));
  const named = (values) => values.map((v) => [v, v]);
  const first = (values, preferred) => (values.includes(preferred) ? preferred : values[0]);
  // Each field starts at the JobSpec's own default, as the service states it, or the
  // service's example where a job must give it (a name, steps); else empty.
  const initial = (name) => sets.defaults[name] ?? sets.starter[name] ?? "";

  const strategies = [...named(sets.strategies), ["off", "off (no K-FAC)"]];
  const form = h("form", { id: "submit-form", novalidate: true },
    h("fieldset", {}, h("legend", {}, "Job"),
      field("Name", "name", text("name", initial("name"), { required: true }),
        "letters, digits, '.', '_' and '-'"),
      field("Model", "model.name", select("model.name", named(sets.models), first(sets.models, "lenet"))),
      field("Dataset", "dataset.name", select("dataset.name", named(sets.datasets),
        first(sets.datasets, "fashion-mnist"))),
      field("Batch size", "dataset.batch_size", number("dataset.batch_size", initial("dataset.batch_size"), { step: 1 })),
      field("Samples (limit)", "dataset.limit", number("dataset.limit", initial("dataset.limit"), { step: 1 }),
        "empty: the whole dataset")),
    h("fieldset", {}, h("legend", {}, "Optimizer and K-FAC"),
      field("Optimizer", "optimizer.name", select("optimizer.name", named(sets.optimizers), initial("optimizer.name"))),
      field("Learning rate", "optimizer.lr", number("optimizer.lr", initial("optimizer.lr"))),
      field("K-FAC strategy", "kfac.strategy", select("kfac.strategy", strategies, initial("kfac.strategy")),
        "auto: the tuner chooses, under the memory budget"),
      field("Damping", "kfac.damping", number("kfac.damping", initial("kfac.damping"))),
      field("Factors every (steps)", "kfac.factor_update_steps",
        number("kfac.factor_update_steps", initial("kfac.factor_update_steps"), { step: 1 })),
      field("Inverses every (steps)", "kfac.inv_update_steps",
        number("kfac.inv_update_steps", initial("kfac.inv_update_steps"), { step: 1 })),
      field("Memory budget", "memory_budget", text("memory_budget", initial("memory_budget"), { placeholder: "e.g. 2GiB" }),
        "per worker; what kfac: auto must stay under; empty: no budget")),
    h("fieldset", {}, h("legend", {}, "Run"),
      field("Workers", "scaling.workers", number("scaling.workers", initial("scaling.workers"), { step: 1 })),
      field("Steps", "stop.max_steps", number("stop.max_steps", initial("stop.max_steps"), { step: 1 })),
      field("Stop at test accuracy", "stop.target.value", number("stop.target.value", initial("stop.target.value"), { step: "any" }),
        "e.g. 0.88; empty: run all the steps"),
      field("Evaluate every (steps)", "eval_every", number("eval_every", initial("eval_every"), { step: 1 }))),
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
    const button = document.getElementById("submit");
    button.disabled = true;
    try {
      await submitJob(formSpec(form));
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
