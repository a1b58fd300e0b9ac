// The gateway's HTTP API as the console calls it: the API key (kept in session storage, sent as
// a header, or as `?access_token=` where a header cannot be set), errors as `{error}`.

const KEY = "dispatch.apiKey";

/** An answer other than 2xx, with the gateway's own sentence. */
export class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

let unauthorized = () => {};

/** Called with whether a key had been tried, whenever the gateway answers 401. */
export function onUnauthorized(callback) {
  unauthorized = callback;
}

export function apiKey() {
  return sessionStorage.getItem(KEY) || "";
}

export function setApiKey(key) {
  sessionStorage.setItem(KEY, key);
}

/** `path` with the key as `access_token`, for EventSource and WebSocket. */
export function withToken(path) {
  const key = apiKey();
  if (!key) return path;
  return `${path}${path.includes("?") ? "&" : "?"}access_token=${encodeURIComponent(key)}`;
}

/** One request; resolves to the parsed body, rejects with an `ApiError`. */
export async function request(method, path, body) {
  const headers = {};
  const key = apiKey();
  if (key) headers.Authorization = `Bearer ${key}`;
  if (body !== undefined) headers["Content-Type"] = "application/json";
  let response;
  try {
    response = await fetch(path, { method, headers, body: body === undefined ? undefined : JSON.stringify(body) });
  } catch {
    throw new ApiError(0, "the gateway does not answer");
  }
  const text = await response.text();
  const type = response.headers.get("content-type") || "";
  let data = text;
  if (type.includes("json") && text) {
    try {
      data = JSON.parse(text);
    } catch {
      data = text;
    }
  }
  if (response.status === 401) {
    unauthorized(Boolean(key));
  }
  if (!response.ok) {
    throw new ApiError(response.status, (data && data.error) || `${response.status} ${response.statusText}`);
  }
  return data;
}

export const get = (path) => request("GET", path);
export const post = (path, body = {}) => request("POST", path, body);
export const put = (path, body) => request("PUT", path, body);
export const del = (path) => request("DELETE", path);

/** The reads that refresh one view: only the newest one's answer counts (an older read that
 * answers after it would put back what it replaced), and `element` is `aria-busy` while any is
 * out. */
export class Reads {
  constructor(element) {
    this.element = element;
    this.started = 0;
    this.out = 0;
  }

  /** `get(path)`, or `undefined` when a newer read started meanwhile (its error too). */
  async newest(path) {
    const mine = ++this.started;
    this.busy(1);
    try {
      const answer = await get(path);
      return mine === this.started ? answer : undefined;
    } catch (e) {
      if (mine === this.started) throw e;
      return undefined;
    } finally {
      this.busy(-1);
    }
  }

  busy(by) {
    this.out += by;
    this.element.setAttribute("aria-busy", String(this.out > 0));
  }
}

/** A conversation id: a UUIDv4, from `getRandomValues` (which, unlike `randomUUID`, works on
 * plain http pages away from localhost). */
export function newConversationId() {
  const b = crypto.getRandomValues(new Uint8Array(16));
  b[6] = (b[6] & 0x0f) | 0x40;
  b[8] = (b[8] & 0x3f) | 0x80;
  const hex = [...b].map((x) => x.toString(16).padStart(2, "0")).join("");
  return `${hex.slice(0, 8)}-${hex.slice(8, 12)}-${hex.slice(12, 16)}-${hex.slice(16, 20)}-${hex.slice(20)}`;
}

export const conversationPath = (id) => `/conversations/${encodeURIComponent(id)}`;
