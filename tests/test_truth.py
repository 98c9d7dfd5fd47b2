"""Truth and no loss (issue 7): what the daemon says is what happened.

Every test here runs a real daemon process (tests/daemon_fixture.py); the
docker ones a real Docker Engine.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

import pytest

import hutch
from tests.daemon_fixture import DaemonProcess

HUTCH = [sys.executable, "-m", "hutch.cli.main"]


@pytest.fixture
def daemon() -> Iterator[DaemonProcess]:
    d = DaemonProcess().start()
    yield d
    d.stop()
    shutil.rmtree(d.data_dir, ignore_errors=True)


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
    assert expired.id in listing.stdout and "max_lifetime_exceeded" in listing.stdout
    assert expired.id not in cli(daemon, "ls").stdout
    told = cli(daemon, "events", expired.id)
    assert told.returncode == 0, told.stderr
    assert "running -> terminated (max_lifetime_exceeded)" in told.stdout
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
        d.stop()
        shutil.rmtree(d.data_dir, ignore_errors=True)
        shutil.rmtree(workdir, ignore_errors=True)
