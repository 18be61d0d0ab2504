// Small helpers of every view: elements, numbers and times as text, timers the router clears.

/** An element: h("td", {class: "x"}, "text", child, ...). Text is always text, never HTML. */
export function h(tag, attrs, ...children) {
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

export const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

/** A number for people: 5,660 (not toPrecision's 5.66e+3), 12.3, 0.0123; "–" for none. */
export function fmt(value, digits = 3) {
  if (value === undefined || value === null || Number.isNaN(value)) return "–";
  if (typeof value !== "number") return String(value);
  // From 10^(digits-1) on, whole numbers (toPrecision would write 5660 as 5.66e+3).
  if (Number.isInteger(value) || Math.abs(Number(value.toPrecision(digits))) >= 10 ** (digits - 1)) {
    return Math.round(value).toLocaleString("en-US");
  }
  return value.toPrecision(digits);
}

export function percent(value) {
  return value === undefined || value === null ? "–" : `${(100 * value).toFixed(1)}%`;
}

export function mib(bytes) {
  return bytes === undefined || bytes === null ? "–" : `${(bytes / 2 ** 20).toFixed(2)} MiB`;
}

export function when(iso) {
  return iso ? new Date(iso).toLocaleString(undefined, { hour12: false }) : "–";
}

export function duration(seconds) {
  if (seconds === null || seconds === undefined || seconds < 0) return "–";
  const s = Math.round(seconds);
  const hours = Math.floor(s / 3600);
  const minutes = Math.floor((s % 3600) / 60);
  const rest = s % 60;
  if (hours) return `${hours} h ${String(minutes).padStart(2, "0")} min`;
  if (minutes) return `${minutes} min ${String(rest).padStart(2, "0")} s`;
  return `${rest} s`;
}

/** A drawn hyperparameter, short: 0.05, 0.00231, 1.2e-5 (not toPrecision's 0.0500). */
export function short(value, digits = 3) {
  if (typeof value !== "number" || Number.isInteger(value)) return fmt(value);
  return String(Number(value.toPrecision(digits)));
}

const timers = new Set();

/** setInterval, cleared when the view changes (``clearTimers``). */
export function every(ms, fn) {
  const id = setInterval(fn, ms);
  timers.add(id);
  return id;
}

export function clearTimers() {
  for (const id of timers) clearInterval(id);
  timers.clear();
}
