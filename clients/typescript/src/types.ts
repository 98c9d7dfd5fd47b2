/**
 * What the SDK's operations answer: the Python SDK's results, camelCased.
 * Listings of the daemon's records (sandboxes, workspaces, definitions,
 * events) are the wire's own types, as the Python SDK's are its dicts.
 */
import type { Schemas } from "./api.js";
import { fromBase64, text, utf8 } from "./http.js";

/** The wire's sandbox description (`GET /v1/sandboxes/{id}`). */
export type SandboxInfo = Schemas["SandboxInfo"];
export type WorkspaceInfo = Schemas["WorkspaceInfo"];
export type Definition = Schemas["Definition"];
export type DaemonEvent = Schemas["Event"];
export type EnsureStep = Schemas["EnsureStep"];
/** A warm pool: name, provider, settings, size, ready, hits. */
export type Pool = Schemas["Pool"];
/** A running sandbox's memory and disk at one moment, as the daemon sampled them. */
export type MeterSample = Schemas["MeterSample"];

/** One stream of a command's output: held as the daemon sent it (text or bytes). */
class Output {
  private textForm: string | undefined;
  private bytesForm: Uint8Array | undefined;

  constructor(textForm: string | undefined | null, base64: string | undefined | null) {
    if (typeof base64 === "string") {
      this.bytesForm = fromBase64(base64);
    } else {
      this.textForm = textForm ?? "";
    }
  }

  get text(): string {
    return (this.textForm ??= text(this.bytesForm!));
  }

  get bytes(): Uint8Array {
    return (this.bytesForm ??= utf8(this.textForm!));
  }
}

/** The outcome of a command. A non-zero exit is data, not an error. */
export class ExecResult {
  readonly exitCode: number;
  /** The kernel's OOM killer ended the command (its exit code is then 137). */
  readonly oomKilled: boolean;
  private readonly out: Output;
  private readonly err: Output;

  constructor(answer: Schemas["ExecAnswer"]) {
    this.exitCode = answer.exit_code;
    this.oomKilled = Boolean(answer.oom_killed);
    this.out = new Output(answer.stdout, answer.stdout_b64);
    this.err = new Output(answer.stderr, answer.stderr_b64);
  }

  /** Standard output as text (invalid UTF-8 replaced by U+FFFD). */
  get stdout(): string {
    return this.out.text;
  }

  get stderr(): string {
    return this.err.text;
  }

  get stdoutBytes(): Uint8Array {
    return this.out.bytes;
  }

  get stderrBytes(): Uint8Array {
    return this.err.bytes;
  }

  get success(): boolean {
    return this.exitCode === 0;
  }
}

/** A piece of live output from a running command. */
export class OutputChunk {
  readonly kind = "output" as const;
  readonly stream: "stdout" | "stderr";
  private readonly output: Output;

  constructor(stream: "stdout" | "stderr", textForm: string | null | undefined, base64?: string | null) {
    this.stream = stream;
    this.output = new Output(textForm, base64);
  }

  get data(): Uint8Array {
    return this.output.bytes;
  }

  /** The piece as text: a piece may end inside a character, so join `data` for exact text. */
  get text(): string {
    return this.output.text;
  }
}

/** The last event of a stream: the command has ended. */
export class ExitStatus {
  readonly kind = "exit" as const;
  constructor(
    readonly exitCode: number,
    readonly oomKilled = false,
  ) {}
}

export type StreamEvent = OutputChunk | ExitStatus;

export type FileType = "file" | "directory" | "symlink" | "other";

export class FileInfo {
  readonly path: string;
  readonly type: FileType;
  readonly size: number;
  readonly mode: number;
  /** Unix time of its last change. */
  readonly mtime: number;

  constructor(stat: Schemas["FileStat"]) {
    this.path = stat.path;
    this.type = stat.type as FileType;
    this.size = stat.size;
    this.mode = stat.mode;
    this.mtime = stat.mtime;
  }

  get name(): string {
    return this.path.replace(/\/+$/, "").split("/").pop() ?? this.path;
  }
}

export interface GrepMatch {
  path: string;
  lineNumber: number;
  line: string;
}

/** A sandbox's captured state (its files), and its place in the lineage tree. */
export interface Snapshot {
  id: string;
  label: string | null;
  sandboxId: string | null;
  parentId: string | null;
  sizeBytes: number;
  createdAtUnix: number;
  provider: string;
}

export function snapshotOf(info: Schemas["SnapshotInfo"]): Snapshot {
  return {
    id: info.id,
    label: info.label,
    sandboxId: info.sandbox_id,
    parentId: info.parent_id,
    sizeBytes: info.size_bytes,
    createdAtUnix: info.created_at_unix,
    provider: info.provider,
  };
}

/** Something that needed a snapshot: a snapshot, a workspace or a sandbox. */
export interface SnapshotDependent {
  kind: string;
  id: string;
}

export type SandboxState = "running" | "paused" | "suspended" | "terminated" | "failed";

/** What a dashboard shows; reading it is not activity. */
export interface SandboxStatus {
  id: string;
  state: SandboxState;
  reason: string | null;
  createdAtUnix: number;
  lastActiveUnix: number;
  /** Null once the sandbox has ended: nothing is idle any more. */
  idleSeconds: number | null;
  deadlineUnix: number | null;
  /** Seconds spent running, paused and suspended. */
  meter: Record<string, number>;
}

export function statusOf(info: SandboxInfo): SandboxStatus {
  return {
    id: info.id,
    state: info.state as SandboxState,
    reason: info.reason,
    createdAtUnix: info.created_at_unix ?? 0,
    lastActiveUnix: info.last_active_unix ?? 0,
    idleSeconds: info.idle_seconds,
    deadlineUnix: info.deadline_unix,
    meter: { ...info.meter },
  };
}

/** A streamed ensure's progress: a step starts (its name) or setup printed (`output`). */
export interface EnsureProgress {
  kind: "step" | "output";
  text: string;
}

export type FileEventType = "created" | "written" | "removed" | "renamed";

/**
 * One change a watch saw: `path` (absolute, in the sandbox) was created,
 * written, removed, or renamed to `newPath` (both below the watched
 * directory; a move out of it is a removal, into it a creation).
 */
export interface FileEvent {
  type: FileEventType;
  path: string;
  newPath: string | null;
}

export function fileEventOf(line: Schemas["FileEventLine"]): FileEvent {
  return { type: line.type as FileEventType, path: line.path, newPath: line.new_path ?? null };
}
