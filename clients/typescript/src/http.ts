/**
 * The SDK's HTTP leaf: where the daemon is, how a client proves who it is,
 * how a request is sent with the platform's `fetch` and its answer or error
 * decoded. Nothing here knows the SDK's objects.
 */
import type { Answer, JsonBody, Method, Query, Route, Target } from "./api.js";
import { CapabilityUnsupported, ERRORS_BY_CODE, HutchError, SandboxUnavailable } from "./generated/errors.js";

export const DEFAULT_URL = "http://127.0.0.1:8787";
export const SESSION_HEADER = "X-Hutch-Session";
/** Seconds a call waits for its answer unless it says otherwise (as the Python SDK). */
export const DEFAULT_CALL_SECONDS = 60;
/** Headroom on top of a command's own timeout before the call gives up. */
export const HTTP_GRACE_SECONDS = 30;
const REF_PREFIX = "hutch-ref:";
const TOKEN_FILE_NAME = "api-token";

type QueryValue = string | number | boolean | null | undefined;

export interface Call<M extends Method, P extends Route<M>> {
  query?: Query<M, P>;
  json?: JsonBody<M, P>;
  /** A raw body (a file's bytes), sent as `application/octet-stream`. */
  body?: Uint8Array | ReadableStream<Uint8Array>;
  /** Seconds to wait for the answer; `null` waits as long as it takes. */
  timeout?: number | null;
}

function env(name: string): string | undefined {
  const value = globalThis.process?.env?.[name];
  return value ? value : undefined;
}

/** The daemon's address: `url`, else `HUTCH_URL`, else hutch's default. */
export function clientUrl(url?: string): string {
  const chosen = (url ?? env("HUTCH_URL") ?? DEFAULT_URL).replace(/\/+$/, "");
  if (chosen.startsWith("http+unix:")) {
    throw new CapabilityUnsupported(
      `${chosen} is an in-process owner's unix socket: the TypeScript SDK reaches ` +
        "daemons over http(s) (use the Python SDK to attach to an in-process owner's ref)",
    );
  }
  return chosen;
}

function isLoopback(url: string): boolean {
  let host: string;
  try {
    host = new URL(url).hostname.replace(/^\[|\]$/g, "");
  } catch {
    return false;
  }
  return host === "localhost" || host === "::1" || /^127\.\d+\.\d+\.\d+$/.test(host);
}

/**
 * The token a daemon of this host made for itself (`$HUTCH_HOME/api-token`,
 * else `~/.local/share/hutch/api-token`), for a loopback `url` only: a remote
 * daemon is never sent a local one's token. Undefined if this user cannot read
 * one (or the platform has no file system).
 */
export async function localToken(url: string): Promise<string | undefined> {
  if (!isLoopback(url)) {
    return undefined;
  }
  try {
    const [{ readFile }, { homedir }, { join }] = await Promise.all([
      import("node:fs/promises"),
      import("node:os"),
      import("node:path"),
    ]);
    const home = env("HUTCH_HOME") ?? join(homedir(), ".local", "share", "hutch");
    const token = (await readFile(join(home, TOKEN_FILE_NAME), "utf8")).trim();
    return token || undefined;
  } catch {
    return undefined;
  }
}

/** A ref's fields (`hutch-ref:` + base64url JSON), or undefined if `ref` is not one. */
export function decodeRef(
  ref: string,
): { url: string; sandboxId: string; refId: string } | undefined {
  if (typeof ref !== "string" || !ref.startsWith(REF_PREFIX) || ref.length > 4096) {
    return undefined;
  }
  try {
    const data = JSON.parse(
      new TextDecoder().decode(fromBase64(ref.slice(REF_PREFIX.length), true)),
    ) as Record<string, unknown>;
    const { url, sandbox, id, secret } = data;
    if ([url, sandbox, id, secret].every((v) => typeof v === "string")) {
      return { url: url as string, sandboxId: sandbox as string, refId: id as string };
    }
  } catch {
    // not a ref
  }
  return undefined;
}

// -- bytes ------------------------------------------------------------------------------

const encoder = new TextEncoder();
const decoder = new TextDecoder();

export function utf8(text: string): Uint8Array {
  return encoder.encode(text);
}

/** Text of UTF-8 bytes; an invalid sequence becomes U+FFFD (as Python's errors="replace"). */
export function text(bytes: Uint8Array): string {
  return decoder.decode(bytes);
}

export function toBase64(bytes: Uint8Array): string {
  if (globalThis.Buffer) {
    return globalThis.Buffer.from(bytes.buffer, bytes.byteOffset, bytes.byteLength).toString("base64");
  }
  let binary = "";
  for (const byte of bytes) {
    binary += String.fromCharCode(byte);
  }
  return btoa(binary);
}

export function fromBase64(data: string, urlSafe = false): Uint8Array {
  const standard = urlSafe ? data.replace(/-/g, "+").replace(/_/g, "/") : data;
  if (globalThis.Buffer) {
    const buffer = globalThis.Buffer.from(standard, "base64");
    return new Uint8Array(buffer.buffer, buffer.byteOffset, buffer.byteLength);
  }
  const binary = atob(standard + "=".repeat((4 - (standard.length % 4)) % 4));
  return Uint8Array.from(binary, (c) => c.charCodeAt(0));
}

// -- errors -----------------------------------------------------------------------------

/** The typed error of a daemon's error body (an unknown code: a `HutchError` keeping it). */
export function errorFromWire(error: unknown): HutchError {
  const detail = (error ?? {}) as Record<string, unknown>;
  const code = String(detail.code);
  const cls = ERRORS_BY_CODE.get(code) ?? HutchError;
  return new cls(String(detail.message), detail);
}

async function raiseForError(response: Response): Promise<void> {
  if (response.status < 400) {
    return;
  }
  const body = await response.text();
  let error: unknown;
  try {
    error = (JSON.parse(body) as { error?: unknown }).error;
  } catch {
    error = undefined;
  }
  if (error && typeof error === "object" && "code" in error && "message" in error) {
    throw errorFromWire(error);
  }
  throw new HutchError(`daemon answered ${response.status}: ${body.slice(0, 200)}`);
}

// -- the transport ----------------------------------------------------------------------

/** One client's connection to a daemon: its address, credential and session. */
export class Transport {
  readonly url: string;
  private readonly token: string | undefined;
  private headers: Promise<Record<string, string>> | undefined;
  private readonly session = sessionId();

  /** `token`: the daemon's token or a ref (else `HUTCH_TOKEN`, else a loopback daemon's own). */
  constructor(url?: string, token?: string) {
    this.url = clientUrl(url);
    this.token = token;
  }

  private async resolveHeaders(): Promise<Record<string, string>> {
    const token = this.token ?? env("HUTCH_TOKEN") ?? (await localToken(this.url));
    const headers: Record<string, string> = { [SESSION_HEADER]: this.session };
    if (token) {
      headers.authorization = `Bearer ${token}`;
    }
    return headers;
  }

  /** Send a call; an error answer is thrown as its typed error. */
  async send<M extends Method, P extends Route<M>>(
    target: Target<M, P>,
    call: Call<M, P> = {},
  ): Promise<Response> {
    this.headers ??= this.resolveHeaders();
    const headers = { ...(await this.headers) };
    let body: RequestInit["body"];
    if (call.json !== undefined) {
      headers["content-type"] = "application/json";
      body = JSON.stringify(call.json);
    } else if (call.body !== undefined) {
      headers["content-type"] = "application/octet-stream";
      body = call.body;
    }
    const seconds = call.timeout === undefined ? DEFAULT_CALL_SECONDS : call.timeout;
    const init: RequestInit & { duplex?: "half" } = {
      method: target.method,
      headers,
      body,
      signal: seconds === null ? null : AbortSignal.timeout(seconds * 1000),
    };
    if (call.body instanceof ReadableStream) {
      init.duplex = "half"; // fetch's word for a body sent as it is read
    }
    let response: Response;
    try {
      response = await fetch(this.url + target.path + queryString(call.query), init);
    } catch (error) {
      throw this.unreachable(error, seconds);
    }
    await raiseForError(response);
    return response;
  }

  /** A call answered with JSON. */
  async json<M extends Method, P extends Route<M>>(
    target: Target<M, P>,
    call: Call<M, P> = {},
  ): Promise<Answer<M, P>> {
    const response = await this.send(target, call);
    const body = await this.read(response, () => response.text());
    return (body ? JSON.parse(body) : undefined) as Answer<M, P>;
  }

  /** A call answered with raw bytes (a file). */
  async bytes<M extends Method, P extends Route<M>>(
    target: Target<M, P>,
    call: Call<M, P> = {},
  ): Promise<Uint8Array> {
    const response = await this.send(target, call);
    return new Uint8Array(await this.read(response, () => response.arrayBuffer()));
  }

  /** A call answered with raw bytes, handed on in pieces as they come. */
  async *pieces<M extends Method, P extends Route<M>>(
    target: Target<M, P>,
    call: Call<M, P> = {},
  ): AsyncGenerator<Uint8Array> {
    const response = await this.send(target, call);
    const reader = response.body!.getReader();
    try {
      for (;;) {
        const { done, value } = await this.read(response, () => reader.read());
        if (done) {
          return;
        }
        yield value;
      }
    } finally {
      // A caller that stops early closes the connection: the daemon sees it go.
      await reader.cancel().catch(() => undefined);
    }
  }

  /** A call answered with NDJSON: each line's value as it comes. */
  async *lines<M extends Method, P extends Route<M>>(
    target: Target<M, P>,
    call: Call<M, P> = {},
  ): AsyncGenerator<Record<string, unknown>> {
    const stream = new TextDecoder();
    let buffered = "";
    for await (const piece of this.pieces(target, call)) {
      buffered += stream.decode(piece, { stream: true });
      let end: number;
      while ((end = buffered.indexOf("\n")) >= 0) {
        const line = buffered.slice(0, end);
        buffered = buffered.slice(end + 1);
        if (line.trim()) {
          yield JSON.parse(line) as Record<string, unknown>;
        }
      }
    }
    buffered += stream.decode();
    if (buffered.trim()) {
      yield JSON.parse(buffered) as Record<string, unknown>;
    }
  }

  private async read<T>(response: Response, reading: () => Promise<T>): Promise<T> {
    try {
      return await reading();
    } catch (error) {
      throw this.unreachable(error, null, response);
    }
  }

  private unreachable(error: unknown, seconds: number | null, response?: Response): HutchError {
    if (error instanceof HutchError) {
      return error;
    }
    const name = error instanceof Error ? error.name : String(error);
    if (name === "TimeoutError" && seconds !== null) {
      return new SandboxUnavailable(
        `the hutch daemon at ${this.url} did not answer within ${seconds} s`,
      );
    }
    const cause = error instanceof Error && error.cause instanceof Error ? `: ${error.cause.message}` : "";
    if (response !== undefined) {
      return new SandboxUnavailable(
        `the answer of the hutch daemon at ${this.url} was cut off (${name}${cause})`,
      );
    }
    return new SandboxUnavailable(
      `the hutch daemon at ${this.url} is not reachable (${name}${cause}); ` +
        "start it with `hutch serve`",
    );
  }
}

/** A new session's id: random, as the Python SDK's (uuid4's hex). */
function sessionId(): string {
  const random = globalThis.crypto?.randomUUID?.();
  if (random) {
    return random.replace(/-/g, "");
  }
  return Array.from({ length: 32 }, () => Math.floor(Math.random() * 16).toString(16)).join("");
}

function queryString(query: unknown): string {
  if (!query) {
    return "";
  }
  const params = new URLSearchParams();
  for (const [name, value] of Object.entries(query as Record<string, QueryValue>)) {
    if (value !== undefined && value !== null) {
      params.append(name, String(value));
    }
  }
  const text = params.toString();
  return text ? `?${text}` : "";
}
