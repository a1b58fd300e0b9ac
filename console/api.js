// The gateway's HTTP API as the console calls it: signed in by the session cookie (`POST
// /auth/session` with a token or key; the page's scripts never hold the credential after that,
// and the browser sends the cookie with every request, EventSource and WebSocket included),
// errors as `{error}`.

/** An answer other than 2xx, with the gateway's own sentence. */
export class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

let unauthorized = () => {};

/** Called whenever the gateway answers 401 (not signed in, or the session ended). */
export function onUnauthorized(callback) {
  unauthorized = callback;
}

/** Who is signed in (`GET /auth/session`): `{subject, admin, expiresAt}`, or null. */
export let session = null;

/** Asks the gateway who the page is signed in as; null when nobody (401). */
export async function whoAmI() {
  try {
    session = await request("GET", "/auth/session", undefined, { quiet: true });
  } catch (e) {
    if (!(e instanceof ApiError) || e.status !== 401) throw e;
    session = null;
  }
  return session;
}

/** Signs the page in with a token or key: the answer sets the session cookie. */
export async function signIn(token) {
  await request("POST", "/auth/session", { token }, { quiet: true });
  return whoAmI();
}

export async function signOut() {
  await request("DELETE", "/auth/session", undefined, { quiet: true });
  session = null;
}

/** One request; resolves to the parsed body, rejects with an `ApiError`. */
export async function request(method, path, body, { quiet = false } = {}) {
  const headers = {};
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
  if (response.status === 401 && !quiet) {
    unauthorized();
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
