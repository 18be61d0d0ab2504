// The service's REST API and event streams, with the token (asked for once, kept in this
// browser until forgotten).

import { sleep } from "./dom.js";

const TOKEN_KEY = "kaisa-ray-token";

export class ApiError extends Error {
  constructor(status, body) {
    const detail = body && typeof body === "object" ? body.detail : body;
    super(detail || `HTTP ${status}`);
    this.status = status;
    this.body = body;
  }
}

let token = localStorage.getItem(TOKEN_KEY);
let asking = null;

export function hasToken() {
  return Boolean(token);
}

export function forgetToken() {
  localStorage.removeItem(TOKEN_KEY);
  token = null;
}

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

export async function api(path, { method = "GET", json, signal } = {}) {
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

export function live(on) {
  const node = document.getElementById("live");
  node.textContent = on ? "live" : "reconnecting…";
  node.classList.toggle("on", on);
}

/** Follow a server-sent event stream (fetch, so that it can carry the token). Calls
 *  onEvent(name, data) for each event; reconnects after a network error; returns when the
 *  stream ends (a job's stream ends with the job) or the signal aborts. */
export async function follow(path, onEvent, signal, onOpen) {
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
