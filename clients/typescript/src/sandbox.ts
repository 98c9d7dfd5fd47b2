/**
 * A sandbox through the daemon, its background commands and its forks: the
 * Python SDK's `RemoteSandbox`, `RemoteProcess` and `RemoteFork`, with the
 * same operations, results and errors (names camelCased).
 */
import { posix } from "node:path";

import { route, type Schemas } from "./api.js";
import {
  CapabilityUnsupported,
  HutchError,
  InvalidArgument,
  SandboxUnavailable,
  StdinClosed,
} from "./generated/errors.js";
import { decodeRef, errorFromWire, HTTP_GRACE_SECONDS, text, toBase64, type Transport, utf8 } from "./http.js";
import {
  ExecResult,
  ExitStatus,
  type FileEvent,
  fileEventOf,
  FileInfo,
  type GrepMatch,
  OutputChunk,
  type SandboxInfo,
  type SandboxState,
  type SandboxStatus,
  type Snapshot,
  snapshotOf,
  statusOf,
  type StreamEvent,
} from "./types.js";

/** What `readBytes` and `readText` take at most unless told (the daemon's ceiling). */
export const DEFAULT_READ_LIMIT = 256 * 1024 * 1024;
/** Seconds a `grep` or `glob` may search unless told. */
export const DEFAULT_SEARCH_TIMEOUT = 60;
/** Longest a ref may live: a year, as every duration the API takes. */
export const MAX_REF_SECONDS = 365 * 86400;
/** The longest one look at a watcher's events waits on the daemon (its bound). */
const WATCH_LOOK_SECONDS = 30;
/** Errors that say a sandbox is already gone: closing it again is not an error. */
const GONE = new Set(["not_found", "sandbox_unavailable", "idle_timeout", "max_lifetime_exceeded", "timeout_expired"]);

export interface ExecOptions {
  cwd?: string;
  env?: Record<string, string>;
  /** Text, or bytes (sent as base64). */
  stdin?: string | Uint8Array;
  user?: string;
  /** Seconds; past it the command's whole process tree is killed (`ExecTimeout`). */
  timeout?: number;
  /** Bytes of output kept at most (`OutputLimitExceeded` past it). */
  outputLimit?: number;
}

export interface StartOptions extends Omit<ExecOptions, "timeout"> {
  /** Keep its stdin open after `stdin`, for `writeStdin` and `closeStdin`. */
  keepStdin?: boolean;
}

export interface ReadOptions {
  /** Bytes at most (`OutputLimitExceeded` past it). */
  limit?: number;
}

export interface WriteOptions {
  /** Replace a file this session has not read (read-before-write is for agents). */
  overwrite?: boolean;
}

export interface GrepOptions {
  /** Files by name, as `grep --include` (a pattern with a `/` matches the relative path). */
  glob?: string;
  ignoreCase?: boolean;
  timeout?: number;
}

type Command = string | readonly string[];

function execBody(cmd: Command, options: ExecOptions = {}): Schemas["ExecBody"] {
  const body: Schemas["ExecBody"] = { cmd: typeof cmd === "string" ? cmd : [...cmd] };
  const { cwd, env, stdin, user, timeout, outputLimit } = options;
  if (cwd !== undefined) body.cwd = cwd;
  if (env !== undefined) body.env = { ...env };
  if (user !== undefined) body.user = user;
  if (timeout !== undefined) body.timeout = timeout;
  if (outputLimit !== undefined) body.output_limit = outputLimit;
  if (typeof stdin === "string") {
    body.stdin = stdin;
  } else if (stdin !== undefined) {
    body.stdin_b64 = toBase64(stdin);
  }
  return body;
}

/** A stream's NDJSON line as an event; an error line is thrown as its typed error. */
function streamEvent(line: Record<string, unknown>): StreamEvent {
  const event = line as Schemas["StreamLine"];
  if (event.error) {
    throw errorFromWire(event.error);
  }
  if (typeof event.exit_code === "number") {
    return new ExitStatus(event.exit_code, Boolean(event.oom_killed));
  }
  return new OutputChunk(event.stream === "stderr" ? "stderr" : "stdout", event.data, event.data_b64);
}

function checkBytes(data: unknown): asserts data is Uint8Array {
  if (!(data instanceof Uint8Array)) {
    throw new InvalidArgument(`data must be bytes (a Uint8Array), not ${typeof data}`);
  }
}

/** A sandbox owned by the daemon (or, through a ref, shared with its owner). */
export class Sandbox {
  readonly id: string;
  private info_: SandboxInfo;
  private closed_ = false;
  private detached = false;

  /** @internal Made by `Client`; `attached`: a session through a ref. */
  constructor(
    private readonly transport: Transport,
    info: SandboxInfo,
    private readonly attached = false,
  ) {
    this.id = info.id;
    this.info_ = info;
  }

  private target(): { sandbox_id: string } {
    if (this.detached) {
      throw new SandboxUnavailable(`this session detached from sandbox ${this.id}; attach again with a ref`);
    }
    return { sandbox_id: this.id };
  }

  // -- what the daemon answered last (info() and status() ask afresh) -------------------

  get provider(): string {
    return this.info_.provider;
  }

  get workdir(): string | null {
    return this.info_.workdir;
  }

  /** What the provider can do (`processes`, `pause`, `snapshot`, ..., `runtime`). */
  get capabilities(): Readonly<Record<string, boolean | string>> {
    return this.info_.capabilities;
  }

  /** The state at the last answer; `status()` asks afresh. */
  get state(): SandboxState {
    return this.info_.state as SandboxState;
  }

  /** Seconds spent running, paused and suspended, at the last answer. */
  get meter(): Record<string, number> {
    return { ...this.info_.meter };
  }

  /** Execs, streams and background commands open, at the last answer. */
  get openOperations(): number {
    return this.info_.open_operations;
  }

  /** Closed (or detached) through this handle, or ended, as far as the last answer knows. */
  get closed(): boolean {
    return this.closed_ || this.detached || this.state === "terminated" || this.state === "failed";
  }

  /** Whether the provider can do `capability`. */
  supports(capability: string): boolean {
    return this.info_.capabilities[capability] === true;
  }

  /** `CapabilityUnsupported` unless the provider can do `capability`. */
  require(capability: string): void {
    if (!this.supports(capability)) {
      throw new CapabilityUnsupported(`provider '${this.provider}' does not support '${capability}'`);
    }
  }

  /** The absolute path inside the sandbox that `path` names (relative ones: to its workdir). */
  path(path: string): string {
    if (typeof path !== "string") {
      throw new InvalidArgument(`path must be a string, not ${typeof path}`);
    }
    if (path.includes("\0")) {
      throw new InvalidArgument(`path ${JSON.stringify(path)} has a NUL character`);
    }
    return posix.resolve(this.workdir ?? "/", path || ".");
  }

  private absorb(info: SandboxInfo): void {
    this.info_ = info;
  }

  /** What the sandbox is and how it is now (the daemon's description). */
  async info(): Promise<SandboxInfo> {
    const info = await this.transport.json(route("get", "/v1/sandboxes/{sandbox_id}", this.target()));
    this.absorb(info);
    return info;
  }

  /** State, reason, deadline, idle time and meter. Reading it is not activity. */
  async status(): Promise<SandboxStatus> {
    return statusOf(await this.info());
  }

  // -- commands ----------------------------------------------------------------------------

  /** Run a command to its end. A non-zero exit is a result, not an error. */
  async exec(cmd: Command, options: ExecOptions = {}): Promise<ExecResult> {
    const answer = await this.transport.json(route("post", "/v1/sandboxes/{sandbox_id}/exec", this.target()), {
      json: execBody(cmd, options),
      timeout: options.timeout === undefined ? null : options.timeout + HTTP_GRACE_SECONDS,
    });
    return new ExecResult(answer);
  }

  /** Run a command, its output as it comes (`OutputChunk`s), then its `ExitStatus`. */
  async *execStream(cmd: Command, options: ExecOptions = {}): AsyncGenerator<StreamEvent> {
    const lines = this.transport.lines(route("post", "/v1/sandboxes/{sandbox_id}/exec/stream", this.target()), {
      json: execBody(cmd, options),
      timeout: null,
    });
    for await (const line of lines) {
      yield streamEvent(line);
    }
  }

  /** Start a command in the background: `wait`, `stream` or `kill` it. */
  async start(cmd: Command, options: StartOptions = {}): Promise<Process> {
    const { keepStdin } = options;
    if (keepStdin !== undefined && typeof keepStdin !== "boolean") {
      throw new InvalidArgument(`keepStdin must be true or false, not ${String(keepStdin)}`);
    }
    const body: Schemas["StartBody"] = execBody(cmd, options);
    if (keepStdin) {
      body.keep_stdin = true;
    }
    const info = await this.transport.json(route("post", "/v1/sandboxes/{sandbox_id}/processes", this.target()), {
      json: body,
    });
    return new Process(this.transport, this.id, info);
  }

  /** The background commands the daemon still knows of. */
  async processes(): Promise<Process[]> {
    const answer = await this.transport.json(route("get", "/v1/sandboxes/{sandbox_id}/processes", this.target()));
    return answer.processes.map((p) => new Process(this.transport, this.id, p));
  }

  async process(processId: string): Promise<Process> {
    const info = await this.transport.json(
      route("get", "/v1/sandboxes/{sandbox_id}/processes/{process_id}", { ...this.target(), process_id: processId }),
    );
    return new Process(this.transport, this.id, info);
  }

  /** A URL that reaches `port` inside the sandbox. */
  async previewUrl(port: number): Promise<string> {
    if (!Number.isInteger(port) || port <= 0 || port >= 65536) {
      throw new InvalidArgument(`port must be 1..65535, got ${port}`);
    }
    this.require("preview_url");
    const answer = await this.transport.json(route("get", "/v1/sandboxes/{sandbox_id}/preview_url", this.target()), {
      query: { port },
      timeout: 600,
    });
    return answer.url;
  }

  // -- files -------------------------------------------------------------------------------

  async readBytes(path: string, options: ReadOptions = {}): Promise<Uint8Array> {
    return this.transport.bytes(route("get", "/v1/sandboxes/{sandbox_id}/files", this.target()), {
      query: { path, limit: options.limit ?? DEFAULT_READ_LIMIT },
      timeout: 600,
    });
  }

  /** The file as UTF-8 text (invalid sequences replaced by U+FFFD). */
  async readText(path: string, options: ReadOptions = {}): Promise<string> {
    return text(await this.readBytes(path, options));
  }

  /** The bytes of `path` in pieces as they arrive, never whole in memory. */
  readPieces(path: string, options: ReadOptions = {}): AsyncGenerator<Uint8Array> {
    return this.transport.pieces(route("get", "/v1/sandboxes/{sandbox_id}/files", this.target()), {
      query: { path, limit: options.limit ?? DEFAULT_READ_LIMIT },
      timeout: null,
    });
  }

  /** As `fs.readFile`: bytes, or text with an encoding (`"utf8"`). */
  readFile(path: string, options?: ReadOptions): Promise<Uint8Array>;
  readFile(path: string, encoding: "utf8" | "utf-8" | (ReadOptions & { encoding: "utf8" | "utf-8" })): Promise<string>;
  async readFile(
    path: string,
    options?: ReadOptions | "utf8" | "utf-8" | (ReadOptions & { encoding?: "utf8" | "utf-8" }),
  ): Promise<Uint8Array | string> {
    if (typeof options === "string") {
      return this.readText(path);
    }
    if (options && "encoding" in options && options.encoding) {
      return this.readText(path, options);
    }
    return this.readBytes(path, options);
  }

  async writeBytes(path: string, data: Uint8Array, options: WriteOptions = {}): Promise<void> {
    checkBytes(data);
    await this.transport.send(route("put", "/v1/sandboxes/{sandbox_id}/files", this.target()), {
      query: options.overwrite ? { path, overwrite: true } : { path },
      body: data,
      timeout: 600,
    });
  }

  async writeText(path: string, content: string, options: WriteOptions = {}): Promise<void> {
    if (typeof content !== "string") {
      throw new InvalidArgument(`text must be a string, not ${typeof content}`);
    }
    await this.writeBytes(path, utf8(content), options);
  }

  /** Write what `source` yields to `path`, sent as it is read, never whole in memory. */
  async writeFrom(
    path: string,
    source: ReadableStream<Uint8Array> | AsyncIterable<Uint8Array>,
    options: WriteOptions = {},
  ): Promise<void> {
    await this.transport.send(route("put", "/v1/sandboxes/{sandbox_id}/files", this.target()), {
      query: options.overwrite ? { path, overwrite: true } : { path },
      body: source,
      timeout: 600,
    });
  }

  /** As `fs.writeFile`: text (UTF-8) or bytes. */
  async writeFile(path: string, data: string | Uint8Array, options: WriteOptions = {}): Promise<void> {
    await (typeof data === "string" ? this.writeText(path, data, options) : this.writeBytes(path, data, options));
  }

  async stat(path: string): Promise<FileInfo> {
    const answer = await this.transport.json(route("get", "/v1/sandboxes/{sandbox_id}/stat", this.target()), {
      query: { path },
    });
    return new FileInfo(answer);
  }

  async exists(path: string): Promise<boolean> {
    try {
      await this.stat(path);
    } catch (error) {
      if (error instanceof HutchError && error.code === "file_not_found") {
        return false;
      }
      throw error;
    }
    return true;
  }

  /** The entries of a directory. */
  async listDir(path = "."): Promise<FileInfo[]> {
    const answer = await this.transport.json(route("get", "/v1/sandboxes/{sandbox_id}/list", this.target()), {
      query: { path },
    });
    return answer.entries.map((entry) => new FileInfo(entry));
  }

  /** The entries of a directory (`listDir`). */
  list(path = "."): Promise<FileInfo[]> {
    return this.listDir(path);
  }

  async remove(path: string, options: { recursive?: boolean } = {}): Promise<void> {
    await this.transport.send(route("delete", "/v1/sandboxes/{sandbox_id}/files", this.target()), {
      query: { path, recursive: Boolean(options.recursive) },
    });
  }

  /**
   * Make the directory `path`, as `fs.mkdir`/`pathlib`: its missing parents
   * too with `parents`; one already there is `SandboxFileExists` unless
   * `existOk`; a file where a parent must be is `SandboxNotADirectory`.
   */
  async mkdir(path: string, options: { parents?: boolean; existOk?: boolean } = {}): Promise<void> {
    await this.transport.send(route("post", "/v1/sandboxes/{sandbox_id}/mkdir", this.target()), {
      json: { path, parents: Boolean(options.parents), exist_ok: Boolean(options.existOk) },
      timeout: 120,
    });
  }

  /**
   * Move `source` to `destination` inside the sandbox (a file or a whole
   * directory). Something at `destination` is `SandboxFileExists` unless
   * `overwrite`; then as rename(2) (a file replaces a file, a directory an
   * empty directory).
   */
  async rename(source: string, destination: string, options: { overwrite?: boolean } = {}): Promise<void> {
    await this.transport.send(route("post", "/v1/sandboxes/{sandbox_id}/rename", this.target()), {
      json: { source, destination, overwrite: Boolean(options.overwrite) },
      timeout: 600,
    });
  }

  /**
   * Watch the directory `path` from now on (the daemon holds the watch): the
   * watcher's `events({wait})` are those since the last look, and iterating
   * it (`for await`) gives them as they come.
   */
  async watch(path = ".", options: { recursive?: boolean } = {}): Promise<Watcher> {
    const { recursive } = options;
    if (recursive !== undefined && typeof recursive !== "boolean") {
      throw new InvalidArgument(`recursive must be true or false, not ${String(recursive)}`);
    }
    const info = await this.transport.json(route("post", "/v1/sandboxes/{sandbox_id}/watchers", this.target()), {
      json: { path, recursive: Boolean(recursive) },
      timeout: 120,
    });
    return new Watcher(this.transport, this.id, info);
  }

  /** A watch of this sandbox by its id (`NotFound` once closed), as `watch` made it, here or in another session. */
  async watcher(watcherId: string): Promise<Watcher> {
    const info = await this.transport.json(
      route("get", "/v1/sandboxes/{sandbox_id}/watchers/{watcher_id}", { ...this.target(), watcher_id: watcherId }),
    );
    return new Watcher(this.transport, this.id, info);
  }

  /** Lines matching the regular expression `pattern` in the files under `path`. */
  async grep(pattern: string, path = ".", options: GrepOptions = {}): Promise<GrepMatch[]> {
    const timeout = options.timeout ?? DEFAULT_SEARCH_TIMEOUT;
    const answer = await this.transport.json(route("post", "/v1/sandboxes/{sandbox_id}/grep", this.target()), {
      json: { pattern, path, glob: options.glob ?? null, ignore_case: Boolean(options.ignoreCase), timeout },
      timeout: timeout + HTTP_GRACE_SECONDS,
    });
    return answer.matches.map((m) => ({ path: m.path, lineNumber: m.line_number, line: m.line }));
  }

  /** Paths under `path` matching `pattern`, as `pathlib`'s glob (`**` for every depth). */
  async glob(pattern: string, path = ".", options: { timeout?: number } = {}): Promise<string[]> {
    const timeout = options.timeout ?? DEFAULT_SEARCH_TIMEOUT;
    const answer = await this.transport.json(route("post", "/v1/sandboxes/{sandbox_id}/glob", this.target()), {
      json: { pattern, path, timeout },
      timeout: timeout + HTTP_GRACE_SECONDS,
    });
    return answer.paths;
  }

  // -- lifecycle ---------------------------------------------------------------------------

  async pause(): Promise<void> {
    this.absorb(await this.transport.json(route("post", "/v1/sandboxes/{sandbox_id}/pause", this.target()), { timeout: 120 }));
  }

  async suspend(): Promise<void> {
    this.absorb(await this.transport.json(route("post", "/v1/sandboxes/{sandbox_id}/suspend", this.target()), { timeout: 600 }));
  }

  async resume(): Promise<void> {
    this.absorb(await this.transport.json(route("post", "/v1/sandboxes/{sandbox_id}/resume", this.target()), { timeout: 600 }));
  }

  /** End the sandbox `seconds` from now; the new deadline as Unix time. */
  async setTimeout(seconds: number): Promise<number> {
    const answer = await this.transport.json(route("post", "/v1/sandboxes/{sandbox_id}/set_timeout", this.target()), {
      json: { timeout_seconds: seconds },
    });
    return answer.deadline_unix!;
  }

  /** Capture the sandbox's files; `diff: false` flattens its layers. */
  async snapshot(label?: string | null, options: { diff?: boolean } = {}): Promise<Snapshot> {
    this.require("snapshot");
    const answer = await this.transport.json(route("post", "/v1/sandboxes/{sandbox_id}/snapshots", this.target()), {
      json: { label: label ?? null, diff: options.diff ?? true },
      timeout: 600,
    });
    return snapshotOf(answer);
  }

  /** Snapshot + a handle whose `attach()` starts branches; `count` are started at once. */
  async fork(label?: string | null, options: { count?: number } = {}): Promise<Fork> {
    this.require("fork");
    const answer = await this.transport.json(route("post", "/v1/sandboxes/{sandbox_id}/fork", this.target()), {
      json: { label: label ?? null, count: options.count ?? 0 },
      timeout: 600,
    });
    const branches = answer.sandboxes.map((info) => new Sandbox(this.transport, info));
    return new Fork(this.transport, snapshotOf(answer.snapshot), branches);
  }

  /**
   * A ref to this sandbox for `attach`: it carries the daemon's address and is
   * a credential for this sandbox alone. Only the owner hands them out.
   */
  async ref(options: { expiresIn?: number } = {}): Promise<string> {
    const { expiresIn } = options;
    if (expiresIn !== undefined && !(typeof expiresIn === "number" && expiresIn > 0 && expiresIn <= MAX_REF_SECONDS)) {
      throw new InvalidArgument(
        `expires_in must be a number of seconds above 0 and at most ${MAX_REF_SECONDS}, got ${String(expiresIn)}`,
      );
    }
    const answer = await this.transport.json(route("post", "/v1/sandboxes/{sandbox_id}/refs", this.target()), {
      json: { expires_in: expiresIn ?? null },
    });
    return answer.ref;
  }

  /** End a ref this sandbox handed out (the ref itself, or its id). Idempotent. */
  async revokeRef(ref: string): Promise<void> {
    const refId = decodeRef(ref)?.refId ?? ref;
    await this.transport.send(
      route("delete", "/v1/sandboxes/{sandbox_id}/refs/{ref_id}", { ...this.target(), ref_id: refId }),
    );
  }

  /**
   * End the sandbox (an owner's close; closing one already gone is not an
   * error). Through a ref, only this session detaches: the sandbox goes on.
   */
  async close(): Promise<void> {
    if (this.detached) {
      return;
    }
    const target = route("delete", "/v1/sandboxes/{sandbox_id}", this.target());
    if (this.attached) {
      await this.transport.send(target, { timeout: 120 });
      this.detached = true;
      return;
    }
    try {
      await this.transport.send(target, { timeout: 120 });
    } catch (error) {
      if (!(error instanceof HutchError && GONE.has(error.code))) {
        throw error;
      }
    }
    this.closed_ = true;
  }

  /** `close()`, as `hutch kill` says it. */
  kill(): Promise<void> {
    return this.close();
  }
}

/** A background command. */
export class Process {
  readonly id: string;
  readonly sandboxId: string;
  readonly command: string;
  private running_: boolean;
  private exitCode_: number | null;
  private stdinOpen_: boolean;

  /** @internal */
  constructor(
    private readonly transport: Transport,
    sandboxId: string,
    info: Schemas["ProcessInfo"],
  ) {
    this.id = info.id;
    this.sandboxId = sandboxId;
    this.command = info.command;
    this.running_ = info.running;
    this.exitCode_ = info.exit_code;
    this.stdinOpen_ = Boolean(info.stdin_open);
  }

  /**
   * Whether its stdin was kept open and is (as last seen; the daemon has the
   * last word: a write to a closed one throws `StdinClosed`).
   */
  get stdinOpen(): boolean {
    return this.stdinOpen_ && this.running_;
  }

  get running(): boolean {
    return this.running_;
  }

  get exitCode(): number | null {
    return this.exitCode_;
  }

  private params(): { sandbox_id: string; process_id: string } {
    return { sandbox_id: this.sandboxId, process_id: this.id };
  }

  /**
   * Wait for the command to end; `ExecTimeout` if it outlives `timeout`
   * seconds (the command keeps running: kill it if that is what you want).
   */
  async wait(timeout: number | null = null): Promise<ExecResult> {
    const answer = await this.transport.json(
      route("post", "/v1/sandboxes/{sandbox_id}/processes/{process_id}/wait", this.params()),
      { json: { timeout }, timeout: timeout === null ? null : timeout + HTTP_GRACE_SECONDS },
    );
    const result = new ExecResult(answer);
    this.running_ = false;
    this.exitCode_ = result.exitCode;
    return result;
  }

  /** Every output chunk from the start, live, then the `ExitStatus`. */
  async *stream(): AsyncGenerator<StreamEvent> {
    const lines = this.transport.lines(
      route("get", "/v1/sandboxes/{sandbox_id}/processes/{process_id}/stream", this.params()),
      { timeout: null },
    );
    for await (const line of lines) {
      const event = streamEvent(line);
      if (event instanceof ExitStatus) {
        this.running_ = false;
        this.exitCode_ = event.exitCode;
      }
      yield event;
    }
  }

  /**
   * Write `data` (text as UTF-8) to the command's stdin; resolves once its
   * pipe took them. `StdinClosed` unless it was started with `keepStdin`
   * and its stdin is still open.
   */
  async writeStdin(data: string | Uint8Array): Promise<void> {
    const bytes = typeof data === "string" ? utf8(data) : data;
    checkBytes(bytes);
    try {
      await this.transport.send(
        route("post", "/v1/sandboxes/{sandbox_id}/processes/{process_id}/stdin", this.params()),
        { body: bytes, timeout: null },
      );
    } catch (error) {
      if (error instanceof StdinClosed) {
        this.stdinOpen_ = false;
      }
      throw error;
    }
  }

  /** Close the command's stdin: it reads its end of file. */
  async closeStdin(): Promise<void> {
    await this.transport.send(
      route("delete", "/v1/sandboxes/{sandbox_id}/processes/{process_id}/stdin", this.params()),
      { timeout: 60 },
    );
    this.stdinOpen_ = false;
  }

  /** End the command's whole process tree (SIGTERM, a grace, SIGKILL). */
  async kill(): Promise<void> {
    await this.transport.send(
      route("post", "/v1/sandboxes/{sandbox_id}/processes/{process_id}/kill", this.params()),
      { timeout: 60 },
    );
    this.running_ = false;
  }
}

/** A watch the daemon holds on a directory of a sandbox. */
export class Watcher implements AsyncIterable<FileEvent> {
  readonly id: string;
  readonly sandboxId: string;
  readonly path: string;
  readonly recursive: boolean;
  /** How it learns of changes: `inotify` or `poll`. */
  readonly kind: string;
  private active_: boolean;

  /** @internal */
  constructor(
    private readonly transport: Transport,
    sandboxId: string,
    info: Schemas["WatcherInfo"],
  ) {
    this.id = info.id;
    this.sandboxId = sandboxId;
    this.path = info.path;
    this.recursive = info.recursive;
    this.kind = info.kind;
    this.active_ = info.active;
  }

  /** Still watching, as of the last answer. */
  get active(): boolean {
    return this.active_;
  }

  private params(): { sandbox_id: string; watcher_id: string } {
    return { sandbox_id: this.sandboxId, watcher_id: this.id };
  }

  /**
   * The events since the last call, waiting up to `wait` seconds (`null`: as
   * long as it takes) for the first when there are none yet. A closed watch
   * has none.
   */
  async events(options: { wait?: number | null } = {}): Promise<FileEvent[]> {
    const wait = options.wait === undefined ? 0 : options.wait;
    if (wait !== null && !(typeof wait === "number" && wait >= 0)) {
      throw new InvalidArgument(`wait must be a number of seconds >= 0, got ${String(wait)}`);
    }
    let left = wait;
    for (;;) {
      const look = left === null ? WATCH_LOOK_SECONDS : Math.min(left, WATCH_LOOK_SECONDS);
      let answer: Schemas["WatchEvents"];
      try {
        answer = await this.transport.json(
          route("get", "/v1/sandboxes/{sandbox_id}/watchers/{watcher_id}/events", this.params()),
          { query: { wait: look }, timeout: look + HTTP_GRACE_SECONDS },
        );
      } catch (error) {
        this.active_ = false;
        if (error instanceof HutchError && error.code === "not_found") {
          return []; // closed
        }
        throw error;
      }
      this.active_ = answer.active;
      const events = answer.events.map(fileEventOf);
      if (left !== null) {
        left -= look;
      }
      if (events.length || !this.active_ || (left !== null && left <= 0)) {
        return events;
      }
    }
  }

  /** Every event as it comes, until the watch is closed. */
  async *[Symbol.asyncIterator](): AsyncGenerator<FileEvent> {
    for (let batch = await this.events({ wait: null }); batch.length; batch = await this.events({ wait: null })) {
      yield* batch;
    }
  }

  /** Stop watching. Idempotent. */
  async close(): Promise<void> {
    this.active_ = false;
    try {
      await this.transport.send(route("delete", "/v1/sandboxes/{sandbox_id}/watchers/{watcher_id}", this.params()), {
        timeout: 60,
      });
    } catch (error) {
      if (!(error instanceof HutchError && error.code === "not_found")) {
        throw error;
      }
    }
  }
}

/** A fork: its snapshot, and the branches started from it. */
export class Fork {
  /** @internal */
  constructor(
    private readonly transport: Transport,
    readonly snapshot: Snapshot,
    /** The branches started with the fork (`count`) and by `attach`. */
    readonly branches: Sandbox[],
  ) {}

  /** Start one more branch (sandbox settings as `createSandbox` takes them). */
  async attach(settings: Record<string, unknown> = {}): Promise<Sandbox> {
    const info = await this.transport.json(route("post", "/v1/sandboxes", {}), {
      json: { ...wireSettings(settings), from_snapshot: this.snapshot.id },
      timeout: 600,
    });
    const branch = new Sandbox(this.transport, info);
    this.branches.push(branch);
    return branch;
  }

  /**
   * End every branch this handle started, then remove its snapshot (refused
   * while something else needs it). Idempotent.
   */
  async close(): Promise<void> {
    for (let branch = this.branches.pop(); branch; branch = this.branches.pop()) {
      await branch.close();
    }
    try {
      await this.transport.send(route("delete", "/v1/snapshots/{snapshot_id}", { snapshot_id: this.snapshot.id }), {
        timeout: 600,
      });
    } catch (error) {
      if (!(error instanceof HutchError && error.code === "not_found")) {
        throw error;
      }
    }
  }
}

/**
 * Sandbox settings as the wire takes them: top-level names in snake_case
 * (`idleSuspendAfter` is `idle_suspend_after`); values go as given.
 */
export function wireSettings(settings: Record<string, unknown>): Record<string, unknown> {
  const out: Record<string, unknown> = {};
  for (const [name, value] of Object.entries(settings)) {
    if (value !== undefined) {
      out[name.replace(/[A-Z]/g, (c) => `_${c.toLowerCase()}`)] = value;
    }
  }
  return out;
}
