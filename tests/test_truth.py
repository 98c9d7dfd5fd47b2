"""Truth and no loss (issue 7): what the daemon says is what happened.

Every test here runs a real daemon process (tests/daemon_fixture.py); the
docker ones a real Docker Engine.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import docker
import httpx
import pytest

import hutch
from tests.conftest import TEST_IMAGE
from tests.daemon_fixture import DaemonProcess
from tests.diskfill import fill
from tests.test_bounded import BACKTRACKING

HUTCH = [sys.executable, "-m", "hutch.cli.main"]


@pytest.fixture
def daemon() -> Iterator[DaemonProcess]:
    d = DaemonProcess().start()
    yield d
    try:
        d.remove_everything()  # sandboxes, workspaces and snapshots outlive a stop
    finally:
        d.close()


def client(d: DaemonProcess) -> hutch.Client:
    return hutch.Client(d.url, token=d.token)


def cli(d: DaemonProcess, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, COLUMNS="200", HUTCH_URL=d.url, HUTCH_TOKEN=d.token)
    return subprocess.run([*HUTCH, *args], capture_output=True, text=True, env=env,
                          timeout=120, check=False)


def wait_until(predicate: object, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return
        time.sleep(0.1)
    raise AssertionError(f"not within {timeout} s: {what}")


# -- 6. ending is idempotent and leaves a record ---------------------------------------


def test_ending_an_ended_sandbox_succeeds_and_its_record_stays(daemon: DaemonProcess) -> None:
    workdir = tempfile.mkdtemp()
    with client(daemon) as c:
        expired = c.create_sandbox("local", workdir=workdir, max_lifetime=1)
        wait_until(lambda: c.get_sandbox(expired.id).info()["state"] == "terminated", 10,
                   "the sandbox is reaped")
        info = c.get_sandbox(expired.id).info()
        assert info["reason"] == "max_lifetime_exceeded" and info["ended_at_unix"] is not None
        with pytest.raises(hutch.MaxLifetimeExceeded):
            expired.exec("true")
        # Cleanup code needs no try/except: every way of ending it again succeeds.
        c.delete_sandbox(expired.id)
        expired.close()

        deleted = c.create_sandbox("local", workdir=workdir)
        c.delete_sandbox(deleted.id)
        c.delete_sandbox(deleted.id)
        deleted.close()
        assert c.get_sandbox(deleted.id).info()["state"] == "terminated"

        live = c.create_sandbox("local", workdir=workdir)
        assert {s["id"] for s in c.list_sandboxes()} == {live.id}
        everything = {s["id"]: s for s in c.list_sandboxes(include_ended=True)}
        assert set(everything) == {expired.id, deleted.id, live.id}
        assert everything[expired.id]["reason"] == "max_lifetime_exceeded"
        assert everything[deleted.id]["reason"] == "closed"

        with pytest.raises(hutch.NotFound):
            c.delete_sandbox("sb-never-made")

    listing = cli(daemon, "ls", "--all")
    assert listing.returncode == 0, listing.stderr
    assert expired.id in listing.stdout and "terminated" in listing.stdout
    assert "max_lifetime_exceeded" in cli(daemon, "ls", "--all", "--wide").stdout
    assert expired.id not in cli(daemon, "ls").stdout
    told = cli(daemon, "events", expired.id)
    assert told.returncode == 0, told.stderr
    assert "running -> terminated (max_lifetime_exceeded)" in told.stdout
    assert cli(daemon, "kill", expired.id).returncode == 0
    assert cli(daemon, "kill", deleted.id).returncode == 0
    shutil.rmtree(workdir, ignore_errors=True)


def test_ended_sandboxes_are_pruned_after_the_retention_period() -> None:
    d = DaemonProcess(extra_args=("--retention", "2")).start()
    workdir = tempfile.mkdtemp()
    try:
        with client(d) as c:
            sb = c.create_sandbox("local", workdir=workdir)
            kept = c.create_sandbox("local", workdir=workdir)
            sb.close()
            assert c.get_sandbox(sb.id).info()["state"] == "terminated"
            assert c.events(sb.id)
            wait_until(lambda: not c.events(sb.id), 10, "the ended sandbox's events pruned")
            with pytest.raises(hutch.NotFound):
                c.get_sandbox(sb.id)
            assert sb.id not in {s["id"] for s in c.list_sandboxes(include_ended=True)}
            # A live sandbox is never pruned, however old.
            assert kept.exec("echo alive").stdout == "alive\n"
            assert c.events(kept.id)
    finally:
        d.close()
        shutil.rmtree(workdir, ignore_errors=True)


@pytest.mark.anyio
async def test_closing_an_expired_sandbox_in_process_succeeds() -> None:
    engine = hutch.LifecycleEngine(clock=hutch.VirtualClock())
    sb = await hutch.create_sandbox("virtual", engine=engine, idle_timeout=5)
    await engine.advance(6)
    assert sb.status().reason == "idle_timeout"
    await sb.close()
    await sb.close()
    with pytest.raises(hutch.IdleTimeoutExpired):
        await sb.exec("true")


# -- 4. a sandbox whose runtime dies is noticed ----------------------------------------


def container_of(sandbox_id: str) -> str:
    api = docker.APIClient()
    found = api.containers(all=True, filters={"label": f"hutch.sandbox_id={sandbox_id}"})
    assert len(found) == 1, found
    return str(found[0]["Id"])


def wait_for_state(c: hutch.Client, sandbox_id: str, state: str, timeout: float) -> dict[str, Any]:
    seen: dict[str, Any] = {}

    def reached() -> bool:
        seen.update(c.get_sandbox(sandbox_id).info())
        return seen["state"] == state

    wait_until(reached, timeout, f"{sandbox_id} becomes {state} (last seen {seen})")
    return seen


@pytest.mark.docker
def test_a_container_removed_from_outside_fails_its_sandbox(daemon: DaemonProcess) -> None:
    api = docker.APIClient()
    with client(daemon) as c:
        removed = c.create_sandbox("docker", image=TEST_IMAGE, idle_suspend_after=1)
        killed = c.create_sandbox("docker", image=TEST_IMAGE)
        removed.write_text("work.txt", "precious")
        api.remove_container(container_of(removed.id), force=True)
        api.kill(container_of(killed.id), signal="SIGKILL")
        # 5 s is the promise; the margin is for a loaded machine.
        info = wait_for_state(c, removed.id, "failed", 8)
        assert "removed outside hutch" in info["reason"], info
        info = wait_for_state(c, killed.id, "failed", 8)
        assert "signal 9" in info["reason"] or "removed" in info["reason"], info
        for call in (lambda: removed.exec("true"), lambda: removed.read_text("work.txt"),
                     removed.resume, removed.pause, lambda: removed.set_timeout(60)):
            with pytest.raises(hutch.SandboxUnavailable) as caught:
                call()
            assert removed.id in str(caught.value) and "removed outside hutch" in str(
                caught.value
            )
        assert any("failed" in e["message"] and "removed outside hutch" in e["message"]
                   for e in c.events(removed.id))
        # Its timers stopped: the idle suspend (1 s) does not try, and fail, forever.
        time.sleep(3)
        assert "Traceback" not in daemon.log(), daemon.log()
        removed.close()
        c.delete_sandbox(killed.id)
        assert c.get_sandbox(killed.id).info()["state"] == "failed"
    assert not docker.APIClient().containers(
        all=True, filters={"label": f"hutch.daemon={daemon.data_dir}"}
    )


@pytest.mark.docker
def test_a_workspace_whose_container_is_removed_goes_stale(daemon: DaemonProcess) -> None:
    with client(daemon) as c:
        ws = c.create_workspace("dies", image=TEST_IMAGE)
        sandbox_id = ws["live_sandbox_id"]
        docker.APIClient().remove_container(container_of(sandbox_id), force=True)
        wait_until(lambda: c.get_workspace("dies")["status"] == "stale", 8,
                   "the workspace goes stale")
        assert c.get_sandbox(sandbox_id).info()["state"] == "failed"
        c.delete_workspace("dies")


# -- 2. the store is the truth, or the call fails ---------------------------------------


def host_views(data_dir: str, sandbox_id: str, d: DaemonProcess) -> str:
    """What the host sees of a docker sandbox's layered working directory
    (its upper directory, its overlay, the mounts naming it) and the daemon's
    log: said when a file reads wrong, for a failure seen once in CI."""
    base = os.path.join(data_dir, "layers", "mounts", sandbox_id)
    # A capped one's upper directory is in its store (an ext4 image, loop-mounted).
    store = os.path.join(data_dir, "layers", "stores", sandbox_id)
    lines = []
    for where in (f"{base}/upper/work.txt", f"{store}/upper/work.txt", f"{base}/merged/work.txt"):
        try:
            with open(where, "rb") as fh:
                lines.append(f"{where}: {fh.read()!r}")
        except OSError as exc:
            lines.append(f"{where}: {exc}")
    with contextlib.suppress(OSError):
        lines.append(f"{base}: {sorted(os.listdir(base))}")
    with open("/proc/self/mountinfo") as fh:
        lines += [line.strip() for line in fh if sandbox_id in line]
    # A write-back the store's image could not take (tests/test_capped_full_host.py).
    kernel = subprocess.run(["dmesg"], capture_output=True, text=True, check=False).stdout
    lines += [line for line in kernel.splitlines()[-200:] if "loop" in line or "EXT4" in line][-20:]
    return "\n".join([*lines, d.log()])


def stored_state(data_dir: str, sandbox_id: str) -> tuple[str, float | None]:
    """(state, deadline) as the daemon's SQLite file has them, read from outside."""
    with contextlib.closing(sqlite3.connect(f"file:{data_dir}/hutch.db?mode=ro", uri=True)) as db:
        row = db.execute("SELECT state, deadline_unix FROM sandboxes WHERE id = ?",
                         (sandbox_id,)).fetchone()
    return str(row[0]), row[1]


@pytest.mark.docker
def test_a_full_store_refuses_transitions_and_nothing_is_half_done() -> None:
    mount = tempfile.mkdtemp(prefix="hutch-full-")
    # Room for two capped stores (each reserves its metadata and 128 MiB free).
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=600m,mode=0700", "tmpfs", mount],
                   check=True)
    log_dir = tempfile.mkdtemp(prefix="hutch-log-")
    d = DaemonProcess(data_dir=mount, log_path=os.path.join(log_dir, "daemon.log"))
    api = docker.APIClient()
    try:
        d.start()
        with client(d) as c:
            sb = c.create_sandbox("docker", image=TEST_IMAGE)
            doomed = c.create_sandbox("docker", image=TEST_IMAGE)
            # Not synced: its capped store reserves on this disk what it may
            # write, so a full disk loses nothing it was told was written
            # (tests/test_capped_full_host.py).
            sb.write_text("work.txt", "written before the disk filled")
            filler = fill(mount)
            # What the flusher and memory pressure would do, now: a store that
            # could not write back into its image would read back as zeros.
            os.sync()
            with open("/proc/sys/vm/drop_caches", "w") as fh:
                fh.write("3")
            refused = {
                "pause": sb.pause, "suspend": sb.suspend, "delete": sb.close,
                "set_timeout": lambda: sb.set_timeout(600),
            }
            for name, call in refused.items():
                with pytest.raises(hutch.StoreUnavailable) as caught:
                    call()
                assert "hutch.db" in str(caught.value), name
                # The daemon, its store and the engine agree: nothing happened.
                info = sb.info()
                assert (info["state"], info["deadline_unix"]) == ("running", None), name
                assert stored_state(mount, sb.id) == ("running", None), name
                details = api.inspect_container(container_of(sb.id))["State"]
                assert details["Running"] and not details["Paused"], name
                assert sb.exec("cat work.txt").stdout == "written before the disk filled"

            # A death the store cannot record yet is recorded once it can.
            api.remove_container(container_of(doomed.id), force=True)
            with pytest.raises(hutch.SandboxUnavailable):
                doomed.exec("true")
            time.sleep(3)
            os.remove(filler)
            info = wait_for_state(c, doomed.id, "failed", 10)
            assert "removed outside hutch" in info["reason"]
            assert stored_state(mount, doomed.id)[0] == "failed"
            # A crash now: what was refused left nothing to adopt but a
            # running sandbox with its files (the undone suspend's new
            # container is found though the record names the one before).
            d.restart()
            assert sb.info()["state"] == "running"
            seen = sb.exec("cat work.txt").stdout
            assert seen == "written before the disk filled", host_views(mount, sb.id, d)
            sb.pause()
            assert stored_state(mount, sb.id)[0] == "paused"
            d.restart()  # a crash: what is adopted is what was acknowledged
            again = c.get_sandbox(sb.id)
            assert again.info()["state"] == "paused"
            again.resume()
            assert again.read_text("work.txt") == "written before the disk filled"
            again.close()
            assert stored_state(mount, sb.id)[0] == "terminated"
            # The refused suspend's image went with the sandbox.
            assert api.images(name=f"hutch-suspended:{sb.id}") == []
    finally:
        d.stop()
        for container in api.containers(all=True, filters={"label": f"hutch.daemon={mount}"}):
            api.remove_container(container["Id"], force=True)
        # Recursively and lazily: a sandbox's working directory may be a
        # mount of its own inside the data directory.
        subprocess.run(["umount", "-R", "-l", mount], check=False)
        shutil.rmtree(mount, ignore_errors=True)
        shutil.rmtree(log_dir, ignore_errors=True)


# -- 5. what happened is told ----------------------------------------------------------


@pytest.mark.docker
def test_an_oom_killed_command_is_told_as_such(
    daemon: DaemonProcess, docker_runtime: str
) -> None:
    with client(daemon) as c:
        sb = c.create_sandbox("docker", image=TEST_IMAGE, memory="64m", runtime=docker_runtime)
        hog = "head -c 400m /dev/zero | tail > /dev/null"
        result = sb.exec(hog)
        assert (result.exit_code, result.oom_killed) == (137, True), result
        streamed = [e for e in sb.exec_stream(hog) if isinstance(e, hutch.ExitStatus)]
        assert [(e.exit_code, e.oom_killed) for e in streamed] == [(137, True)]
        # A SIGKILL that is not the OOM killer's is not called one.
        plain = sb.exec("kill -KILL $$")
        assert (plain.exit_code, plain.oom_killed) == (137, False)
        wait_until(lambda: any("OOM killer" in e["message"] for e in c.events(sb.id)), 10,
                   "the sandbox's events tell of the OOM kill")
        assert sb.info()["state"] == "running"
        sb.close()


@pytest.mark.docker
def test_a_burst_of_oom_kills_is_told_once_with_its_count(daemon: DaemonProcess) -> None:
    """A flood of processes over the memory limit has the OOM killer end them
    by the dozen: the events say so in a line or two, not one line a kill."""
    with client(daemon) as c:
        sb = c.create_sandbox("docker", image=TEST_IMAGE, memory="64m", runtime="native")
        sb.exec("for i in $(seq 40); do "
                "(x=$(head -c 3000000 /dev/zero | tr '\\0' a); sleep 3) & done; wait",
                timeout=60)
        told: list[str] = []

        def counted() -> bool:
            told[:] = [e["message"] for e in c.events(sb.id) if "OOM killer" in e["message"]]
            return any(" times in " in m for m in told)

        # A burst is told once it has been quiet a while (at most 20 s after it began).
        wait_until(counted, 25, f"the burst is told with its count ({told})")
        assert len(told) <= 2, told
        assert sb.info()["state"] == "running"
        sb.close()


@pytest.mark.parametrize("provider", ["local", pytest.param("docker", marks=pytest.mark.docker)])
def test_a_command_killed_by_a_signal_exits_128_plus_n(
    daemon: DaemonProcess, provider: str
) -> None:
    settings = {"image": TEST_IMAGE} if provider == "docker" else {}
    with client(daemon) as c, c.create_sandbox(provider, **settings) as sb:
        assert sb.exec("kill -TERM $$").exit_code == 128 + 15
        assert sb.exec(["sh", "-c", "kill -KILL $$"]).exit_code == 128 + 9
        [status] = [e for e in sb.exec_stream("kill -INT $$")
                    if isinstance(e, hutch.ExitStatus)]
        assert status.exit_code == 128 + 2


@pytest.mark.docker
def test_error_messages_name_the_sandboxs_paths_not_the_hosts(daemon: DaemonProcess) -> None:
    with client(daemon) as c, c.create_sandbox("docker", image=TEST_IMAGE) as sb:
        sb.exec("ln -s loop-b loop-a && ln -s loop-a loop-b")
        for call in (lambda: sb.read_text("loop-a"), lambda: sb.write_text("loop-a", "x")):
            with pytest.raises(hutch.HutchError) as caught:
                call()
            message = str(caught.value)
            assert "/workspace/loop-a" in message, message
            assert "/var/lib/docker" not in message and "overlay" not in message, message


# -- 7. processes are owned ------------------------------------------------------------


@pytest.mark.docker
def test_orphans_are_reaped_and_never_fill_the_pids_limit(daemon: DaemonProcess) -> None:
    with client(daemon) as c, c.create_sandbox(
        "docker", image=TEST_IMAGE, pids_limit=64
    ) as sb:
        # Each (true &) leaves an orphan that only an init as PID 1 reaps.
        assert sb.exec("for i in $(seq 300); do (true &); done").exit_code == 0
        states = sb.exec(["ps", "-e", "-o", "stat="]).stdout.split()
        assert not [s for s in states if s.startswith("Z")], states
        # Far more than the limit left over: the pids limit is not reached.
        spawned = sb.exec("for i in $(seq 40); do sleep 5 & done; jobs -p | wc -l; kill $(jobs -p)")
        assert spawned.exit_code == 0 and spawned.stdout.strip() == "40", spawned


def processes_in(sandbox_id: str) -> list[str]:
    """The command lines alive in a sandbox's container, seen from the host."""
    top = docker.APIClient().top(container_of(sandbox_id), ps_args="-e -o pid,stat,args")
    return [row[2] for row in top.get("Processes") or [] if not row[1].startswith("Z")]


@pytest.mark.docker
@pytest.mark.parametrize("runtime", ["agent", "native"])
def test_a_timeout_kills_the_tree_even_when_the_pids_are_exhausted(
    daemon: DaemonProcess, runtime: str
) -> None:
    with client(daemon) as c, c.create_sandbox(
        "docker", image=TEST_IMAGE, pids_limit=40, runtime=runtime
    ) as sb:
        assert sb.capabilities.runtime == runtime
        with pytest.raises(hutch.ExecTimeout) as caught:
            sb.exec("while :; do sleep 1000 & done 2>/dev/null", timeout=3)
        assert "killed" in str(caught.value)
        # What the error says is true: only the keepers are left.
        wait_until(lambda: len(processes_in(sb.id)) == 2, 10,
                   f"the tree is gone (left: {processes_in(sb.id)})")
        assert sb.exec("echo free").stdout == "free\n"


@pytest.mark.parametrize("kind", [
    "local",
    pytest.param("docker-agent", marks=pytest.mark.docker),
    pytest.param("docker-native", marks=pytest.mark.docker),
])
def test_commands_left_running_by_a_crashed_daemon_are_ended_and_told(
    daemon: DaemonProcess, kind: str
) -> None:
    provider, _, runtime = kind.partition("-")
    settings: dict[str, Any] = {"image": TEST_IMAGE, "runtime": runtime} if runtime else {}
    # Told apart by pgrep from the same test's on another xdist worker (or run):
    # each command sleeps a time of its own.
    tag = secrets.randbelow(10**6)
    first, second, third, fourth = (f"sleep 100{i}.{tag:06d}" for i in range(1, 5))
    with client(daemon) as c:
        sb = c.create_sandbox(provider, **settings)
        sb.start(first)
        sb.exec(f"nohup {second} >/dev/null 2>&1 &")
        # Another sandbox's command on the same host is not this sandbox's to end.
        neighbour = subprocess.Popen(
            third.split(), env={"HUTCH_EXEC_ID": "x", "HUTCH_SANDBOX_ID": "sb-neighbour"}
        )
        daemon.restart()

        def running(pattern: str) -> bool:
            return subprocess.run(["pgrep", "-f", pattern], capture_output=True,
                                  check=False).returncode == 0

        assert not running(first) and not running(second)
        told = [e["message"] for e in c.events(sb.id) if "killed 2 processes" in e["message"]]
        assert told, c.events(sb.id)
        assert neighbour.poll() is None, "another sandbox's command was killed"
        if provider == "docker":
            # One adopted paused has its leftovers ended as it resumes.
            held = c.create_sandbox(provider, **settings)
            held.start(fourth)
            wait_until(lambda: running(fourth), 10, "the command runs")
            held.pause()
            daemon.restart()
            assert running(fourth)  # frozen, not yet reachable
            held.resume()
            assert not running(fourth)
            assert any("killed 1 processes" in e["message"] for e in c.events(held.id))
            assert held.exec("echo thawed").stdout == "thawed\n"
            held.close()
        neighbour.kill()
        neighbour.wait()
        assert sb.exec("echo still here").stdout == "still here\n"
        sb.close()


@pytest.mark.docker
@pytest.mark.parametrize("runtime", ["agent", "native"])
def test_a_timeout_kills_a_child_that_cleared_its_environment(
    daemon: DaemonProcess, runtime: str
) -> None:
    """The tree kill says it killed the tree: a child with no marker in its
    environment (env -i) is still part of it."""
    with client(daemon) as c, c.create_sandbox(
        "docker", image=TEST_IMAGE, runtime=runtime
    ) as sb:
        with pytest.raises(hutch.ExecTimeout) as caught:
            sb.exec("env -i sleep 1000 & wait", timeout=2)
        assert "killed" in str(caught.value)
        wait_until(lambda: len(processes_in(sb.id)) == 2, 10,
                   f"the tree is gone (left: {processes_in(sb.id)})")


# -- 1. cancelling a call (its client gone) kills what it started -------------------------


@pytest.mark.docker
def test_a_caller_gone_ends_what_any_call_started_in_the_sandbox(daemon: DaemonProcess) -> None:
    """Every call, with a body or without (a listing, a removal), whose client
    goes away has what it started inside the sandbox killed; a wait starts
    nothing, so the command it waited on runs on."""
    headers = {"Authorization": f"Bearer {daemon.token}"}
    with client(daemon) as c, httpx.Client(base_url=daemon.url, headers=headers) as http:
        sb = c.create_sandbox("docker", image=TEST_IMAGE, runtime="native")
        base = f"/v1/sandboxes/{sb.id}"
        sb.write_text("bad.txt", "a" * 30 + "!\n")
        sb.exec("mkdir doomed")
        waited_on = sb.start("sleep 1004")
        # The helpers hutch runs for a listing and a removal, made to hang as
        # the sandbox's owner (root inside) can make them.
        sb.exec("printf '#!/bin/sh\\nexec sleep 1001\\n' > /usr/local/bin/find; "
                "printf '#!/bin/sh\\nexec sleep 1002\\n' > /usr/local/bin/rm; "
                "chmod +x /usr/local/bin/find /usr/local/bin/rm")
        calls = [
            ("GET", "/list", {"params": {"path": "/workspace"}}, "sleep 1001"),
            ("DELETE", "/files", {"params": {"path": "doomed", "recursive": "true"}},
             "sleep 1002"),
            ("POST", "/exec", {"json": {"cmd": ["sleep", "1003"]}}, "sleep 1003"),
            ("POST", "/grep", {"json": {"pattern": BACKTRACKING, "timeout": 120}}, "sleep 1001"),
        ]
        for method, path, how, started in calls:
            with pytest.raises(httpx.ReadTimeout):  # the client gives up and goes
                http.request(method, base + path, timeout=3, **how)  # type: ignore[arg-type]
            wait_until(lambda started=started: started not in processes_in(sb.id), 10,
                       f"{method} {path}: {started} outlived its caller "
                       f"(left: {processes_in(sb.id)})")
        with pytest.raises(httpx.ReadTimeout):
            http.post(f"{base}/processes/{waited_on.id}/wait", json={"timeout": 120}, timeout=2)
        time.sleep(1)
        assert "sleep 1004" in processes_in(sb.id)
        assert sb.exec("echo still here").stdout == "still here\n"
        sb.close()


@pytest.mark.docker
def test_a_transition_whose_caller_is_gone_finishes_and_is_recorded(
    daemon: DaemonProcess,
) -> None:
    """A suspend, a resume or a delete is not cut in half by its caller going:
    it finishes, and the daemon, its store and the engine agree."""
    headers = {"Authorization": f"Bearer {daemon.token}"}
    api = docker.APIClient()
    with client(daemon) as c, httpx.Client(base_url=daemon.url, headers=headers) as http:
        sb = c.create_sandbox("docker", image=TEST_IMAGE)
        sb.write_text("work.txt", "kept")
        base = f"/v1/sandboxes/{sb.id}"
        for action, state in (("suspend", "suspended"), ("resume", "running"),
                              ("pause", "paused"), ("resume", "running")):
            with contextlib.suppress(httpx.ReadTimeout):  # the caller leaves at once
                http.post(f"{base}/{action}", timeout=0.05)
            wait_for_state(c, sb.id, state, 60)
            time.sleep(0.5)  # what a cut-off step would leave half done shows by now
            assert sb.info()["state"] == state, action
            assert stored_state(daemon.data_dir, sb.id)[0] == state, action
            running = [x["State"] for x in api.containers(
                all=True, filters={"label": f"hutch.sandbox_id={sb.id}"})]
            assert running == ({"suspended": [], "paused": ["paused"]}.get(state, ["running"])), (
                action, running)
        assert sb.read_text("work.txt") == "kept"
        with contextlib.suppress(httpx.ReadTimeout):
            http.delete(base, timeout=0.05)
        wait_for_state(c, sb.id, "terminated", 60)
        wait_until(lambda: not api.containers(
            all=True, filters={"label": f"hutch.sandbox_id={sb.id}"}), 30, "its container goes")
        assert stored_state(daemon.data_dir, sb.id)[0] == "terminated"


@pytest.mark.docker
def test_a_keeper_killed_by_the_oom_killer_fails_its_sandbox(daemon: DaemonProcess) -> None:
    """The OOM killer ending the container's keeper (not a command run in
    it) is the runtime dying: the sandbox fails, saying so, and stays failed.

    On the native runtime the keeper shares the container's memory with the
    commands; on the agent runtime the commands have a cgroup of their own
    below it, so that they cannot take the keeper's room (tested with a
    memory hog in test_bounded)."""
    with client(daemon) as c:
        sb = c.create_sandbox("docker", image=TEST_IMAGE, memory="64m", runtime="native")
        # The keepers (init and its child) become the OOM killer's first
        # choice; the hogs, many small ones, are not.
        sb.exec("for p in 1 $(pgrep -P 1); do echo 1000 > /proc/$p/oom_score_adj; done")
        with contextlib.suppress(hutch.HutchError):  # its answer may die with the keeper
            sb.exec("for i in $(seq 40); do "
                    "(x=$(head -c 3000000 /dev/zero | tr '\\0' a); sleep 60) & done; wait",
                    timeout=30)
        info = wait_for_state(c, sb.id, "failed", 10)
        assert "OOM" in info["reason"], info
        for call in (lambda: sb.exec("true"), lambda: sb.read_text("/etc/hostname"), sb.resume):
            with pytest.raises(hutch.SandboxUnavailable) as caught:
                call()
            assert sb.id in str(caught.value) and "OOM" in str(caught.value)
        assert any("failed" in e["message"] and "OOM" in e["message"] for e in c.events(sb.id))
        time.sleep(1)
        assert c.get_sandbox(sb.id).info()["state"] == "failed"  # not brought back unseen
        sb.close()
