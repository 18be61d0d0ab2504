// The kaisa-ray dashboard: the job list, a job's page and the submit form, on the service's
// own REST API and event streams. ES modules with no build step, and no third-party code but
// Plotly, which the service serves from the plotly package installed beside it. The closed
// sets the views use (states, strategies, record kinds...) come from GET /v1/registry.

import { forgetToken, hasToken } from "./api.js";
import { clearTimers, h } from "./dom.js";
import { formPage } from "./form.js";
import { jobPage } from "./job.js";
import { listPage } from "./list.js";
import { planBox } from "./plan.js";

let current = null; // the shown view's AbortController: leaving a view stops its streams

async function showForm(view, signal) {
  await formPage(view, signal);
  planBox(document.getElementById("submit-form"));
}

function route() {
  if (current) current.abort();
  clearTimers();
  current = new AbortController();
  const view = document.getElementById("view");
  view.replaceChildren();
  const hash = location.hash || "#/";
  const job = hash.match(/^#\/jobs\/([A-Za-z0-9]+)$/);
  document.getElementById("nav-new").classList.toggle("here", hash === "#/new");
  document.getElementById("nav-jobs").classList.toggle("here", !job && hash !== "#/new");
  const signal = current.signal;
  const show = job ? jobPage(view, job[1], signal)
    : hash === "#/new" ? showForm(view, signal)
    : listPage(view, hash, signal);
  show.catch((err) => {
    if (signal.aborted) return;
    view.append(h("p", { class: "error", role: "alert" }, err.message));
  });
}

document.getElementById("token-form").addEventListener("submit", () => {});
document.getElementById("forget-token").hidden = !hasToken();
document.getElementById("forget-token").addEventListener("click", () => {
  forgetToken();
  document.getElementById("forget-token").hidden = true;
  route();
});
window.addEventListener("hashchange", route);
route();
