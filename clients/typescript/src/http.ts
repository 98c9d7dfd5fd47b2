/**
 * The SDK's HTTP leaf: where the daemon is, how a client proves who it is,
 * how a request is sent (Node's own HTTP client) and its answer or error
 * decoded. Nothing here knows the SDK's objects.
 */
import { randomUUID } from "node:crypto";
import { readFile } from "node:fs/promises";
import http from "node:http";
import https from "node:https";
import { homedir } from "node:os";
import { join } from "node:path";

import type { Answer, JsonBody, Method, Query, Route, Target } from "./api.js";
import { ERRORS_BY_CODE, HutchError, InvalidArgument, SandboxUnavailable } from "./generated/errors.js";

export const DEFAULT_URL = "http://127.0.0.1:8787";
export const SESSION_HEADER = "X-Hutch-Session";
/** Seconds a call waits for its answer unless it says otherwise (as the Python SDK). */
export const DEFAULT_CALL_SECONDS = 60;
/** Headroom on top of a command's own timeout before the call gives up. */
export const HTTP_GRACE_SECONDS = 30;
const REF_PREFIX = "hutch-ref:";
/** An in-process owner's address: its unix socket's path, quoted. */
const UNIX_SCHEME = "http+unix://";
const TOKEN_FILE_NAME = "api-token";

type QueryValue = string | number | boolean | null | undefined;

export interface Call<M extends Method, P extends Route<M>> {
  query?: Query<M, P>;
  json?: JsonBody<M, P>;
  /** A raw body (a file's bytes), sent as `application/octet-stream`. */
  body?: Uint8Array | ReadableStream<Uint8Array> | AsyncIterable<Uint8Array>;
  /** Seconds to wait for the answer; `null` waits as long as it takes. */
  timeout?: number | null;
}

function env(name: string): string | undefined {
  return process.env[name] || undefined;
}

/** The daemon's address: `url`, else `HUTCH_URL`, else hutch's default. */
export function clientUrl(url?: string): string {
  return (url ?? env("HUTCH_URL") ?? DEFAULT_URL).replace(/\/+$/, "");
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
 * one.
 */
export async function localToken(url: string): Promise<string | undefined> {
  if (!isLoopback(url)) {
    return undefined;
  }
  try {
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
      new TextDecoder().decode(fromBase64(ref.slice(REF_PREFIX.length))),
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
  return Buffer.from(bytes.buffer, bytes.byteOffset, bytes.byteLength).toString("base64");
}

/** Bytes of base64, the standard alphabet or the URL-safe one (a ref's). */
export function fromBase64(data: string): Uint8Array {
  const buffer = Buffer.from(data, "base64");
  return new Uint8Array(buffer.buffer, buffer.byteOffset, buffer.byteLength);
}

// -- errors -----------------------------------------------------------------------------

/** The typed error of a daemon's error body (an unknown code: a `HutchError` keeping it). */
export function errorFromWire(error: unknown): HutchError {
  const detail = (error ?? {}) as Record<string, unknown>;
  const code = String(detail.code);
  const cls = ERRORS_BY_CODE.get(code) ?? HutchError;
  return new cls(String(detail.message), detail);
}

// -- the transport ----------------------------------------------------------------------

/** Sockets kept alive between calls, as one HTTP/1.1 client keeps them (idle ones unref'd). */
const AGENTS = { http: new http.Agent({ keepAlive: true }), https: new https.Agent({ keepAlive: true }) };

type Body = Uint8Array | ReadableStream<Uint8Array> | AsyncIterable<Uint8Array>;

/** The connection details of a daemon's address: over TCP (http, https) or a unix socket. */
interface Endpoint {
  module: typeof http | typeof https;
  agent: http.Agent;
  host: string;
  port: number | undefined;
  socketPath: string | undefined;
  basePath: string;
}

function endpointOf(url: string): Endpoint {
  if (url.startsWith(UNIX_SCHEME)) {
    // An in-process owner's address: the socket's path, quoted whole.
    const socketPath = decodeURIComponent(url.slice(UNIX_SCHEME.length));
    return { module: http, agent: AGENTS.http, host: "hutch-owner", port: undefined, socketPath, basePath: "" };
  }
  const parsed = new URL(url);
  const secure = parsed.protocol === "https:";
  if (!secure && parsed.protocol !== "http:") {
    throw new InvalidArgument(`the daemon's address is http(s)://HOST:PORT, not ${url}`);
  }
  return {
    module: secure ? https : http,
    agent: secure ? AGENTS.https : AGENTS.http,
    host: parsed.hostname.replace(/^\[|\]$/g, ""),
    port: parsed.port ? Number(parsed.port) : undefined,
    socketPath: undefined,
    basePath: parsed.pathname.replace(/\/+$/, ""),
  };
}

function isReplayable(body: Body | string | undefined): body is Uint8Array | string | undefined {
  return body === undefined || typeof body === "string" || body instanceof Uint8Array;
}

async function sendBody(request: http.ClientRequest, body: Body | string | undefined): Promise<void> {
  if (isReplayable(body)) {
    request.end(body);
    return;
  }
  const pieces = body instanceof ReadableStream ? streamPieces(body) : body;
  for await (const piece of pieces) {
    if (!request.write(piece)) {
      await new Promise<void>((resolve, reject) => {
        const failed = (error: Error) => reject(error);
        request.once("error", failed);
        request.once("drain", () => {
          request.off("error", failed);
          resolve();
        });
      });
    }
  }
  request.end();
}

async function* streamPieces(stream: ReadableStream<Uint8Array>): AsyncGenerator<Uint8Array> {
  const reader = stream.getReader();
  try {
    for (;;) {
      const { done, value } = await reader.read();
      if (done) {
        return;
      }
      yield value;
    }
  } finally {
    reader.releaseLock();
  }
}

function readAll(response: http.IncomingMessage): Promise<Buffer> {
  // Listeners, not the stream's async iterator: a third less CPU for a file's pieces.
  return new Promise((resolve, reject) => {
    const chunks: Buffer[] = [];
    response.on("data", (chunk: Buffer) => chunks.push(chunk));
    response.once("error", reject);
    response.once("aborted", () => reject(new Error("the answer was cut off")));
    response.once("end", () => resolve(chunks.length === 1 ? chunks[0]! : Buffer.concat(chunks)));
  });
}

function raiseForError(status: number, body: Buffer): void {
  let error: unknown;
  try {
    error = (JSON.parse(body.toString("utf8")) as { error?: unknown }).error;
  } catch {
    error = undefined;
  }
  if (error && typeof error === "object" && "code" in error && "message" in error) {
    throw errorFromWire(error);
  }
  throw new HutchError(`daemon answered ${status}: ${body.toString("utf8", 0, 200)}`);
}

/**
 * One client's connection to a daemon: its address, credential and session,
 * over Node's own HTTP client (a kept connection; a call costs a third of
 * what the same call through `fetch` costs, and no answer is cut off after
 * 300 s as `fetch`'s are).
 */
export class Transport {
  readonly url: string;
  private readonly endpoint: Endpoint;
  private readonly token: string | undefined;
  private headers: Promise<Record<string, string>> | undefined;
  private readonly session = sessionId();

  /** `token`: the daemon's token or a ref (else `HUTCH_TOKEN`, else a loopback daemon's own). */
  constructor(url?: string, token?: string) {
    this.url = clientUrl(url);
    this.endpoint = endpointOf(this.url);
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

  /** The answer's head and body stream; an error answer is thrown as its typed error. */
  private async open<M extends Method, P extends Route<M>>(
    target: Target<M, P>,
    call: Call<M, P>,
  ): Promise<http.IncomingMessage> {
    this.headers ??= this.resolveHeaders();
    const headers = { ...(await this.headers) };
    let body: Body | string | undefined;
    if (call.json !== undefined) {
      headers["content-type"] = "application/json";
      body = JSON.stringify(call.json);
    } else if (call.body !== undefined) {
      headers["content-type"] = "application/octet-stream";
      body = call.body;
    }
    if (typeof body === "string" || body instanceof Uint8Array) {
      headers["content-length"] = String(Buffer.byteLength(body));
    }
    const seconds = call.timeout === undefined ? DEFAULT_CALL_SECONDS : call.timeout;
    const path = this.endpoint.basePath + target.path + queryString(call.query);
    let response: http.IncomingMessage;
    for (let attempt = 0; ; attempt++) {
      try {
        response = await this.exchange(target.method, path, headers, body, seconds);
        break;
      } catch (error) {
        // A kept connection the daemon closed as the call went out (its idle
        // timeout): nothing was read, so the call goes again on a new one.
        const stale = (error as { staleConnection?: boolean }).staleConnection === true;
        if (!(stale && attempt === 0 && isReplayable(body))) {
          throw this.unreachable(error, seconds);
        }
      }
    }
    if (response.statusCode! >= 400) {
      raiseForError(response.statusCode!, await this.read(() => readAll(response)));
    }
    return response;
  }

  private exchange(
    method: string,
    path: string,
    headers: Record<string, string>,
    body: Body | string | undefined,
    seconds: number | null,
  ): Promise<http.IncomingMessage> {
    const { module, agent, host, port, socketPath } = this.endpoint;
    return new Promise((resolve, reject) => {
      const request = module.request({ method, host, port, socketPath, path, headers, agent }, resolve);
      request.once("error", (error: Error & { code?: string; staleConnection?: boolean }) => {
        error.staleConnection = request.reusedSocket && (error.code === "ECONNRESET" || error.code === "EPIPE");
        reject(error);
      });
      if (seconds !== null) {
        // Seconds without a byte from the daemon, as the Python SDK's read timeout.
        request.setTimeout(seconds * 1000, () => {
          const error = new Error(`no answer within ${seconds} s`);
          error.name = "TimeoutError";
          request.destroy(error);
        });
      }
      sendBody(request, body).catch((error: Error) => request.destroy(error));
    });
  }

  /** Send a call and drain its answer (for calls answered with nothing to read). */
  async send<M extends Method, P extends Route<M>>(target: Target<M, P>, call: Call<M, P> = {}): Promise<void> {
    const response = await this.open(target, call);
    await this.read(() => readAll(response));
  }

  /** A call answered with JSON. */
  async json<M extends Method, P extends Route<M>>(
    target: Target<M, P>,
    call: Call<M, P> = {},
  ): Promise<Answer<M, P>> {
    const response = await this.open(target, call);
    const body = await this.read(() => readAll(response));
    return (body.length ? JSON.parse(body.toString("utf8")) : undefined) as Answer<M, P>;
  }

  /** A call answered with raw bytes (a file). */
  async bytes<M extends Method, P extends Route<M>>(
    target: Target<M, P>,
    call: Call<M, P> = {},
  ): Promise<Uint8Array> {
    const response = await this.open(target, call);
    const body = await this.read(() => readAll(response));
    return new Uint8Array(body.buffer, body.byteOffset, body.byteLength);
  }

  /** A call answered with raw bytes, handed on in pieces as they come. */
  async *pieces<M extends Method, P extends Route<M>>(
    target: Target<M, P>,
    call: Call<M, P> = {},
  ): AsyncGenerator<Uint8Array> {
    const response = await this.open(target, call);
    const iterator = response[Symbol.asyncIterator]();
    try {
      for (;;) {
        const { done, value } = await this.read(() => iterator.next());
        if (done) {
          return;
        }
        const chunk = value as Buffer;
        yield new Uint8Array(chunk.buffer, chunk.byteOffset, chunk.byteLength);
      }
    } finally {
      // A caller that stops early closes the connection: the daemon sees it go.
      if (!response.complete) {
        response.destroy();
      }
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

  private async read<T>(reading: () => Promise<T>): Promise<T> {
    try {
      return await reading();
    } catch (error) {
      throw this.unreachable(error, null, true);
    }
  }

  private unreachable(error: unknown, seconds: number | null, answering = false): HutchError {
    if (error instanceof HutchError) {
      return error;
    }
    const name = error instanceof Error ? error.name : String(error);
    const code = (error as { code?: string }).code;
    const why = code ? `${name} ${code}` : name;
    if (name === "TimeoutError" && seconds !== null) {
      return new SandboxUnavailable(`the hutch daemon at ${this.url} did not answer within ${seconds} s`);
    }
    if (this.endpoint.socketPath !== undefined && !answering) {
      // Only an in-process owner serves on a socket, and it stops with its owner.
      return new SandboxUnavailable(
        `the sandbox this ref names is no longer served at ${this.endpoint.socketPath}: its owner's ` +
          `cleanup ended it, or the owner's process is gone (${why})`,
      );
    }
    if (answering) {
      return new SandboxUnavailable(`the answer of the hutch daemon at ${this.url} was cut off (${why})`);
    }
    return new SandboxUnavailable(
      `the hutch daemon at ${this.url} is not reachable (${why}); start it with \`hutch serve\``,
    );
  }
}

/** A new session's id: random, as the Python SDK's (uuid4's hex). */
function sessionId(): string {
  return randomUUID().replace(/-/g, "");
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
