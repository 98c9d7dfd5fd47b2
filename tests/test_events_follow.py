"""`hutch events -f` and Client.follow_events: the event log followed live,
across all sandboxes or one, fed by the daemon's own writes."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest

import hutch
from tests.daemon_fixture import DaemonProcess

HUTCH = [sys.executable, "-m", "hutch.cli.main"]
#: How long a line may take before the test gives up (a hang guard, not a timing check).
HANG_GUARD_SECONDS = 60


@pytest.fixture(scope="module")
def daemon() -> Iterator[DaemonProcess]:
    d = DaemonProcess().start()
    try:
        yield d
    finally:
        d.close()


class Follower:
    """`hutch events ... -f --json` running, its lines read as they come."""

    def __init__(self, d: DaemonProcess, *args: str) -> None:
        env = dict(os.environ, HUTCH_URL=d.url, HUTCH_TOKEN=d.token)
        self.proc = subprocess.Popen([*HUTCH, "events", *args, "-f", "--json"], env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     stdin=subprocess.DEVNULL, text=True)
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)

    def until(self, subject: str, kind: str, message: str = "") -> list[dict[str, object]]:
        """The events read up to the first of ``subject`` of ``kind`` (saying ``message``)."""
        seen = []
        while True:
            try:
                event = json.loads(self.lines.get(timeout=HANG_GUARD_SECONDS))
            except queue.Empty:
                self.proc.terminate()
                self.proc.wait(timeout=30)
                said = self.proc.stderr.read() if self.proc.stderr else ""
                raise AssertionError(
                    f"no {kind} event of {subject}; saw {seen}; stderr: {said}") from None
            seen.append(event)
            if (event["subject"], event["kind"]) == (subject, kind) and message in str(
                    event["message"]):
                return seen

    def wait_following(self, c: hutch.Client, made: list[str]) -> None:
        """Return once the follow has begun: ``--limit 0`` shows nothing from
        before it, and it begins when its process has connected, which a
        loaded machine delays. Sandboxes are made (their ids go in ``made``,
        for the caller to delete) until one's creation is seen, then read up
        to the last one's: every one made after the follow began is seen."""
        deadline = time.monotonic() + HANG_GUARD_SECONDS
        while time.monotonic() < deadline:
            made.append(c.create_sandbox("local").id)
            try:
                event = json.loads(self.lines.get(timeout=0.5))
            except queue.Empty:
                continue
            if (event["subject"], event["kind"]) != (made[-1], "created"):
                self.until(made[-1], "created")
            return
        raise AssertionError(f"the follow showed none of {made}")

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)
        for stream in (self.proc.stdout, self.proc.stderr):
            if stream is not None:
                stream.close()


def test_cli_follows_all_sandboxes_or_one(daemon: DaemonProcess) -> None:
    with hutch.Client(daemon.url, token=daemon.token) as c:
        first = c.create_sandbox("local")
        everything = Follower(daemon, "--limit", "0")
        only_first = Follower(daemon, first.id, "--limit", "1")
        probes: list[str] = []
        try:
            # The backlog of one: the first's newest event, from before the follow began.
            backlog = only_first.until(first.id, "created")
            assert [e["subject"] for e in backlog] == [first.id]
            everything.wait_following(c, probes)
            second = c.create_sandbox("local")
            seen = everything.until(second.id, "created")
            # --limit 0: nothing from before the follow, so not the first's creation.
            assert all(e["subject"] == second.id for e in seen), seen
            c.delete_sandbox(second.id)
            everything.until(second.id, "transition", "terminated")
            c.delete_sandbox(first.id)
            seen = only_first.until(first.id, "transition", "terminated")
            # The second's events, written meanwhile, are not the first's follower's.
            assert all(e["subject"] == first.id for e in seen), seen
            everything.until(first.id, "transition", "terminated")
        finally:
            everything.close()
            only_first.close()
            for probe in probes:
                c.delete_sandbox(probe)


def test_client_iterates_the_events_of_a_sandbox(daemon: DaemonProcess) -> None:
    with hutch.Client(daemon.url, token=daemon.token) as c:
        sb = c.create_sandbox("local")
        events = c.follow_events(sb.id, limit=5)
        try:
            backlog = [next(events) for _ in range(2)]  # running, then created
            assert {e["kind"] for e in backlog} == {"transition", "created"}, backlog
            assert {e["subject"] for e in backlog} == {sb.id}
            c.delete_sandbox(sb.id)
            ended = next(events)
            assert (ended["subject"], ended["kind"]) == (sb.id, "transition")
            assert "terminated" in str(ended["message"])
        finally:
            events.close()
