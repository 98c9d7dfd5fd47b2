/**
 * hutch's TypeScript SDK: sandboxes for AI agents, through the hutch daemon.
 *
 * ```ts
 * import { Client } from "hutch";
 * const client = new Client();            // HUTCH_URL, HUTCH_TOKEN, or this host's daemon
 * const sb = await client.createSandbox("docker", { image: "python:3.12" });
 * const result = await sb.exec("echo hello; exit 3");   // a non-zero exit is a result
 * await sb.close();
 * ```
 */
export { attach, Client } from "./client.js";
export type { ClientOptions, Ensured, SandboxSettings } from "./client.js";
export { Fork, Process, Sandbox, Watcher } from "./sandbox.js";
export type { ExecOptions, GrepOptions, ReadOptions, StartOptions, WriteOptions } from "./sandbox.js";
export { ExecResult, ExitStatus, FileInfo, OutputChunk } from "./types.js";
export type {
  DaemonEvent,
  Definition,
  EnsureProgress,
  EnsureStep,
  FileEvent,
  FileEventType,
  FileType,
  GrepMatch,
  MeterSample,
  Pool,
  SandboxInfo,
  SandboxState,
  SandboxStatus,
  Snapshot,
  SnapshotDependent,
  StreamEvent,
  WorkspaceInfo,
} from "./types.js";
export * from "./generated/errors.js";
export type { ErrorDetail } from "./errorBase.js";
export type { components as WireSchemas, paths as WirePaths } from "./generated/wire.js";
