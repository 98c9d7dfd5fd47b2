"""A daemon of a fleet that stalls in the middle of one of its store's
transactions (SIGSTOP, a VM paused, swapped out) holds that transaction's
row locks for as long as it stalls. Its heartbeat locks every row it owns,
so, unbounded, the live daemons' takeover of exactly those rows would wait
on it: the fleet stops serving them until the stalled daemon wakes.

Here the stall is made exact: the stalled daemon (a child process) is
stopped while its heartbeat's transaction holds its sandbox's row, and the
live daemon's takeover must neither wait on that lock nor be kept out
beyond the store's bound on a stalled transaction.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psycopg
import pytest

from hutch.store import SandboxRow, WorkspaceRow
from hutch.store.postgres import STALLED_TRANSACTION_SECONDS, PostgresStore
from tests import postgres_fixture

#: The stalled daemon: it makes its rows, says so, and beats once when told.
STALLED = """
import sys
from hutch.store.postgres import STALLED_TRANSACTION_SECONDS, PostgresStore
store = PostgresStore(sys.argv[1], local_root=sys.argv[2])
store.act_as("d-stalled", 1.0)
print("ready", flush=True)
sys.stdin.readline()
try:
    store.register_daemon("d-stalled", "http://stalled", 1.0)
    print("renewed", flush=True)
except Exception as exc:
    print(type(exc).__name__, flush=True)
"""


def until(what: str, check: object, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not check():  # type: ignore[operator]
        if time.monotonic() > deadline:
            pytest.fail(f"not within {seconds} s: {what}")
        time.sleep(0.02)


def session_state(conninfo: str, pid: int) -> tuple[str | None, str | None]:
    """(state, wait_event_type) of the server's session ``pid``."""
    with psycopg.connect(conninfo, autocommit=True) as conn:
        found = conn.execute("SELECT state, wait_event_type FROM pg_stat_activity "
                             "WHERE pid = %s", (pid,)).fetchone()
    return (None, None) if found is None else (found[0], found[1])


def test_a_daemon_stalled_inside_its_heartbeat_keeps_nothing_from_the_fleet(
    postgres_cluster: postgres_fixture.PostgresCluster, tmp_path: Path,
) -> None:
    conninfo = postgres_cluster.new_database()
    maker = PostgresStore(conninfo, local_root=str(tmp_path / "maker"))
    maker.act_as("d-stalled", 1.0)
    maker.put_sandbox(SandboxRow(id="sb-1", provider="docker", state="running", spec={},
                                 description={}, created_at_unix=1.0))
    maker.put_workspace(WorkspaceRow(name="w", status="running", provider="docker", spec={}))
    maker.close()
    live = PostgresStore(conninfo, local_root=str(tmp_path / "live"))
    live.act_as("d-live", 30)
    # A lock of the workspace's row holds the stalled daemon's heartbeat
    # inside its transaction, past its lock of the sandbox's row.
    holder = psycopg.connect(conninfo)
    holder.execute("SELECT name FROM workspaces WHERE name = 'w' FOR UPDATE")
    child = subprocess.Popen(
        [sys.executable, "-c", STALLED, conninfo, str(tmp_path / "stalled")],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent / "src")},
    )
    taker: threading.Thread | None = None
    try:
        assert child.stdin is not None and child.stdout is not None
        assert child.stdout.readline().strip() == "ready"
        child.stdin.write("\n")
        child.stdin.flush()

        def waiting_sessions() -> list[int]:
            with psycopg.connect(conninfo, autocommit=True) as conn:
                return [r[0] for r in conn.execute(
                    "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
                    "AND wait_event_type = 'Lock'")]

        until("the stalled daemon's heartbeat waits on the workspace's row",
              lambda: len(waiting_sessions()) == 1, 20)
        stalled_session = waiting_sessions()[0]
        os.kill(child.pid, signal.SIGSTOP)
        holder.rollback()  # its update goes through; then it is stopped mid-transaction
        until("the stalled daemon's session idles in its transaction",
              lambda: session_state(conninfo, stalled_session)[0] == "idle in transaction", 10)
        stalled_at = time.monotonic()
        until("the stalled daemon's lease lapses, as the others see it",
              lambda: [r.id for r in live.lapsed_sandboxes()] == ["sb-1"], 10)

        # The live daemon's look for lapsed rows, as its fleet loop makes it.
        calls: list[tuple[float, bool]] = []
        taken_workspaces: list[str] = []

        def take_over() -> None:
            while True:
                started = time.monotonic()
                taken = live.take_over("sandbox", "sb-1")
                taken_workspaces.extend(live.take_over_lapsed("workspace"))
                calls.append((time.monotonic() - started, taken))
                if taken or time.monotonic() - stalled_at > 30:
                    return
                time.sleep(0.1)

        taker = threading.Thread(target=take_over, daemon=True)
        taker.start()
        taker.join(STALLED_TRANSACTION_SECONDS + 10)
        assert not taker.is_alive(), (
            "the live daemon's takeover waited on the stalled daemon's lock")
        assert calls and calls[-1][1], "the sandbox was never taken over"
        # Each look answered at once: none waited on the stalled lock.
        assert max(took for took, _ in calls) < 1.0, calls
        assert time.monotonic() - stalled_at < STALLED_TRANSACTION_SECONDS + 5
        assert taken_workspaces == ["w"]
        sandbox = live.get_sandbox("sb-1")
        assert sandbox is not None and (sandbox.owner, sandbox.epoch) == ("d-live", 2)
        # The stalled daemon wakes: its heartbeat is not committed late.
        os.kill(child.pid, signal.SIGCONT)
        answer = child.stdout.readline().strip()
        assert answer == "StoreUnavailable", answer
        after = live.get_sandbox("sb-1")
        assert after is not None and after.owner == "d-live"
        assert [d.id for d in live.daemons() if d.alive] == []
    finally:
        os.kill(child.pid, signal.SIGKILL)
        os.kill(child.pid, signal.SIGCONT)
        child.wait(10)
        holder.close()
        if taker is not None:
            taker.join(10)
        live.close()
