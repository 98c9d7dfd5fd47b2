"""The SQLite store's own: WAL and full sync, that a write is durable once it
returns, migrations. What every store keeps is tests/test_store_suite.py's."""

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

from hutch.store import SandboxRow, SQLiteStore


def sandbox_row(sandbox_id: str = "sb-1", state: str = "running") -> SandboxRow:
    return SandboxRow(
        id=sandbox_id, provider="docker", state=state, spec={"provider": {"type": "docker"}},
        description={"container_id": "abc"}, workspace="ws", created_at_unix=1.0,
        deadline_unix=123.5, last_active_unix=99.0, meter={"running_s": 4.0},
    )


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
    # A row from before versions were counted is written on from its first.
    assert old.version == 1
    old.state = "paused"
    store.put_sandbox(old)
    assert old.version == 2
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
