// Talking to the gateway: keys, requests, errors a person can act on, and SSE streams.
// Keys travel only as Authorization headers to this origin, never in a URL.

const KEY_NAMES = { api: "zeroserve.apiKey", admin: "zeroserve.adminKey" };

export const keys = {
  get(kind) {
    const name = KEY_NAMES[kind];
    return sessionStorage.getItem(name) || localStorage.getItem(name) || "";
  },
  isRemembered() {
    return Object.values(KEY_NAMES).some((name) => localStorage.getItem(name));
  },
  // remember: localStorage (survives the browser); otherwise sessionStorage (this tab).
  set(kind, value, remember) {
    const name = KEY_NAMES[kind];
    sessionStorage.removeItem(name);
    localStorage.removeItem(name);
    if (value) (remember ? localStorage : sessionStorage).setItem(name, value);
  },
  // The admin API takes an admin key, or an API key when the server has no admin keys.
  forAdmin() {
    return this.get("admin") || this.get("api");
  },
};

export class ApiError extends Error {
  constructor(status, message, { code = null, retryAfter = null, detail = "" } = {}) {
    super(message);
    this.status = status; // 0: no answer at all
    this.code = code;
    this.detail = detail; // the server's own message
    this.retryAfter = retryAfter; // seconds, from Retry-After
  }
}

function retryAfterSeconds(response) {
  const value = response.headers.get("retry-after");
  if (!value) return null;
  const seconds = Number(value);
  if (Number.isFinite(seconds)) return Math.max(0, Math.ceil(seconds));
  const date = Date.parse(value);
  return Number.isNaN(date) ? null : Math.max(0, Math.ceil((date - Date.now()) / 1000));
}

// What a person should read for a refusal: the status, what it means, what to do.
export function explain(status, serverMessage, retryAfter, keyKind = "api") {
  const wait = retryAfter == null ? "" : ` Retry in ${retryAfter} s.`;
  const detail = serverMessage ? ` (${serverMessage})` : "";
  switch (status) {
    case 401:
      return keyKind === "admin"
        ? `401 Unauthorized: the admin key is missing or wrong. Enter it under Keys.${detail}`
        : `401 Unauthorized: this server needs an API key. Enter a valid key under Keys.${detail}`;
    case 403:
      return `403 Forbidden: not allowed for this key or from this address.${detail}`;
    case 429:
      return `429 Too many requests: the server is at its limit.${wait}${detail}`;
    case 503:
      return `503 Service unavailable: no worker could take the request now.${wait}${detail}`;
    default:
      return `${status} error${detail}`;
  }
}

// fetch with the right key and headers; throws ApiError on a refusal or no answer.
// timeoutMs: give up on a gateway that accepted the connection and says nothing (stalled).
export async function call(path, { method = "GET", body = undefined, key = "api", signal, timeoutMs } = {}) {
  if (timeoutMs) signal = signal ? AbortSignal.any([signal, AbortSignal.timeout(timeoutMs)]) : AbortSignal.timeout(timeoutMs);
  const headers = { Accept: "application/json" };
  const token = key === "admin" ? keys.forAdmin() : key === "api" ? keys.get("api") : "";
  if (token) headers.Authorization = `Bearer ${token}`;
  if (method !== "GET") headers["Content-Type"] = "application/json";
  // A custom header: a cross-site form or simple request cannot send it, and the gateway
  // wants one on every admin call made without an admin key, GET included.
  if (key === "admin") headers["X-Zeroserve-Admin"] = "1";
  let response;
  try {
    response = await fetch(path, {
      method, headers, signal, cache: "no-store", credentials: "omit", referrerPolicy: "no-referrer",
      body: body === undefined ? undefined : JSON.stringify(body),
    });
  } catch (err) {
    if (err.name === "AbortError") throw err;
    throw new ApiError(0, "The gateway does not answer (it may be restarting): try again when the page says it is reconnected.");
  }
  if (!response.ok) {
    let message = "";
    let code = null;
    try {
      const error = (await response.json()).error || {};
      message = error.message || "";
      code = error.code || null;
    } catch {
      message = response.statusText;
    }
    const retryAfter = retryAfterSeconds(response);
    if (response.status === 401 && key === "api") window.dispatchEvent(new CustomEvent("zeroserve:unauthorized"));
    throw new ApiError(response.status, explain(response.status, message, retryAfter, key),
      { code, retryAfter, detail: message });
  }
  return response;
}

export async function getJson(path, key = "api", timeoutMs = undefined) {
  return (await call(path, { key, timeoutMs })).json();
}

// Server-sent events of a response: yields each event's data (a string), up to [DONE].
export async function* sseData(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let sep;
    while ((sep = buffer.match(/\r?\n\r?\n/)) !== null) {
      const block = buffer.slice(0, sep.index);
      buffer = buffer.slice(sep.index + sep[0].length);
      const data = block.split(/\r?\n/).filter((line) => line.startsWith("data:"))
        .map((line) => line.slice(5).replace(/^ /, "")).join("\n");
      if (!data) continue;
      if (data === "[DONE]") return;
      yield data;
    }
  }
}
