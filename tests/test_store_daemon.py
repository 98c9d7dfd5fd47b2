"""A daemon's store: SQLite in its data directory, or PostgreSQL by
``--store`` / ``HUTCH_STORE`` / ``[server] store``. One daemon serves an
SQLite store at a time (a second is refused, never adopts the first one's
sandboxes); several share a PostgreSQL one (a fleet: tests/test_fleet.py),
none adopting another's sandboxes."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import hutch
from tests import postgres_fixture
from tests.daemon_fixture import DaemonProcess, free_port


def _refused(d: DaemonProcess) -> str:
    with pytest.raises(RuntimeError, match="exited at start") as caught:
        d.start(timeout=60)
    return str(caught.value)


def test_a_second_daemon_on_one_data_dir_is_refused_until_the_first_is_gone() -> None:
    first = DaemonProcess().start()
    second = DaemonProcess(first.data_dir)
    try:
        with hutch.Client(first.url, token=first.token) as c:
            sandbox_id = c.create_sandbox("local", read_before_write=False).id
        said = _refused(second)
        assert "another daemon" in said and "serves this store" in said, said
        with hutch.Client(first.url, token=first.token) as c:
            assert [s["id"] for s in c.list_sandboxes()] == [sandbox_id]
        first.kill()  # its hold ends with its process
        second.start()
        with hutch.Client(second.url, token=second.token) as c:
            assert [s["id"] for s in c.list_sandboxes()] == [sandbox_id]
    finally:
        second.close()
        first.closed = True  # the same data directory: closed (and removed) by second


def test_a_daemon_on_postgresql_keeps_its_sandboxes_across_restarts(
    postgres_cluster: postgres_fixture.PostgresCluster,
) -> None:
    store = postgres_cluster.url(postgres_cluster.new_database())
    d = DaemonProcess(extra_env={"HUTCH_STORE": store}).start()
    other = DaemonProcess(extra_env={"HUTCH_STORE": store})
    try:
        with hutch.Client(d.url, token=d.token) as c:
            sb = c.create_sandbox("local", read_before_write=False)
            sb.write_text("kept.txt", "on postgresql")
        assert not os.path.exists(os.path.join(d.data_dir, "hutch.db"))
        # Another daemon (its own data directory) on the same database: it
        # lists the first one's sandbox, and leaves it to it.
        other.start()
        with hutch.Client(other.url, token=other.token) as c:
            assert [s["id"] for s in c.list_sandboxes()] == [sb.id]
            assert c.get_sandbox(sb.id).read_text("kept.txt") == "on postgresql"
        other.stop()
        d.stop()
        d.start()
        with hutch.Client(d.url, token=d.token) as c:
            [row] = c.list_sandboxes()
            assert row["id"] == sb.id and row["state"] == "running", row
        d.restart()  # SIGKILL, then start: adopted again
        with hutch.Client(d.url, token=d.token) as c:
            assert [s["id"] for s in c.list_sandboxes()] == [sb.id]
            assert c.get_sandbox(sb.id).read_text("kept.txt") == "on postgresql"
    finally:
        other.close()
        d.close()


@pytest.mark.parametrize(("store", "said"), [
    ("mysql://db/hutch", "postgresql:// URL"),
    ("postgresql://nobody@/nothing?host=/nonexistent-dir&port=1",
     "cannot reach the PostgreSQL store"),
])
def test_a_store_hutch_cannot_use_stops_serve_with_a_clear_error(
    store: str, said: str, tmp_path: os.PathLike[str],
) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "hutch.server", "--port", str(free_port()), "--data-dir",
         os.path.join(tmp_path, "data"), "--store", store],
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert done.returncode != 0
    assert said in done.stderr, done.stderr[-2000:]
    assert "Traceback" not in done.stderr, done.stderr[-2000:]
