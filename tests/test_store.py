"""The SQLite store: what it keeps, that a write is durable once it returns, migrations."""

from __future__ import annotations

import multiprocessing
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

from hutch.store import SandboxRow, SnapshotRow, SQLiteStore, WorkspaceRow


def sandbox_row(sandbox_id: str = "sb-1", state: str = "running") -> SandboxRow:
    return SandboxRow(
        id=sandbox_id, provider="docker", state=state, spec={"provider": {"type": "docker"}},
        description={"container_id": "abc"}, workspace="ws", created_at_unix=1.0,
        deadline_unix=123.5, last_active_unix=99.0, meter={"running_s": 4.0},
    )


def test_rows_round_trip(tmp_path: Path) -> None:
    store = SQLiteStore(str(tmp_path / "hutch.db"))
    store.put_sandbox(sandbox_row())
    store.put_sandbox(sandbox_row("sb-2", state="terminated"))
    got = store.get_sandbox("sb-1")
    assert got is not None
    assert (got.description, got.deadline_unix, got.meter) == (
        {"container_id": "abc"}, 123.5, {"running_s": 4.0}
    )
    assert got.updated_at_unix > 0
    assert [r.id for r in store.list_sandboxes()] == ["sb-1"]
    assert {r.id for r in store.list_sandboxes(include_final=True)} == {"sb-1", "sb-2"}

    before = got.updated_at_unix
    store.set_sandbox_deadline("sb-1", 456.0)
    again = store.get_sandbox("sb-1")
    assert again is not None and again.deadline_unix == 456.0
    assert again.updated_at_unix == before, "a deadline is not a snapshot of the meter"

    rows = [sandbox_row(f"sb-batch-{i}") for i in range(50)]
    store.put_sandboxes(rows)
    assert len(store.list_sandboxes()) == 51

    ws = WorkspaceRow(name="ws", status="running", provider="docker", spec={"a": 1},
                      live_sandbox_id="sb-1", state_snapshot_id="snap-2",
                      source_snapshot_id="snap-1")
    store.put_workspace(ws)
    assert store.get_workspace("ws") == ws
    store.delete_workspace("ws")
    assert store.get_workspace("ws") is None

    for i in range(5):
        store.log_event("sb-1", "transition", f"step {i}")
    store.log_event("other", "orphan", "removed")
    assert [e["message"] for e in store.events("sb-1", limit=2)] == ["step 3", "step 4"]
    assert store.events(limit=1)[0]["subject"] == "other"

    store.set_meta("k", "v")
    assert store.get_meta("k") == "v"
    store.set_meta("k", None)
    assert store.get_meta("k") is None
    store.close()


def test_snapshot_rows_round_trip_with_lineage(tmp_path: Path) -> None:
    store = SQLiteStore(str(tmp_path / "hutch.db"))
    root = SnapshotRow(
        id="snap-a", provider="local", status="ready", label="setup", sandbox_id="sb-1",
        size_bytes=42, created_at_unix=1.0, handle={"data": {"layers": ["x"]}},
        spec={"provider": {"type": "local"}},
    )
    child = SnapshotRow(id="snap-b", provider="local", status="capturing", parent_id="snap-a",
                        created_at_unix=2.0)
    store.put_snapshot(child)
    store.put_snapshot(root)
    assert store.get_snapshot("snap-a") == root
    assert [r.id for r in store.list_snapshots()] == ["snap-a", "snap-b"]
    child.status = "ready"
    store.put_snapshot(child)
    got = store.get_snapshot("snap-b")
    assert got is not None and (got.status, got.parent_id) == ("ready", "snap-a")
    store.delete_snapshot("snap-a")
    assert store.get_snapshot("snap-a") is None
    store.close()
    reopened = SQLiteStore(str(tmp_path / "hutch.db"))
    assert [r.id for r in reopened.list_snapshots()] == ["snap-b"]
    reopened.close()


def test_wal_and_full_sync(tmp_path: Path) -> None:
    store = SQLiteStore(str(tmp_path / "hutch.db"))
    store.close()
    db = sqlite3.connect(tmp_path / "hutch.db")
    assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    db.close()
    # synchronous is per connection: check the store's own.
    store = SQLiteStore(str(tmp_path / "hutch.db"))
    assert store._db.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL
    store.close()


def test_a_write_that_returned_survives_sigkill(tmp_path: Path) -> None:
    path = tmp_path / "hutch.db"
    child = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import sys, time
            from hutch.store import SandboxRow, SQLiteStore
            store = SQLiteStore({str(path)!r})
            for i in range(20):
                store.put_sandbox(SandboxRow(id=f"sb-{{i}}", provider="local",
                                             state="running", spec={{}}))
                print(i, flush=True)
            time.sleep(60)
        """)],
        stdout=subprocess.PIPE, text=True,
    )
    assert child.stdout is not None
    acknowledged = -1
    deadline = time.monotonic() + 30
    while acknowledged < 10 and time.monotonic() < deadline:
        acknowledged = int(child.stdout.readline())
    os.kill(child.pid, signal.SIGKILL)  # no close, no checkpoint: as in a crash
    child.wait(10)
    store = SQLiteStore(str(path))
    ids = {r.id for r in store.list_sandboxes()}
    assert {f"sb-{i}" for i in range(acknowledged + 1)} <= ids
    store.close()


def test_an_older_data_dir_is_migrated(tmp_path: Path) -> None:
    path = tmp_path / "hutch.db"
    db = sqlite3.connect(path)
    db.execute(
        "CREATE TABLE sandboxes (id TEXT PRIMARY KEY, provider TEXT NOT NULL, "
        "state TEXT NOT NULL, reason TEXT, workspace TEXT, spec TEXT NOT NULL, "
        "description TEXT NOT NULL, created_at_unix REAL NOT NULL, "
        "updated_at_unix REAL NOT NULL)"
    )
    db.execute("INSERT INTO sandboxes VALUES ('sb-old', 'local', 'running', NULL, NULL, "
               "'{}', '{}', 1.0, 2.0)")
    db.commit()
    db.close()
    store = SQLiteStore(str(path))
    old = store.get_sandbox("sb-old")
    assert old is not None and old.meter == {} and old.deadline_unix is None
    store.put_sandbox(sandbox_row())
    assert store.get_sandbox("sb-1") is not None
    store.close()


def _open_store_when_told(path: str, go: Any, failures: Any) -> None:
    go.wait()
    try:
        SQLiteStore(path).close()
    except Exception as exc:  # reported to the test, which fails on it
        failures.put(repr(exc))


def test_processes_opening_one_new_store_at_once_all_succeed(tmp_path: Path) -> None:
    """Programs sharing one HUTCH_HOME may open a store nobody has made yet at
    the same moment: each makes the schema and adds missing columns, and none
    fails because another added a column between its look and its change."""
    ctx = multiprocessing.get_context("fork")
    for round_ in range(15):
        path = str(tmp_path / f"round-{round_}" / "hutch.db")
        go, failures = ctx.Event(), ctx.Queue()
        children = [ctx.Process(target=_open_store_when_told, args=(path, go, failures))
                    for _ in range(6)]
        for child in children:
            child.start()
        go.set()
        for child in children:
            child.join(60)
        said = [failures.get() for _ in range(failures.qsize())] if not failures.empty() else []
        assert said == [] and all(c.exitcode == 0 for c in children), said
