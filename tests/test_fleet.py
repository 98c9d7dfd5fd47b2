"""A fleet: three daemons over one PostgreSQL store (issue 24).

Real daemons (``hutch serve`` processes) on a real PostgreSQL cluster: each
serves the sandboxes it owns, forwards requests for the others' (HTTP,
streams, the PTY websocket) to their owner, and lists every sandbox once;
a killed daemon's sandboxes are taken over by a live one (docker) or
recorded failed (those only its host reached).
"""

from __future__ import annotations

import concurrent.futures
import glob
import os
import pathlib
import signal
import time
from collections.abc import Iterator

import pytest

import hutch
from hutch._refwire import DaemonRef, decode_ref
from tests import postgres_fixture
from tests.conftest import TEST_IMAGE
from tests.daemon_fixture import DaemonProcess, sandbox_processes

#: Short leases, so a killed daemon's sandboxes move on within seconds.
LEASE_SECONDS = 5
#: Sandboxes made at once through the fleet (the acceptance's count).
SANDBOXES = 300


def fleet_daemon(store: str) -> DaemonProcess:
    return DaemonProcess(extra_env={"HUTCH_STORE": store,
                                    "HUTCH_FLEET_LEASE_SECONDS": str(LEASE_SECONDS)})


@pytest.fixture
def fleet(postgres_cluster: postgres_fixture.PostgresCluster) -> Iterator[list[DaemonProcess]]:
    store = postgres_cluster.url(postgres_cluster.new_database())
    daemons = [fleet_daemon(store) for _ in range(3)]
    try:
        for d in daemons:
            d.start()
        yield daemons
    finally:
        for d in daemons:
            d.close()


def client(d: DaemonProcess) -> hutch.Client:
    return hutch.Client(d.url, token=d.token)


def listed_ids(d: DaemonProcess) -> list[str]:
    with client(d) as c:
        return sorted(s["id"] for s in c.list_sandboxes())


def test_sandboxes_made_through_three_daemons_are_listed_once_by_each(
    fleet: list[DaemonProcess],
) -> None:
    """The acceptance's 300, made concurrently through all three (a few on
    docker, the rest virtual, so that the test stays quick)."""
    clients = [client(d) for d in fleet]

    def make(i: int) -> str:
        c = clients[i % 3]
        if i % 25 == 0:
            return c.create_sandbox("docker", image=TEST_IMAGE).id
        return c.create_sandbox("virtual").id

    try:
        with concurrent.futures.ThreadPoolExecutor(12) as pool:
            made = sorted(pool.map(make, range(SANDBOXES)))
    finally:
        for c in clients:
            c.close()
    assert len(set(made)) == SANDBOXES
    for d in fleet:
        assert listed_ids(d) == made
    # Each is served by whichever daemon is asked.
    with client(fleet[1]) as c:
        for sandbox_id in made:
            sb = c.get_sandbox(sandbox_id)
            sb.write_text("hello.txt", sandbox_id)
            assert sb.read_text("hello.txt") == sandbox_id


def test_a_sandbox_is_served_through_a_daemon_that_does_not_own_it(
    fleet: list[DaemonProcess],
) -> None:
    owner, other = fleet[0], fleet[2]
    with client(owner) as c:
        made = c.create_sandbox("docker", image=TEST_IMAGE)
    with client(other) as c:
        sb = c.get_sandbox(made.id)
        assert sb.exec("echo through $((40 + 2))").stdout == "through 42\n"
        sb.write_bytes("round/trip.bin", bytes(range(256)) * 1000)
        assert sb.read_bytes("round/trip.bin") == bytes(range(256)) * 1000
        lines = [e for e in sb.exec_stream("for i in 1 2 3; do echo $i; done")]
        out = b"".join(getattr(e, "data", b"") for e in lines)
        assert out.decode().split() == ["1", "2", "3"]
        with sb.pty(["sh", "-c", "read x; echo got $x"]) as term:
            term.write(b"word\n")
            seen = b""
            while (chunk := term.read(timeout=60)) is not None:
                seen += chunk.data
            assert b"got word" in seen
            assert term.wait() == 0
        sb.pause()
        sb.resume()
    with client(owner) as c:
        assert c.get_sandbox(made.id).read_bytes("round/trip.bin") == bytes(range(256)) * 1000


def test_a_ref_minted_on_one_daemon_is_used_on_another(fleet: list[DaemonProcess]) -> None:
    with client(fleet[0]) as c:
        sb = c.create_sandbox("virtual")
        ref = decode_ref(sb.ref())
    assert ref is not None
    elsewhere = DaemonRef(fleet[1].url, ref.sandbox_id, ref.ref_id, ref.secret).encode()
    worker = hutch.attach_sync(elsewhere)
    try:
        assert worker.id == sb.id
        worker.write_text("from-worker.txt", "w")
        assert worker.read_text("from-worker.txt") == "w"
    finally:
        worker.close()
    with client(fleet[0]) as c:
        assert c.get_sandbox(sb.id).read_text("from-worker.txt") == "w"


def test_two_daemons_racing_ensure_for_one_thread_make_one_sandbox(
    fleet: list[DaemonProcess],
) -> None:
    with client(fleet[0]) as c:
        c.put_definition({"id": "agent",
                          "provider": {"type": "docker", "image": TEST_IMAGE, "runtime": "native"},
                          "workspace": {"setup": ["echo ready > ready.txt"]}})

    def ensure(d: DaemonProcess) -> str:
        with client(d) as c:
            return str(c.ensure("agent", "thread-1").sandbox.id)

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        got = list(pool.map(ensure, [fleet[0], fleet[1], fleet[0], fleet[1]]))
    assert len(set(got)) == 1, got
    for d in fleet:
        assert listed_ids(d) == [got[0]]


def test_a_definition_put_through_one_daemon_is_the_fleets(
    fleet: list[DaemonProcess],
) -> None:
    """Listed by every daemon, and a new version put through one is the one
    every other lists and ensures by, not the one it saw first."""
    first, other = fleet[0], fleet[1]

    def listed(d: DaemonProcess) -> dict[str, list[str]]:
        with client(d) as c:
            return {x["id"]: x["workspace"]["setup"] for x in c.definitions()}

    def put(setup: str) -> None:
        with client(first) as c:
            c.put_definition({"id": "shared", "provider": {"type": "docker", "image": TEST_IMAGE,
                                                           "runtime": "native"},
                              "workspace": {"setup": [setup]}})

    put("echo one > made.txt")
    assert listed(other) == {"shared": ["echo one > made.txt"]}
    put("echo two > made.txt")
    for d in fleet:
        assert listed(d) == {"shared": ["echo two > made.txt"]}
    with client(other) as c:
        sb = c.ensure("shared", "thread-2").sandbox
        assert sb.read_text("made.txt") == "two\n"


def test_workspace_locks_hold_across_daemons(fleet: list[DaemonProcess]) -> None:
    """Three daemons racing to make one workspace make one (the others are
    told it exists), and its suspends raced through two daemons run one at
    a time (by its owner): one sandbox, then none, never two."""

    def create(d: DaemonProcess) -> str | hutch.HutchError:
        with client(d) as c:
            try:
                return str(c.create_workspace("shared", provider="virtual")["live_sandbox_id"])
            except hutch.HutchError as exc:
                return exc

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        got = list(pool.map(create, [*fleet, *fleet]))
    made = [g for g in got if isinstance(g, str)]
    refused = [g for g in got if not isinstance(g, str)]
    assert len(made) == 1, got
    for exc in refused:
        assert isinstance(exc, hutch.InvalidState) and "already exists" in str(exc), exc
    for d in fleet:
        assert listed_ids(d) == made
        with client(d) as c:
            assert [w["name"] for w in c.list_workspaces()] == ["shared"]

    def suspend(d: DaemonProcess) -> str:
        with client(d) as c:
            try:
                return str(c.suspend_workspace("shared")["status"])
            except hutch.InvalidState as exc:
                return f"refused: {exc}"

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        outcomes = list(pool.map(suspend, [fleet[1], fleet[2]]))
    assert "suspended" in outcomes, outcomes
    for d in fleet:
        assert listed_ids(d) == []
        with client(d) as c:
            assert c.get_workspace("shared")["status"] == "suspended"

    def resume(d: DaemonProcess) -> str:
        with client(d) as c:
            try:
                return str(c.resume_workspace("shared")["live_sandbox_id"])
            except hutch.InvalidState as exc:
                assert "already running" in str(exc), exc
                return "refused"

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        resumed = sorted(set(pool.map(resume, [fleet[2], fleet[0]])) - {"refused"})
    assert len(resumed) == 1, resumed
    for d in fleet:
        assert listed_ids(d) == resumed


def wait_for(what: str, check: object, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while True:
        try:
            if check():  # type: ignore[operator]
                return
        except hutch.HutchError:
            pass
        if time.monotonic() > deadline:
            pytest.fail(f"not within {seconds} s: {what}")
        time.sleep(0.2)


def test_a_killed_daemon_s_sandboxes_are_taken_over_or_failed(
    fleet: list[DaemonProcess],
) -> None:
    dead, live = fleet[0], fleet[1]
    with client(dead) as c:
        docker_sb = c.create_sandbox("docker", image=TEST_IMAGE)
        docker_sb.write_text("kept.txt", "intact")
        local_sb = c.create_sandbox("local", read_before_write=False)
        bwrap_sb = c.create_sandbox("bubblewrap", image=TEST_IMAGE, read_before_write=False)
        bwrap_sb.write_text("written.txt", "before the kill")
    assert sandbox_processes(bwrap_sb.id)
    dead.kill()
    killed_at = time.monotonic()

    def served_by_live() -> bool:
        with client(live) as c:
            return c.get_sandbox(docker_sb.id).read_text("kept.txt") == "intact"

    wait_for("the docker sandbox served by a live daemon", served_by_live, 60)
    # Not a timed assertion of the budget (bench/ measures it): the lease
    # must at least have lapsed first.
    assert time.monotonic() - killed_at >= LEASE_SECONDS - 1

    def host_bound_failed() -> bool:
        # Those only the dead host could reach (local, bubblewrap): failed, once each.
        with client(live) as c:
            listed = c.list_sandboxes(include_ended=True)
        for sandbox_id in (local_sb.id, bwrap_sb.id):
            rows = [s for s in listed if s["id"] == sandbox_id]
            assert len(rows) == 1, rows
            if not (rows[0]["state"] == "failed" and rows[0]["reason"] == "its host is gone"):
                return False
        return True

    wait_for("the local and bubblewrap sandboxes recorded failed", host_bound_failed, 60)
    # Nothing listed twice or lost while the dead one is down.
    for d in fleet[1:]:
        assert listed_ids(d) == [docker_sb.id]
    # The killed daemon back: it serves nothing it lost, lists each sandbox
    # once, and what it is asked of the taken-over sandbox goes to the new owner.
    dead.start()
    # Its bubblewrap sandbox, recorded failed while its host was gone, still
    # ran there: the host's daemon, back, ends what it runs (failed says
    # ended), keeping what it wrote on the host.
    wait_for("the failed bubblewrap sandbox's processes ended",
             lambda: not sandbox_processes(bwrap_sb.id), 30)
    kept = glob.glob(os.path.join(dead.data_dir, "bubblewrap", "sandboxes", bwrap_sb.id, "**",
                                  "written.txt"), recursive=True)
    assert [pathlib.Path(path).read_text(encoding="utf-8") for path in kept] == [
        "before the kill"]
    # Told once: a later start finds nothing of it running (its files stay).
    dead.restart()
    with client(dead) as c:
        ended = [e for e in c.events(bwrap_sb.id) if "ended what it ran" in e["message"]]
    assert len(ended) == 1, ended
    for d in fleet:
        assert listed_ids(d) == [docker_sb.id]
    with client(dead) as c:
        sb = c.get_sandbox(docker_sb.id)
        assert sb.exec("cat kept.txt").stdout == "intact"
        sb.write_text("after.txt", "x")
    with client(fleet[2]) as c:
        assert c.get_sandbox(docker_sb.id).read_text("after.txt") == "x"


def test_a_killed_daemon_s_paused_sandbox_is_taken_over_paused(
    fleet: list[DaemonProcess],
) -> None:
    """A paused sandbox taken over from a killed daemon is said paused by
    its new owner, refuses calls as a paused one does, and resumes."""
    dead, live = fleet[0], fleet[1]
    with client(dead) as c:
        sb = c.create_sandbox("docker", image=TEST_IMAGE)
        sb.write_text("kept.txt", "intact")
        sb.pause()
    dead.kill()

    def taken_over_paused() -> bool:
        with client(live) as c:
            return c.get_sandbox(sb.id).status().state is hutch.SandboxState.PAUSED

    wait_for("the paused sandbox served by a live daemon", taken_over_paused, 60)
    with client(live) as c:
        held = c.get_sandbox(sb.id)
        with pytest.raises(hutch.SandboxUnavailable, match="paused"):
            held.exec("echo no")
        held.resume()
        assert held.status().state is hutch.SandboxState.RUNNING
        assert held.exec("cat kept.txt").stdout == "intact"


def test_a_stalled_daemon_s_late_writes_are_refused(fleet: list[DaemonProcess]) -> None:
    """A daemon stopped (SIGSTOP) past its lease comes back to find its
    sandbox taken over: what it then tries of it is refused or sent to the
    new owner, and it stops serving it itself."""
    stalled, live = fleet[0], fleet[1]
    with client(stalled) as c:
        sb = c.create_sandbox("docker", image=TEST_IMAGE)
        sb.write_text("kept.txt", "intact")
    assert stalled.proc is not None
    os.kill(stalled.proc.pid, signal.SIGSTOP)
    try:
        def taken_over() -> bool:
            with client(live) as c:
                return c.get_sandbox(sb.id).read_text("kept.txt") == "intact"

        wait_for("taken over", taken_over, 60)
    finally:
        os.kill(stalled.proc.pid, signal.SIGCONT)
    with client(stalled) as c:
        try:
            c.get_sandbox(sb.id).pause()  # its late write, if it still held the sandbox
        except hutch.StoreUnavailable as exc:
            assert "served by daemon" in str(exc) or "lapsed" in str(exc), exc
    with client(live) as c:
        c.get_sandbox(sb.id).resume() if c.get_sandbox(sb.id).state.value == "paused" else None
    def stalled_forwards() -> bool:
        with client(stalled) as c:
            return c.get_sandbox(sb.id).exec("cat kept.txt").stdout == "intact"

    wait_for("the stalled daemon sends its requests to the owner", stalled_forwards, 30)
    for d in fleet:
        assert listed_ids(d) == [sb.id]


@pytest.mark.docker
def test_a_killed_daemon_s_e2b_sandboxes_are_taken_over(
    postgres_cluster: postgres_fixture.PostgresCluster,
) -> None:
    """A remote provider's sandboxes (E2B's, here a second ``hutch serve``
    standing in for its service) are reachable from any daemon that has the
    service's key: a live daemon takes them over, files intact, rather than
    recording them failed with the dead one's host."""
    from hutch._e2bkey import e2b_key

    standin = DaemonProcess(provider="docker").start()
    store = postgres_cluster.url(postgres_cluster.new_database())
    env = {"E2B_API_URL": standin.url, "E2B_SANDBOX_URL": standin.url,
           "E2B_API_KEY": e2b_key(standin.token), "HUTCH_STORE": store,
           "HUTCH_FLEET_LEASE_SECONDS": str(LEASE_SECONDS)}
    dead, live = (DaemonProcess(provider="e2b", extra_env=env) for _ in range(2))
    try:
        dead.start()
        live.start()
        with client(dead) as c:
            sb = c.create_sandbox("e2b", template=TEST_IMAGE, read_before_write=False)
            sb.write_text("kept.txt", "intact")
        dead.kill()

        def served_by_live() -> bool:
            with client(live) as c:
                return c.get_sandbox(sb.id).read_text("kept.txt") == "intact"

        wait_for("the e2b sandbox served by the live daemon", served_by_live, 60)
        with client(live) as c:
            info = c.get_sandbox(sb.id).status()
            assert info.state.value == "running", info
            c.get_sandbox(sb.id).close()
        with client(standin) as c:
            assert c.list_sandboxes() == []  # the one E2B sandbox, ended by its new owner
    finally:
        for d in (dead, live, standin):
            d.close()
