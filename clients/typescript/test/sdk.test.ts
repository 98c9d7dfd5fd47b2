/**
 * The SDK against a real `hutch serve` (tests/test_typescript_sdk.py starts
 * it): HUTCH_URL and HUTCH_TOKEN say where, HUTCH_TEST_PROVIDER and
 * HUTCH_TEST_SETTINGS (JSON) which sandboxes to make. Every operation once,
 * its errors, and a non-zero exit as a result.
 */
import assert from "node:assert/strict";
import { randomUUID } from "node:crypto";
import { after, before, describe, test } from "node:test";

import * as hutch from "hutch";
import { Client, ExitStatus, OutputChunk, type Sandbox, type StreamEvent } from "hutch";

const provider = process.env.HUTCH_TEST_PROVIDER ?? "local";
const settings = JSON.parse(process.env.HUTCH_TEST_SETTINGS ?? "{}") as Record<string, unknown>;
const client = new Client();
const unique = (prefix: string): string => `${prefix}-${randomUUID().slice(0, 8)}`;

/** `promise` rejects with an error of `cls` whose wire code is `code`. */
async function rejectsWith(
  promise: Promise<unknown>,
  cls: abstract new (...args: never[]) => hutch.HutchError,
  code: string,
): Promise<hutch.HutchError> {
  let caught: unknown;
  await assert.rejects(promise, (error: unknown) => {
    caught = error;
    return true;
  });
  assert.ok(caught instanceof cls, `expected ${cls.name}, got ${String(caught)}`);
  assert.ok(caught instanceof hutch.HutchError);
  assert.equal(caught.code, code);
  assert.ok(caught.message.length > 0);
  return caught;
}

async function collect(events: AsyncIterable<StreamEvent>): Promise<{ out: string; err: string; exit: ExitStatus }> {
  const out: Uint8Array[] = [];
  const err: Uint8Array[] = [];
  let exit: ExitStatus | undefined;
  for await (const event of events) {
    assert.equal(exit, undefined, "nothing comes after the exit status");
    if (event instanceof OutputChunk) {
      (event.stream === "stdout" ? out : err).push(event.data);
    } else {
      exit = event;
    }
  }
  assert.ok(exit instanceof ExitStatus);
  const text = (parts: Uint8Array[]): string => Buffer.concat(parts).toString("utf8");
  return { out: text(out), err: text(err), exit };
}

let sb: Sandbox;

before(async () => {
  sb = await client.createSandbox(provider, settings);
});

after(async () => {
  await sb?.close();
});

describe("exec", () => {
  test("a non-zero exit is a result, with both streams", async () => {
    const result = await sb.exec("echo hello; echo oops >&2; exit 3");
    assert.equal(result.exitCode, 3);
    assert.equal(result.success, false);
    assert.equal(result.stdout, "hello\n");
    assert.equal(result.stderr, "oops\n");
    assert.deepEqual([...result.stdoutBytes], [...Buffer.from("hello\n")]);
  });

  test("argv, cwd, env and stdin (text and bytes)", async () => {
    await sb.exec("mkdir -p sub");
    const result = await sb.exec(["sh", "-c", 'basename "$(pwd)"; echo "$GREETING"; cat'], {
      cwd: "sub",
      env: { GREETING: "hi there" },
      stdin: "from stdin",
    });
    assert.equal(result.stdout, "sub\nhi there\nfrom stdin");
    const bytes = await sb.exec(["od", "-An", "-tx1"], { stdin: new Uint8Array([0, 1, 255]) });
    assert.equal(bytes.stdout.trim(), "00 01 ff");
  });

  test("output that is not UTF-8 comes back as bytes", async () => {
    const result = await sb.exec(["printf", "\\377\\000ok"]);
    assert.deepEqual([...result.stdoutBytes], [0xff, 0, 0x6f, 0x6b]);
    assert.equal(result.stdout, "\ufffd\u0000ok");
  });

  test("its timeout kills the command: ExecTimeout", async () => {
    await rejectsWith(sb.exec("sleep 30", { timeout: 1 }), hutch.ExecTimeout, "exec_timeout");
  });

  test("execStream yields output as it comes, then the exit status", async () => {
    const { out, err, exit } = await collect(sb.execStream(["sh", "-c", "echo one; echo two >&2; exit 4"]));
    assert.equal(out, "one\n");
    assert.equal(err, "two\n");
    assert.equal(exit.exitCode, 4);
    assert.equal(exit.kind, "exit");
  });

  test("execStream's timeout is thrown as ExecTimeout", async () => {
    const events = sb.execStream("echo started; sleep 30", { timeout: 1 });
    await rejectsWith(collect(events), hutch.ExecTimeout, "exec_timeout");
  });
});

describe("background commands", () => {
  test("wait gives the result; stdin is given at start", async () => {
    const job = await sb.start("read line; echo got $line; exit 5", { stdin: "x\n" });
    assert.equal(typeof job.id, "string");
    const result = await job.wait(60);
    assert.equal(result.stdout, "got x\n");
    assert.equal(result.exitCode, 5);
    assert.equal(job.running, false);
    assert.equal(job.exitCode, 5);
  });

  test("stream gives every chunk from the start, then the exit", async () => {
    const job = await sb.start("for i in 1 2 3; do echo step $i; done");
    const { out, exit } = await collect(job.stream());
    assert.equal(out, "step 1\nstep 2\nstep 3\n");
    assert.equal(exit.exitCode, 0);
    assert.equal(job.exitCode, 0);
  });

  test("kill ends it; processes and process find it", async () => {
    const job = await sb.start(["sleep", "60"]);
    assert.equal(job.running, true);
    assert.ok((await sb.processes()).some((p) => p.id === job.id));
    assert.equal((await sb.process(job.id)).command.includes("sleep"), true);
    await job.kill();
    assert.equal(job.running, false);
    const result = await job.wait(30);
    assert.notEqual(result.exitCode, 0);
  });

  test("stdin kept open: written, closed, then refused", async () => {
    const job = await sb.start(["cat"], { keepStdin: true, stdin: "first " });
    assert.equal(job.stdinOpen, true);
    await job.writeStdin("second ");
    await job.writeStdin(new Uint8Array([0x74, 0x68, 0x69, 0x72, 0x64])); // "third"
    await job.closeStdin();
    assert.equal(job.stdinOpen, false);
    const result = await job.wait(60);
    assert.equal(result.stdout, "first second third");
    await rejectsWith(job.writeStdin("late"), hutch.StdinClosed, "stdin_closed");
    const plain = await sb.start(["sleep", "30"]);
    assert.equal(plain.stdinOpen, false);
    await rejectsWith(plain.writeStdin("x"), hutch.StdinClosed, "stdin_closed");
    await plain.kill();
  });

  test("wait past its timeout: ExecTimeout, and the command goes on", async () => {
    const job = await sb.start("sleep 30");
    await rejectsWith(job.wait(0.5), hutch.ExecTimeout, "exec_timeout");
    assert.equal((await sb.process(job.id)).running, true);
    await job.kill();
  });
});

describe("files", () => {
  test("text and bytes, written and read back", async () => {
    await sb.writeText("notes/a.txt", "héllo\n");
    assert.equal(await sb.readText("notes/a.txt"), "héllo\n");
    const all = Uint8Array.from({ length: 256 }, (_, i) => i);
    const name = "a b'\"\n€.bin";
    await sb.writeBytes(name, all);
    assert.deepEqual(await sb.readBytes(name), all);
    await sb.writeFile("notes/b.txt", "as fs does");
    await sb.writeFile("notes/c.bin", new Uint8Array([1, 2]));
    assert.equal(await sb.readFile("notes/b.txt", "utf8"), "as fs does");
    assert.deepEqual(await sb.readFile("notes/c.bin"), new Uint8Array([1, 2]));
  });

  test("pieces in and out, never whole", async () => {
    async function* pieces(): AsyncGenerator<Uint8Array> {
      for (let i = 0; i < 4; i++) {
        yield new Uint8Array(300_000).fill(65 + i);
      }
    }
    await sb.writeFrom("big.bin", pieces());
    let size = 0;
    const seen = new Set<number>();
    for await (const piece of sb.readPieces("big.bin")) {
      size += piece.length;
      piece.forEach((b) => seen.add(b));
    }
    assert.equal(size, 1_200_000);
    assert.deepEqual([...seen].sort(), [65, 66, 67, 68]);
    await rejectsWith(sb.readBytes("big.bin", { limit: 1000 }), hutch.OutputLimitExceeded, "output_limit_exceeded");
  });

  test("stat, exists, list and remove", async () => {
    await sb.writeText("tree/x.txt", "12345");
    await sb.writeText("tree/deeper/y.txt", "y");
    const info = await sb.stat("tree/x.txt");
    assert.equal(info.type, "file");
    assert.equal(info.size, 5);
    assert.equal(info.name, "x.txt");
    assert.equal((await sb.stat("tree")).type, "directory");
    assert.equal(sb.path("tree//x.txt"), `${sb.workdir}/tree/x.txt`);
    assert.equal(sb.path("/etc/hosts"), "/etc/hosts");
    assert.throws(() => sb.path("a\0b"), hutch.InvalidArgument);
    assert.equal(await sb.exists("tree/x.txt"), true);
    assert.equal(await sb.exists("tree/none"), false);
    const names = (await sb.list("tree")).map((e) => e.name).sort();
    assert.deepEqual(names, ["deeper", "x.txt"]);
    assert.deepEqual((await sb.listDir("tree/deeper")).map((e) => e.name), ["y.txt"]);
    await sb.readText("tree/x.txt");
    await sb.remove("tree/x.txt");
    assert.equal(await sb.exists("tree/x.txt"), false);
    await rejectsWith(sb.remove("tree"), hutch.SandboxIsADirectory, "is_a_directory");
    await sb.readText("tree/deeper/y.txt");
    await sb.remove("tree", { recursive: true });
    assert.equal(await sb.exists("tree"), false);
  });

  test("mkdir and rename", async () => {
    await sb.mkdir("made/deep/er", { parents: true });
    assert.equal((await sb.stat("made/deep/er")).type, "directory");
    await rejectsWith(sb.mkdir("made"), hutch.SandboxFileExists, "file_exists");
    await sb.mkdir("made", { existOk: true });
    await rejectsWith(sb.mkdir("none/such"), hutch.SandboxFileNotFound, "file_not_found");
    await sb.writeText("made/file.txt", "moved");
    await rejectsWith(sb.mkdir("made/file.txt/sub", { parents: true }), hutch.SandboxNotADirectory, "not_a_directory");
    await sb.rename("made/file.txt", "made/deep/moved.txt");
    assert.equal(await sb.readText("made/deep/moved.txt"), "moved");
    assert.equal(await sb.exists("made/file.txt"), false);
    await sb.writeText("made/other.txt", "other");
    await rejectsWith(sb.rename("made/other.txt", "made/deep/moved.txt"), hutch.SandboxFileExists, "file_exists");
    await sb.rename("made/other.txt", "made/deep/moved.txt", { overwrite: true });
    assert.equal(await sb.readText("made/deep/moved.txt"), "other");
    await sb.rename("made/deep", "made/renamed");
    assert.deepEqual((await sb.list("made/renamed")).map((e) => e.name).sort(), ["er", "moved.txt"]);
  });

  test("watch: what changed since the last look, and as it comes", async () => {
    await sb.mkdir("watched", { existOk: true });
    const watcher = await sb.watch("watched", { recursive: true });
    assert.equal(watcher.active, true);
    assert.ok(["inotify", "poll"].includes(watcher.kind));
    assert.deepEqual(await watcher.events(), []);
    await sb.writeText("watched/new.txt", "hello");
    const seen: hutch.FileEvent[] = [];
    // Until the creation is seen: a polling watch sees it at its next look.
    for (let looks = 0; looks < 20 && !seen.some((e) => e.path.endsWith("/watched/new.txt")); looks++) {
      seen.push(...(await watcher.events({ wait: 30 })));
    }
    assert.ok(seen.some((e) => e.path.endsWith("/watched/new.txt") && ["created", "written"].includes(e.type)), JSON.stringify(seen));
    await sb.readText("watched/new.txt");
    await sb.remove("watched/new.txt");
    for await (const event of watcher) {
      if (event.type === "removed" && event.path.endsWith("/watched/new.txt")) {
        break;
      }
    }
    assert.equal((await sb.watcher(watcher.id)).path, watcher.path);
    await watcher.close();
    assert.equal(watcher.active, false);
    await rejectsWith(sb.watcher(watcher.id), hutch.NotFound, "not_found");
    assert.deepEqual(await watcher.events(), []);
    await watcher.close(); // again: not an error
    await rejectsWith(sb.watch("no/such/dir"), hutch.SandboxFileNotFound, "file_not_found");
  });

  test("grep and glob", async () => {
    await sb.writeText("src/app.py", "def main():\n    return 42\n");
    await sb.writeText("src/lib/util.py", "def helper():\n    pass\n");
    await sb.writeText("src/readme.md", "def not_python\n");
    const matches = await sb.grep("def \\w+", "src", { glob: "*.py" });
    assert.deepEqual(
      matches.map((m) => [m.path.replace(/^.*src\//, "src/"), m.lineNumber, m.line]).sort(),
      [["src/app.py", 1, "def main():"], ["src/lib/util.py", 1, "def helper():"]],
    );
    assert.equal((await sb.grep("DEF MAIN", "src", { ignoreCase: true })).length, 1);
    // Matched relative to "src", answered as paths in the sandbox.
    const below = (paths: string[]): string[] => paths.map((p) => p.replace(/^.*?src\//, "")).sort();
    assert.deepEqual(below(await sb.glob("*.py", "src")), ["app.py"]);
    assert.deepEqual(below(await sb.glob("**/*.py", "src")), ["app.py", "lib/util.py"]);
    await rejectsWith(sb.grep("(", "src"), hutch.InvalidArgument, "invalid_argument");
  });

  test("errors: a missing file, a bad argument, read before write", async () => {
    const missing = await rejectsWith(sb.readText("no/such/file"), hutch.SandboxFileNotFound, "file_not_found");
    assert.match(missing.message, /no\/such\/file/);
    await rejectsWith(sb.writeBytes("x.bin", "text" as unknown as Uint8Array), hutch.InvalidArgument, "invalid_argument");
    await sb.writeText("guarded.txt", "mine");
    // Another session (another client) has not read it: it may not replace it...
    const other = await new Client().getSandbox(sb.id);
    await rejectsWith(other.writeText("guarded.txt", "theirs"), hutch.ReadBeforeWrite, "read_before_write");
    // ...unless it says so, or reads it first.
    await other.writeText("guarded.txt", "theirs", { overwrite: true });
    assert.equal(await other.readText("guarded.txt"), "theirs");
    await other.writeText("guarded.txt", "theirs again");
  });
});

describe("lifecycle", () => {
  test("status, setTimeout and the listing", async () => {
    const status = await sb.status();
    assert.equal(status.id, sb.id);
    assert.equal(status.state, "running");
    assert.equal(typeof status.createdAtUnix, "number");
    const deadline = await sb.setTimeout(3600);
    assert.ok(Math.abs(deadline - (Date.now() / 1000 + 3600)) < 120);
    assert.ok(Math.abs((await sb.status()).deadlineUnix! - deadline) < 1);
    assert.ok(Math.abs((await client.setTimeout(sb.id, 7200)) - deadline - 3600) < 120);
    assert.ok((await client.list()).some((info) => info.id === sb.id));
    assert.equal((await client.sandbox(sb.id)).provider, provider);
    await rejectsWith(sb.setTimeout(-1), hutch.InvalidArgument, "invalid_argument");
  });

  test("previewUrl: a port's address, as the provider gives it", async () => {
    await rejectsWith(sb.previewUrl(0), hutch.InvalidArgument, "invalid_argument");
    if (sb.supports("preview_url")) {
      assert.match(await sb.previewUrl(8000), /^https?:\/\/[^/]+:8000/);
    } else {
      await rejectsWith(sb.previewUrl(8000), hutch.CapabilityUnsupported, "capability_unsupported");
    }
  });

  test("pause, suspend and resume, as the provider can", async () => {
    await sb.writeText("kept.txt", "kept");
    if (sb.supports("pause")) {
      await sb.pause();
      assert.equal(sb.state, "paused");
      await sb.resume();
      assert.equal(sb.state, "running");
      assert.equal((await client.pause(sb.id)).state, "paused");
      assert.equal((await client.resume(sb.id)).state, "running");
    } else {
      await rejectsWith(sb.pause(), hutch.CapabilityUnsupported, "capability_unsupported");
    }
    if (sb.supports("suspend")) {
      await sb.suspend();
      assert.equal(sb.state, "suspended");
      await sb.resume();
      assert.equal(await sb.readText("kept.txt"), "kept");
      assert.equal((await client.suspend(sb.id)).state, "suspended");
      assert.equal((await sb.exec("cat kept.txt")).stdout, "kept"); // resumed on use
    } else {
      await rejectsWith(sb.suspend(), hutch.CapabilityUnsupported, "capability_unsupported");
    }
  });

  test("kill ends a sandbox; its listing says so", async () => {
    const doomed = await client.createSandbox({ provider, ...settings });
    await doomed.kill();
    assert.equal(doomed.closed, true);
    await doomed.close(); // again: not an error
    assert.ok(!(await client.list()).some((info) => info.id === doomed.id));
    const ended = (await client.list({ includeEnded: true })).find((info) => info.id === doomed.id);
    assert.equal(ended?.state, "terminated");
    await assert.rejects(doomed.exec("true"), hutch.HutchError);
  });
});

describe("snapshots, forks and refs", () => {
  test("snapshot, a sandbox from it, and its removal", async (t) => {
    if (!sb.supports("snapshot")) {
      await rejectsWith(sb.snapshot(), hutch.CapabilityUnsupported, "capability_unsupported");
      return t.skip(`${provider} cannot snapshot`);
    }
    await sb.writeText("snapped.txt", "then");
    const snap = await sb.snapshot("ts-checkpoint");
    assert.equal(snap.label, "ts-checkpoint");
    assert.equal(snap.sandboxId, sb.id);
    assert.ok((await client.snapshots()).some((s) => s.id === snap.id));
    assert.equal((await client.getSnapshot(snap.id)).id, snap.id);
    const again = await client.createSandbox({ fromSnapshot: snap.id });
    try {
      assert.equal(await again.readText("snapped.txt"), "then");
    } finally {
      await again.close();
    }
    assert.deepEqual(await client.deleteSnapshot(snap.id), []);
    await rejectsWith(client.getSnapshot(snap.id), hutch.NotFound, "not_found");
  });

  test("fork: branches at once and by attach, closed together", async (t) => {
    if (!sb.supports("fork")) {
      return t.skip(`${provider} cannot fork`);
    }
    await sb.writeText("setup.txt", "done");
    const fork = await sb.fork("ts-fork", { count: 1 });
    assert.equal(fork.branches.length, 1);
    const more = await fork.attach();
    assert.equal(fork.branches.length, 2);
    assert.equal(await more.readText("setup.txt"), "done");
    await more.writeText("setup.txt", "branch's own", { overwrite: true });
    assert.equal(await fork.branches[0]!.readText("setup.txt"), "done");
    assert.equal(await sb.readText("setup.txt"), "done");
    await fork.close();
    assert.equal(fork.branches.length, 0);
    assert.equal(more.closed, true);
    await rejectsWith(client.getSnapshot(fork.snapshot.id), hutch.NotFound, "not_found");
  });

  test("ref: another session attaches, detaches; revoked, refused", async () => {
    const ref = await sb.ref({ expiresIn: 600 });
    assert.match(ref, /^hutch-ref:/);
    const worker = await client.attach(ref);
    assert.equal(worker.id, sb.id);
    await worker.writeText("from-worker.txt", "hello");
    assert.equal(await sb.readText("from-worker.txt"), "hello");
    const elsewhere = await hutch.attach(ref); // through the address the ref carries
    assert.equal(await elsewhere.readText("from-worker.txt"), "hello");
    await elsewhere.close();
    await worker.close(); // only detaches it
    await rejectsWith(worker.exec("true"), hutch.SandboxUnavailable, "sandbox_unavailable");
    assert.equal((await sb.exec("cat from-worker.txt")).stdout, "hello");
    await sb.revokeRef(ref);
    await rejectsWith(client.attach(ref), hutch.Unauthorized, "unauthorized");
    await rejectsWith(client.attach("not a ref"), hutch.Unauthorized, "unauthorized");
    await rejectsWith(sb.ref({ expiresIn: -1 }), hutch.InvalidArgument, "invalid_argument");
  });
});

describe("the client's errors", () => {
  test("no such sandbox: NotFound", async () => {
    await rejectsWith(client.sandbox("no-such-sandbox"), hutch.NotFound, "not_found");
  });

  test("a wrong token: Unauthorized", async () => {
    await rejectsWith(new Client({ token: "wrong" }).list(), hutch.Unauthorized, "unauthorized");
  });

  test("no daemon there: SandboxUnavailable", async () => {
    await rejectsWith(new Client({ url: "http://127.0.0.1:9" }).list(), hutch.SandboxUnavailable, "sandbox_unavailable");
  });

  test("an unknown setting: InvalidArgument naming it", async () => {
    const error = await rejectsWith(
      client.createSandbox({ provider, ...settings, noSuchSetting: 1 }),
      hutch.InvalidArgument,
      "invalid_argument",
    );
    assert.match(error.message, /no_such_setting/);
  });

  test("every wire code has its class", () => {
    assert.equal(hutch.ERRORS_BY_CODE.get("setup_failed"), hutch.SetupFailed);
    assert.equal(new hutch.IdleTimeoutExpired("x").code, "idle_timeout");
    assert.ok(new hutch.IdleTimeoutExpired("x") instanceof hutch.SandboxExpired);
  });
});

describe("workspaces and definitions", () => {
  test("a workspace: created, suspended, resumed, listed, deleted", async (t) => {
    if (!sb.supports("snapshot")) {
      return t.skip(`${provider} cannot snapshot: no workspaces`);
    }
    const name = unique("ts-ws");
    const created = await client.createWorkspace(name, { provider, ...settings });
    assert.equal(created.name, name);
    assert.equal(created.status, "running");
    const live = await client.sandbox(created.live_sandbox_id!);
    await live.writeText("work.txt", "kept across");
    const suspended = await client.suspendWorkspace(name);
    assert.equal(suspended.live_sandbox_id, null);
    const resumed = await client.resumeWorkspace(name);
    assert.equal(await (await client.sandbox(resumed.live_sandbox_id!)).readText("work.txt"), "kept across");
    assert.ok((await client.listWorkspaces()).some((w) => w.name === name));
    assert.equal((await client.getWorkspace(name)).name, name);
    await client.deleteWorkspace(name);
    await rejectsWith(client.getWorkspace(name), hutch.NotFound, "not_found");
  });

  test("a definition: ensured (streamed, then resumed), completed; setup failing", async () => {
    const id = unique("ts-def");
    const providerSettings = { type: provider, ...settings };
    await client.putDefinition({
      id,
      provider: providerSettings,
      workspace: { setup: ["echo setting up; echo built > built.txt"] },
      lifecycle: { destroy_on_complete: true },
    });
    assert.ok((await client.definitions()).some((d) => d.id === id));
    const progress: string[] = [];
    let ensured: hutch.Ensured | undefined;
    for await (const event of client.ensureStream(id, "thread-1")) {
      if (event.kind === "result") {
        ensured = event;
      } else {
        progress.push(`${event.kind}:${event.text}`);
      }
    }
    assert.ok(ensured);
    assert.equal(ensured.path, "created");
    assert.ok(progress.some((p) => p.startsWith("step:")), progress.join("|"));
    assert.ok(progress.some((p) => p.includes("setting up")), progress.join("|"));
    assert.equal(await ensured.sandbox.readText("built.txt"), "built\n");
    const again = await client.ensure(id, "thread-1");
    assert.equal(again.path, "resumed");
    assert.equal(again.sandbox.id, ensured.sandbox.id);
    assert.ok(again.steps.every((s) => typeof s.seconds === "number"));
    assert.equal(await client.complete(id, "thread-1"), true);

    const failing = unique("ts-failing");
    await client.putDefinition({ id: failing, provider: providerSettings, workspace: { setup: ["true", "echo partial; exit 7"] } });
    const error = await rejectsWith(client.ensure(failing, "t"), hutch.SetupFailed, "setup_failed");
    assert.ok(error instanceof hutch.SetupFailed);
    assert.equal(error.exitCode, 7);
    assert.equal(error.step, "echo partial; exit 7");
    assert.match(error.outputTail, /partial/);
    await rejectsWith(client.ensure("no-such-definition", "t"), hutch.NotFound, "not_found");
  });
});

describe("warm pools", () => {
  test("a pool: set, listed, removed", async () => {
    const name = unique("ts-pool");
    const pool = await client.setPool(name, 1, { provider, ...settings });
    assert.equal(pool.name, name);
    assert.equal(pool.size, 1);
    assert.ok((await client.listPools()).some((p) => p.name === name));
    await client.removePool(name);
    assert.ok(!(await client.listPools()).some((p) => p.name === name));
    await rejectsWith(client.removePool(name), hutch.NotFound, "not_found");
  });
});

describe("events", () => {
  test("the daemon's log names what happened to a sandbox", async () => {
    const events = await client.events({ subject: sb.id, limit: 50 });
    assert.ok(events.length > 0);
    assert.ok(events.every((e) => e.subject === sb.id));
  });

  test("followEvents: the newest, then each as it happens", async () => {
    const doomed = await client.createSandbox({ provider, ...settings });
    const seen: hutch.DaemonEvent[] = [];
    const following = (async () => {
      for await (const event of client.followEvents({ subject: doomed.id, limit: 5 })) {
        seen.push(event);
        if (event.kind === "terminated" || /terminat|deleted|closed/.test(event.message)) {
          return; // stops iterating: the stream is closed
        }
      }
    })();
    await doomed.close();
    await following;
    assert.ok(seen.length >= 2, JSON.stringify(seen));
    assert.ok(seen.every((e) => e.subject === doomed.id));
  });
});
