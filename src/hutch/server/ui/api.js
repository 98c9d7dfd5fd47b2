// The dashboard's calls to the daemon's /v1 API, with its session (the
// HttpOnly cookie the login set; no script can read it) and the header the
// daemon asks for beside it, which no other site's form or link can send.

export class ApiError extends Error {
  constructor(status, code, message) {
    super(message);
    this.status = status;
    this.code = code;
  }
}

const listeners = new Set();
/** Call `fn` when a call is refused for want of a session (401). */
export function onUnauthorized(fn) { listeners.add(fn); }

function headers(extra = {}) {
  return { "X-Hutch-UI": "1", ...extra };
}

async function failure(response, { session = true } = {}) {
  let code = "error", message = `${response.status} ${response.statusText}`;
  try {
    const body = await response.json();
    if (body && body.error) { code = body.error.code; message = body.error.message; }
  } catch { /* not JSON: the status says it */ }
  if (response.status === 401 && session) listeners.forEach((fn) => fn());
  return new ApiError(response.status, code, message);
}

/** A JSON call: the answer's JSON, null for 204; ApiError otherwise. */
export async function api(method, path, body) {
  const init = { method, headers: headers(), credentials: "same-origin", cache: "no-store" };
  if (body !== undefined) {
    init.headers["Content-Type"] = "application/json";
    init.body = JSON.stringify(body);
  }
  const response = await fetch(path, init);
  if (!response.ok) throw await failure(response);
  if (response.status === 204) return null;
  return response.json();
}

/** A call whose answer is bytes (a file): the Blob. */
export async function apiBlob(path) {
  const response = await fetch(path, { headers: headers(), credentials: "same-origin" });
  if (!response.ok) throw await failure(response);
  return response.blob();
}

/** Log in with the token (in the body, never the address): the session cookie comes back. */
export async function login(token) {
  const response = await fetch("/ui/login", {
    method: "POST", credentials: "same-origin",
    headers: { "Content-Type": "application/json" }, body: JSON.stringify({ token }),
  });
  if (!response.ok) throw await failure(response, { session: false });
}

export async function logout() {
  await fetch("/ui/logout", { method: "POST", credentials: "same-origin", headers: headers() });
}

/**
 * Follow an NDJSON stream (the event log's /v1/events/follow): `onLine` gets
 * each parsed line; the stream is opened again after a break (`onState`
 * says whether it is up), until `signal` aborts.
 */
export async function followLines(path, onLine, { signal, onState = () => {} } = {}) {
  let delay = 500;
  while (!signal.aborted) {
    try {
      const response = await fetch(path, { headers: headers(), credentials: "same-origin", signal });
      if (!response.ok) throw await failure(response);
      onState(true);
      delay = 500;
      const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
      let buffered = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buffered += value;
        let newline;
        while ((newline = buffered.indexOf("\n")) >= 0) {
          const line = buffered.slice(0, newline).trim();
          buffered = buffered.slice(newline + 1);
          if (line) onLine(JSON.parse(line));
        }
      }
    } catch (error) {
      if (signal.aborted) return;
      if (error instanceof ApiError && error.status === 401) { onState(false); return; }
    }
    onState(false);
    if (signal.aborted) return;
    await new Promise((resolve) => setTimeout(resolve, delay));
    delay = Math.min(delay * 2, 10000);
  }
}

export const enc = encodeURIComponent;
