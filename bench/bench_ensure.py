"""Sandbox definitions: ``ensure`` cold vs resumed vs restored, on local and
docker, beside the raw floors, measured alternately in one run.

The definition: a small git repository served as file:// and one setup step.

- cold (``created``): create, fetch, setup, snapshot, record. Floor: the same
  setup by hand in a fresh sandbox (``create_sandbox``, the source fetched,
  the setup command run), no snapshot, no store.
- restored: the thread's sandbox was deleted; ensure starts one from the
  setup snapshot. Floor: an attach from the same snapshot
  (``create_sandbox_from_snapshot``).
- resumed: the thread's sandbox is live; ensure finds it. Floor: one
  ``exec(["true"])`` in it (the cheapest thing a caller then does).
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

sys.path.insert(0, os.path.dirname(__file__))

import hutch
from _common import header, row, run, scratch_dir, turn
from hutch._paths import hutch_home
from hutch._types import ProviderSnapshot, Snapshot
from hutch.definitions import Definition, Definitions, LocalHost
from hutch.definitions.ensure import fetch_source
from hutch.store import SnapshotRow, SQLiteStore

RUNS = int(os.environ.get("HUTCH_BENCH_RUNS", "5"))
IMAGE = os.environ.get("HUTCH_TEST_IMAGE", "hutch-test:bookworm")
SETUP = "echo ran >> .setup-runs"


def make_repo(root: str) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "b", "GIT_AUTHOR_EMAIL": "b@b",
           "GIT_COMMITTER_NAME": "b", "GIT_COMMITTER_EMAIL": "b@b"}
    subprocess.run(["git", "init", "-q", "-b", "main", root], check=True, env=env)
    for i in range(50):
        with open(os.path.join(root, f"file{i}.py"), "w") as fh:
            fh.write(f"print({i})\n" * 20)
    subprocess.run(["git", "-C", root, "add", "."], check=True, env=env)
    subprocess.run(["git", "-C", root, "commit", "-q", "-m", "one"], check=True, env=env)
    return f"file://{root}"


async def alternate(
    ours: Callable[[], Awaitable[float]], floor: Callable[[], Awaitable[float]], runs: int
) -> tuple[float, float]:
    """Median ms of ours and the floor, alternately, after one warm-up each;
    each returns the seconds of the part it measures (set-up outside it)."""
    await ours()
    await floor()
    a, b = [], []
    for _ in range(runs):
        turn()
        b.append(await floor())
        a.append(await ours())
    return statistics.median(a) * 1000, statistics.median(b) * 1000


async def bench(provider: dict[str, Any], repo: str, defs: Definitions) -> None:
    header(f"{provider['type']}: ensure (a 50-file git repository, one setup step)")
    d = Definition.parse({"id": f"bench-{provider['type']}", "provider": provider,
                          "workspace": {"source": {"git": repo}, "setup": [SETUP]}})
    async def cold() -> float:
        t = time.perf_counter()
        ensured = await defs.ensure(d, uuid.uuid4().hex)
        took = time.perf_counter() - t
        await ensured.sandbox.close()
        return took

    async def cold_floor() -> float:
        t = time.perf_counter()
        sandbox = await hutch.create_sandbox(spec=d.spec())
        await fetch_source(sandbox, d.workspace.source)  # type: ignore[arg-type]
        result = await sandbox.exec(SETUP)
        took = time.perf_counter() - t
        assert result.exit_code == 0
        await sandbox.close()
        return took

    ours, base = await alternate(cold, cold_floor, RUNS)
    row("cold: create+fetch+setup+snapshot", ours, base)

    thread = uuid.uuid4().hex
    first = await defs.ensure(d, thread)
    snapshot_id = first.snapshot_id
    await first.sandbox.close()

    async def restored() -> float:
        t = time.perf_counter()
        ensured = await defs.ensure(d, thread)
        took = time.perf_counter() - t
        assert ensured.path == "restored"
        await ensured.sandbox.close()
        return took

    row_snapshot = defs.host.store.get_snapshot(snapshot_id or "")
    assert row_snapshot is not None

    snap = snapshot_of(row_snapshot)

    async def attach_floor() -> float:
        t = time.perf_counter()
        sandbox = await hutch.create_sandbox_from_snapshot(snap)
        took = time.perf_counter() - t
        await sandbox.close()
        return took

    ours, base = await alternate(restored, attach_floor, RUNS)
    row("restored (vs attach from the snapshot)", ours, base)

    live = await defs.ensure(d, thread)

    async def resumed() -> float:
        t = time.perf_counter()
        ensured = await defs.ensure(d, thread)
        took = time.perf_counter() - t
        assert ensured.path == "resumed"
        return took

    async def exec_floor() -> float:
        t = time.perf_counter()
        await live.sandbox.exec(["true"])
        return time.perf_counter() - t

    ours, base = await alternate(resumed, exec_floor, RUNS * 4)
    row("resumed (vs one exec in it)", ours, base)
    await live.sandbox.close()


def snapshot_of(row: SnapshotRow) -> Snapshot:
    return Snapshot(
        id=row.id, label=row.label, sandbox_id=row.sandbox_id, parent_id=row.parent_id,
        size_bytes=row.size_bytes, created_at_unix=row.created_at_unix, provider=row.provider,
        handle=ProviderSnapshot.from_dict(row.handle), spec=row.spec,
    )


async def main() -> None:
    scratch = scratch_dir("hutch-bench-ensure-")
    repo = make_repo(os.path.join(scratch, "repo"))
    store = SQLiteStore(os.path.join(hutch_home(), "hutch.db"))
    defs = Definitions(LocalHost(store))
    try:
        await bench({"type": "local"}, repo, defs)
        await bench({"type": "docker", "image": IMAGE}, repo, defs)
    finally:
        # The snapshots' storage (docker's images among it) is not the home's alone.
        for snapshot in store.list_snapshots():
            await hutch.remove_snapshot(snapshot_of(snapshot))
        store.close()


if __name__ == "__main__":
    run(main)
