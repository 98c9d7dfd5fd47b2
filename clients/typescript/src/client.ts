/**
 * The daemon, from TypeScript: `new Client()` (reading `HUTCH_URL` and
 * `HUTCH_TOKEN`, else a loopback daemon's own token file) gives sandboxes
 * with the Python SDK's operations, results and errors.
 */
import { route } from "./api.js";
import { InvalidArgument, Unauthorized } from "./generated/errors.js";
import { decodeRef, errorFromWire, Transport } from "./http.js";
import { Sandbox, wireSettings } from "./sandbox.js";
import {
  type DaemonEvent,
  type Definition,
  type EnsureProgress,
  type EnsureStep,
  type MeterSample,
  type Pool,
  type SandboxInfo,
  type Snapshot,
  type SnapshotDependent,
  snapshotOf,
  type WorkspaceInfo,
} from "./types.js";

export interface ClientOptions {
  /** The daemon's address (else `HUTCH_URL`, else http://127.0.0.1:8787). */
  url?: string;
  /** The daemon's token (else `HUTCH_TOKEN`, else the token file of a daemon on this host). */
  token?: string;
}

/**
 * Sandbox settings, as a `hutch.toml` takes them: `provider`, the provider's
 * own (`image`, `memory`, `cpus`, `env`, ...) and the sandbox options
 * (`idleSuspendAfter`, `idleTimeout`, `maxLifetime`, `autoResume`,
 * `readBeforeWrite`, `outputLimit`); names in camelCase or snake_case.
 */
export type SandboxSettings = Record<string, unknown> & { provider?: string; image?: string };

/** What `ensure` gives: the sandbox, the path taken and each step's seconds. */
export interface Ensured {
  kind: "result";
  sandbox: Sandbox;
  /** `resumed`, `restored` or `created`. */
  path: string;
  steps: EnsureStep[];
}

/** A ref's sandbox, through the daemon the ref names; the ref is the credential. */
export async function attach(ref: string): Promise<Sandbox> {
  const decoded = decodeRef(ref);
  if (decoded === undefined) {
    throw new Unauthorized("this is not a hutch ref: ask the sandbox's owner for one");
  }
  return attachThrough(decoded.url, ref);
}

async function attachThrough(url: string, ref: string): Promise<Sandbox> {
  const decoded = decodeRef(ref);
  if (decoded === undefined) {
    throw new Unauthorized("this is not a hutch ref: ask the sandbox's owner for one");
  }
  const transport = new Transport(url, ref);
  const info = await transport.json(route("get", "/v1/sandboxes/{sandbox_id}", { sandbox_id: decoded.sandboxId }));
  return new Sandbox(transport, info, true);
}

export class Client {
  private readonly transport: Transport;

  constructor(options: ClientOptions | string = {}) {
    const { url, token } = typeof options === "string" ? { url: options, token: undefined } : options;
    this.transport = new Transport(url, token);
  }

  get url(): string {
    return this.transport.url;
  }

  private sandboxOf(info: SandboxInfo): Sandbox {
    return new Sandbox(this.transport, info);
  }

  // -- sandboxes ---------------------------------------------------------------------------

  /** A new sandbox: `createSandbox("docker", {image})` or `createSandbox({provider, image})`. */
  async createSandbox(provider?: string | SandboxSettings, settings: SandboxSettings = {}): Promise<Sandbox> {
    const given = typeof provider === "object" && provider !== null ? provider : { ...settings, provider };
    const info = await this.transport.json(route("post", "/v1/sandboxes", {}), {
      json: wireSettings(given),
      timeout: 600,
    });
    return this.sandboxOf(info);
  }

  /** A sandbox the daemon holds, by id. */
  async getSandbox(sandboxId: string): Promise<Sandbox> {
    return this.sandboxOf(await this.transport.json(route("get", "/v1/sandboxes/{sandbox_id}", { sandbox_id: sandboxId })));
  }

  /** A sandbox the daemon holds, by id (`getSandbox`). */
  sandbox(sandboxId: string): Promise<Sandbox> {
    return this.getSandbox(sandboxId);
  }

  /**
   * Live sandboxes; with `includeEnded` also those that ended within the
   * daemon's retention period (state and reason say how).
   */
  async listSandboxes(options: { includeEnded?: boolean } = {}): Promise<SandboxInfo[]> {
    const answer = await this.transport.json(route("get", "/v1/sandboxes", {}), {
      query: options.includeEnded ? { all: true } : {},
    });
    return answer.sandboxes;
  }

  /** The daemon's sandboxes (`listSandboxes`). */
  list(options: { includeEnded?: boolean } = {}): Promise<SandboxInfo[]> {
    return this.listSandboxes(options);
  }

  async deleteSandbox(sandboxId: string): Promise<void> {
    await this.transport.send(route("delete", "/v1/sandboxes/{sandbox_id}", { sandbox_id: sandboxId }), {
      timeout: 120,
    });
  }

  /**
   * A non-owning session, through this client's daemon address, on the
   * sandbox `ref` names; the ref is its credential. Its close only detaches.
   */
  attach(ref: string): Promise<Sandbox> {
    return attachThrough(this.url, ref);
  }

  async pause(sandboxId: string): Promise<SandboxInfo> {
    return this.transport.json(route("post", "/v1/pause", {}), { json: { sandbox: sandboxId }, timeout: 120 });
  }

  async resume(sandboxId: string): Promise<SandboxInfo> {
    return this.transport.json(route("post", "/v1/resume", {}), { json: { sandbox: sandboxId }, timeout: 600 });
  }

  async suspend(sandboxId: string): Promise<SandboxInfo> {
    return this.transport.json(route("post", "/v1/sandboxes/{sandbox_id}/suspend", { sandbox_id: sandboxId }), {
      timeout: 600,
    });
  }

  /** End sandbox `sandboxId` `seconds` from now; the new deadline as Unix time. */
  async setTimeout(sandboxId: string, seconds: number): Promise<number> {
    const answer = await this.transport.json(route("post", "/v1/set_timeout", {}), {
      json: { sandbox: sandboxId, timeout_seconds: seconds },
    });
    return answer.deadline_unix!;
  }

  // -- snapshots ---------------------------------------------------------------------------

  /** Every snapshot the daemon holds (the lineage tree, by `parentId`). */
  async snapshots(): Promise<Snapshot[]> {
    const answer = await this.transport.json(route("get", "/v1/snapshots", {}));
    return answer.snapshots.map(snapshotOf);
  }

  async getSnapshot(snapshotId: string): Promise<Snapshot> {
    return snapshotOf(await this.transport.json(route("get", "/v1/snapshots/{snapshot_id}", { snapshot_id: snapshotId })));
  }

  /**
   * Remove a snapshot; refused while something needs it unless `force`.
   * What a forced removal broke (empty: nothing).
   */
  async deleteSnapshot(snapshotId: string, options: { force?: boolean } = {}): Promise<SnapshotDependent[]> {
    const answer = await this.transport.json(route("delete", "/v1/snapshots/{snapshot_id}", { snapshot_id: snapshotId }), {
      query: options.force ? { force: true } : {},
      timeout: 600,
    });
    return (answer?.broken ?? []).map((b) => ({ kind: b.kind, id: b.id }));
  }

  // -- definitions -------------------------------------------------------------------------

  /** Register (or replace) a sandbox definition; its id is `definition.id`. */
  async putDefinition(definition: Record<string, unknown> & { id: string }): Promise<Definition> {
    if (typeof definition !== "object" || definition === null || typeof definition.id !== "string") {
      throw new InvalidArgument('a definition is an object with an "id" string');
    }
    return this.transport.json(route("put", "/v1/definitions/{definition_id}", { definition_id: definition.id }), {
      json: { ...definition },
    });
  }

  async definitions(): Promise<Definition[]> {
    return (await this.transport.json(route("get", "/v1/definitions", {}))).definitions as Definition[];
  }

  /**
   * The sandbox of `threadId` for a definition: resumed, restored from its
   * setup snapshot, or created (setup run).
   */
  async ensure(definitionId: string, threadId: string, options: { tenant?: string } = {}): Promise<Ensured> {
    const answer = await this.transport.json(
      route("post", "/v1/definitions/{definition_id}/ensure", { definition_id: definitionId }),
      { json: { thread_id: threadId, tenant: options.tenant ?? null }, timeout: null },
    );
    return { kind: "result", sandbox: this.sandboxOf(answer.sandbox), path: answer.path, steps: answer.steps };
  }

  /** As `ensure`, told as it goes: each step, setup's output, then the ensured sandbox. */
  async *ensureStream(
    definitionId: string,
    threadId: string,
    options: { tenant?: string } = {},
  ): AsyncGenerator<EnsureProgress | Ensured> {
    const lines = this.transport.lines(
      route("post", "/v1/definitions/{definition_id}/ensure/stream", { definition_id: definitionId }),
      { json: { thread_id: threadId, tenant: options.tenant ?? null }, timeout: null },
    );
    for await (const line of lines) {
      if (line.error) {
        throw errorFromWire(line.error);
      }
      if (line.result) {
        const result = line.result as { sandbox: SandboxInfo; path: string; steps: EnsureStep[] };
        yield { kind: "result", sandbox: this.sandboxOf(result.sandbox), path: result.path, steps: result.steps };
        return;
      }
      for (const kind of ["step", "output"] as const) {
        if (typeof line[kind] === "string") {
          yield { kind, text: line[kind] as string };
        }
      }
    }
  }

  /** The thread's run ended: honour destroy_on_complete and keep_alive. Whether its sandbox was destroyed. */
  async complete(definitionId: string, threadId: string, options: { tenant?: string } = {}): Promise<boolean> {
    const answer = await this.transport.json(
      route("post", "/v1/definitions/{definition_id}/complete", { definition_id: definitionId }),
      { json: { thread_id: threadId, tenant: options.tenant ?? null }, timeout: 600 },
    );
    return answer.destroyed;
  }

  // -- workspaces --------------------------------------------------------------------------

  /**
   * A workspace from a snapshot (`snapshotTag`: its id) or fresh from sandbox
   * settings; with `image` and no `provider`, the daemon's configuration says which.
   */
  async createWorkspace(
    name: string,
    settings: SandboxSettings & { snapshotTag?: string } = {},
  ): Promise<WorkspaceInfo> {
    return this.transport.json(route("post", "/v1/workspaces", {}), {
      json: { ...wireSettings(settings), name },
      timeout: 600,
    });
  }

  async getWorkspace(name: string): Promise<WorkspaceInfo> {
    return this.transport.json(route("get", "/v1/workspaces/{name}", { name }));
  }

  async listWorkspaces(): Promise<WorkspaceInfo[]> {
    return (await this.transport.json(route("get", "/v1/workspaces", {}))).workspaces;
  }

  async suspendWorkspace(name: string, options: { diff?: boolean } = {}): Promise<WorkspaceInfo> {
    return this.transport.json(route("post", "/v1/workspaces/{name}/suspend", { name }), {
      json: { diff: Boolean(options.diff) },
      timeout: 600,
    });
  }

  async resumeWorkspace(name: string): Promise<WorkspaceInfo> {
    return this.transport.json(route("post", "/v1/workspaces/{name}/resume", { name }), { timeout: 600 });
  }

  async deleteWorkspace(name: string): Promise<void> {
    await this.transport.send(route("delete", "/v1/workspaces/{name}", { name }), { timeout: 600 });
  }

  // -- warm pools --------------------------------------------------------------------------

  /** The daemon's warm pools: name, provider, settings, size, ready, hits. */
  async listPools(): Promise<Pool[]> {
    return (await this.transport.json(route("get", "/v1/pools", {}))).pools;
  }

  /**
   * Make or resize a warm pool of `size` sandboxes made with `settings` (a
   * create's: `{provider: "docker", image}`); a create with the same
   * provider settings takes one of them.
   */
  async setPool(name: string, size: number, settings: SandboxSettings = {}): Promise<Pool> {
    return this.transport.json(route("put", "/v1/pools/{name}", { name }), {
      json: { size, settings: wireSettings(settings) },
      timeout: 600,
    });
  }

  /** Remove a warm pool and the sandboxes it kept ready. */
  async removePool(name: string): Promise<void> {
    await this.transport.send(route("delete", "/v1/pools/{name}", { name }), { timeout: 600 });
  }

  // -- the daemon --------------------------------------------------------------------------

  /** The daemon's event log, newest last (of one subject, if given). */
  async events(options: { subject?: string; limit?: number } = {}): Promise<DaemonEvent[]> {
    const answer = await this.transport.json(route("get", "/v1/events", {}), {
      query: { limit: options.limit ?? 100, ...(options.subject === undefined ? {} : { subject: options.subject }) },
    });
    return answer.events;
  }

  /**
   * A sandbox's memory and disk over the last hour, as the daemon sampled
   * them while it ran, oldest first (none once it ended): the daemon's record,
   * as its events are. Reading them is not activity.
   */
  async meterHistory(sandboxId: string): Promise<MeterSample[]> {
    const answer = await this.transport.json(route("get", "/v1/sandboxes/{sandbox_id}/meters", { sandbox_id: sandboxId }));
    return answer.samples;
  }

  /**
   * The newest `limit` events (of `subject`, a sandbox id or workspace name,
   * or all), then each as it happens, until the caller stops iterating.
   */
  async *followEvents(options: { subject?: string; limit?: number } = {}): AsyncGenerator<DaemonEvent> {
    const lines = this.transport.lines(route("get", "/v1/events/follow", {}), {
      query: { limit: options.limit ?? 10, ...(options.subject === undefined ? {} : { subject: options.subject }) },
      timeout: null,
    });
    for await (const line of lines) {
      if (line.error) {
        throw errorFromWire(line.error);
      }
      yield line as DaemonEvent;
    }
  }
}
