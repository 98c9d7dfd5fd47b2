"""Every store call of the daemon runs off its event loop, on SQLite and on
PostgreSQL: a disk's fsync or a database round trip on the loop's thread
stalls every other request the daemon is serving.

The daemon runs with ``HUTCH_STORE_OFF_LOOP_CHECK=1``: a store call on the
thread running its loop raises (the request fails) and is logged with its
stack. The test drives the daemon through its API (create, exec, files,
snapshots, fork, refs, workspaces, definitions, pools, events, idle
suspend) and its start-up reconciliation (after a clean stop, after a
SIGKILL), then finds no such call in its log.
"""

from __future__ import annotations

import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import hutch
from tests import postgres_fixture
from tests.daemon_fixture import DaemonProcess

from .test_definitions import home  # noqa: F401 - a fixture
from .test_shared_deadline import Program, _definition

#: What the daemon logs for a store call on its event loop (hutch.store.base).
ON_LOOP = "store call on the event loop"
#: A hang guard for what the daemon does in the background (not a timing check).
GUARD_SECONDS = 120


@pytest.fixture(params=["sqlite", "postgresql"])
def daemon(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[DaemonProcess]:
    env = {"HUTCH_STORE_OFF_LOOP_CHECK": "1"}
    if request.param == "postgresql":
        cluster: postgres_fixture.PostgresCluster = request.getfixturevalue("postgres_cluster")
        env["HUTCH_STORE"] = cluster.url(cluster.new_database())
    config = tmp_path / "hutch.toml"
    config.write_text(textwrap.dedent("""
        [definitions.operators]
        provider = "local"
        workspace = { setup = ["echo set up > made.txt"] }
        lifecycle = { reuse = "thread", snapshot = "after-setup" }

        [pools.warm]
        size = 1
        provider = "virtual"
    """))
    (tmp_path / "data").mkdir()
    d = DaemonProcess(str(tmp_path / "data"), extra_env=env,
                      extra_args=["--config", str(config), "--retention", "1"])
    try:
        yield d
    finally:
        d.close()


def until(what: str, check: Callable[[], bool]) -> None:
    give_up = time.monotonic() + GUARD_SECONDS
    while not check():
        assert time.monotonic() < give_up, f"never: {what}"
        time.sleep(0.05)


def calls_on_loop(d: DaemonProcess) -> list[str]:
    return [line for line in d.log().splitlines() if ON_LOOP in line]


def test_no_store_call_runs_on_the_daemons_event_loop(daemon: DaemonProcess) -> None:
    daemon.start()
    assert calls_on_loop(daemon) == [], daemon.log()[-6000:]
    with hutch.Client(daemon.url, token=daemon.token) as c:
        # Sandboxes: create, exec, files, status, timeout, events.
        sb = c.create_sandbox("local", read_before_write=False)
        assert sb.exec("echo hi").stdout == "hi\n"
        sb.write_text("notes.txt", "kept")
        assert sb.read_text("notes.txt") == "kept"
        assert [f.name for f in sb.list_dir(".") if f.name == "notes.txt"] == ["notes.txt"]
        sb.set_timeout(600)
        assert sb.info()["id"] == sb.id
        assert any(s["id"] == sb.id for s in c.list_sandboxes(include_ended=True))
        assert c.events(sb.id)
        assert c.events()

        # Snapshots and forks.
        snap = sb.snapshot("kept")
        assert any(s.id == snap.id for s in c.snapshots())
        assert c.get_snapshot(snap.id).id == snap.id
        fork = sb.fork("forked", count=1)
        [branch] = fork.branches
        assert branch.read_text("notes.txt") == "kept"
        branch.close()

        # Refs: handed out, used, revoked.
        ref = sb.ref(expires_in=600)
        attached = hutch.attach_sync(ref)
        assert attached.exec("cat notes.txt").stdout == "kept"
        assert attached.info()["refs"]
        sb.revoke_ref(ref)
        with pytest.raises(hutch.HutchError):
            hutch.attach_sync(ref).exec("true")

        # Workspaces: made, suspended, resumed, deleted.
        c.create_workspace("desk", provider="local")
        ws = c.get_workspace("desk")
        desk = c.get_sandbox(ws["live_sandbox_id"])
        desk.write_text("work.txt", "in progress")
        desk_ref = desk.ref()
        c.suspend_workspace("desk")
        assert c.get_workspace("desk")["status"] == "suspended"
        c.resume_workspace("desk")
        back = c.get_sandbox(c.get_workspace("desk")["live_sandbox_id"])
        assert back.read_text("work.txt") == "in progress"
        assert hutch.attach_sync(desk_ref).read_text("work.txt") == "in progress"
        assert [w["name"] for w in c.list_workspaces()] == ["desk"]

        # Definitions: the operator's and a client's, ensured and completed.
        assert {d["id"] for d in c.definitions()} == {"operators"}
        c.put_definition({"id": "clients", "provider": "local",
                          "lifecycle": {"reuse": "thread", "destroy_on_complete": True}})
        made = c.ensure("operators", "t1")
        assert made.sandbox.read_text("made.txt") == "set up\n"
        assert c.ensure("operators", "t1").sandbox.id == made.sandbox.id
        c.delete_sandbox(made.sandbox.id)
        assert c.ensure("operators", "t1").path == "restored"
        assert c.ensure("clients", "t2").path == "created"
        assert c.complete("clients", "t2") is True

        # Pools: the operator's fills, a create takes from it, a client's made and removed.
        until("the pool fills", lambda: any(
            p["name"] == "warm" and p["ready"] == 1 for p in c.list_pools()))
        warm = c.create_sandbox("virtual")
        c.set_pool("spare", 1, {"provider": "virtual"})
        until("the second pool fills", lambda: any(
            p["name"] == "spare" and p["ready"] == 1 for p in c.list_pools()))
        c.remove_pool("spare")

        # The idle rule suspends a sandbox on its own.
        napper = c.create_sandbox("virtual", idle_suspend_after=1)
        until("the idle sandbox is suspended", lambda: napper.status().state == "suspended")
        napper.resume()
        warm.pause()
        warm.resume()
        c.delete_sandbox(warm.id)
    assert calls_on_loop(daemon) == [], "\n".join(calls_on_loop(daemon))

    # Start-up reconciles the store with what runs: after a clean stop, and after a crash.
    daemon.stop()
    daemon.start()
    daemon.restart()
    with hutch.Client(daemon.url, token=daemon.token) as c:
        assert c.get_sandbox(sb.id).read_text("notes.txt") == "kept"
        assert c.get_workspace("desk")["status"] == "running"
        c.delete_workspace("desk")
        c.delete_sandbox(sb.id)
        # The ended sandboxes are pruned after the retention period.
        until("ended sandboxes are pruned", lambda: not any(
            s["id"] == sb.id for s in c.list_sandboxes(include_ended=True)))
        for s in c.snapshots():
            c.delete_snapshot(s.id, force=True)
    assert calls_on_loop(daemon) == [], "\n".join(calls_on_loop(daemon))


def test_no_store_call_of_a_shared_sandbox_runs_on_a_programs_event_loop(
    home: Path,  # noqa: F811
) -> None:
    """In-process, no daemon: two programs hold one thread's sandbox, each
    with its own engine over the store they share, the off-loop check on in
    both. One moves the deadline; the other's next operation (which looks
    whether another program moved the sandbox) and its timer (which looks
    whether one moved its limits), and its info (which says the deadline
    just set), read the store off their event loop, and a status after an
    operation says the deadline from what the operation read: the
    operations succeed, and neither program logs a store call on its loop."""
    check = {"HUTCH_STORE_OFF_LOOP_CHECK": "1"}
    a = Program(_definition({}), env=check)
    b = None
    try:
        assert a.ask("ensure")["path"] == "created"
        b = Program(_definition({}), env=check)
        assert b.ask("ensure")["path"] == "resumed"
        b.ask("timeout 600")
        # Past a timer poll (LIMITS_POLL_SECONDS) too, then an operation.
        assert a.ask("read 1.5") == {"read": "ran\n"}
        deadline = b.ask("timeout 900")["deadline"]
        assert b.ask("read") == {"read": "ran\n"}
        # What the other program just set, read off the loop by the async info().
        assert a.ask("info")["deadline"] == pytest.approx(deadline, abs=0.01)
        deadline = b.ask("timeout 1200")["deadline"]
        # An operation's look read the record off the loop: the status after
        # it says the new deadline without reading it again on the loop.
        assert a.ask("read") == {"read": "ran\n"}
        assert a.ask("status")["deadline"] == pytest.approx(deadline, abs=0.01)
    finally:
        logs = [p.stderr() for p in (a, b) if p is not None]
    assert [line for log in logs for line in log.splitlines() if ON_LOOP in line] == [], logs
