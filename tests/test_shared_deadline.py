"""Two programs holding one thread's sandbox in-process (no daemon): its
time limits are the sandbox's, kept in the store they share, not each
program's own. max_lifetime counts from the sandbox's creation whichever
program finds it later; a set_timeout made in one program is the deadline
of every program's timer; and the expiry is recorded once, by one program,
with the same typed reason for both."""

from __future__ import annotations

import json
import os
import selectors
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from .test_definitions import home  # noqa: F401 - a fixture

#: A program that answers one JSON line per command it reads on stdin.
_PROGRAM = """
import json, logging, sys, time, anyio
from hutch.definitions import Definition, open_definitions
d = Definition.parse(json.loads(sys.argv[1]))
made = []  # the expiries this program's own engine recorded

class Noted(logging.Handler):
    def emit(self, record):
        if "-> terminated" in record.getMessage():
            made.append(record.getMessage())

logging.getLogger("hutch.lifecycle").addHandler(Noted())
logging.getLogger("hutch.lifecycle").setLevel(logging.INFO)

async def main():
    # Opened off the event loop, as a program that checks its loop does.
    definitions = await anyio.to_thread.run_sync(open_definitions)
    store = definitions.host.store
    e = None
    while True:
        # Read off the event loop: the engine's timers run while the program waits.
        command = (await anyio.to_thread.run_sync(sys.stdin.readline)).split() or ["exit"]
        if command[0] == "ensure":
            e = await definitions.ensure(d, "thread-deadline")
            answer = {"path": e.path, "id": e.sandbox.id,
                      "created": e.sandbox.status().created_at_unix}
        elif command[0] == "timeout":
            answer = {"deadline": await e.sandbox.set_timeout(float(command[1]))}
        elif command[0] == "status":
            answer = {"deadline": e.sandbox.status().deadline_unix}
        elif command[0] == "info":
            answer = {"deadline": (await e.sandbox.info())["deadline_unix"]}
        elif command[0] == "read":  # an operation on the sandbox, after a pause
            await anyio.sleep(float(command[1]) if command[1:] else 0)
            try:
                answer = {"read": await e.sandbox.read_text(".setup-runs")}
            except Exception as exc:
                answer = {"read": type(exc).__name__, "error": str(exc)}
        elif command[0] == "wait":  # until the sandbox has ended, then a call on it
            until = time.monotonic() + (float(command[1]) if command[1:] else 60)
            while store.get_instance(e.key).state != "terminated" \\
                    and time.monotonic() < until:
                await anyio.sleep(0.05)
            row = store.get_instance(e.key)
            await anyio.sleep(1.0)  # the other program's timer, due too, has fired
            try:
                await e.sandbox.read_text(".setup-runs")
                after = "ok"
            except Exception as exc:
                after = type(exc).__name__
            answer = {"state": row.state, "ended_at": row.updated_at_unix, "made": made,
                      "after": after}
        else:
            return
        print(json.dumps(answer), flush=True)
anyio.run(main)
"""


class Program:
    """One OS program holding the thread's sandbox, told what to do line by line."""

    def __init__(self, definition: dict[str, Any], env: Mapping[str, str] | None = None) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _PROGRAM, json.dumps(definition)], text=True,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            env=None if env is None else {**os.environ, **env})

    def ask(self, command: str, timeout: float = 120.0) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        with selectors.DefaultSelector() as selector:
            selector.register(self.proc.stdout, selectors.EVENT_READ)
            ready = selector.select(timeout)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            self.end()
            raise AssertionError(f"no answer to {command!r}: {self.stderr()}")
        answer: dict[str, Any] = json.loads(line)
        return answer

    def stderr(self) -> str:
        self.end()
        return self.proc.stderr.read() if self.proc.stderr else ""

    def end(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.close()
                self.proc.wait(timeout=30)
            except (subprocess.TimeoutExpired, BrokenPipeError):
                self.proc.kill()
                self.proc.wait()


def _definition(lifecycle: dict[str, Any]) -> dict[str, Any]:
    return {"id": "deadline", "provider": {"type": "local"},
            "workspace": {"setup": ["echo ran >> .setup-runs"]},
            "lifecycle": {"snapshot": "none", **lifecycle}}


def test_max_lifetime_counts_from_the_sandbox_s_creation_in_every_program(
    home: Path,  # noqa: F811
) -> None:
    """A program that finds the sandbox again seconds after another made it
    ends it at its creation + max_lifetime, not at its own find + max_lifetime."""
    lifetime = 5.0
    maker = Program(_definition({"max_lifetime": lifetime}))
    finder = None
    try:
        made = maker.ask("ensure")
        assert made["path"] == "created"
        maker.end()  # that run is over; its sandbox stays for the thread's next
        while time.time() < made["created"] + 2.5:
            time.sleep(0.05)
        finder = Program(_definition({"max_lifetime": lifetime}))
        found = finder.ask("ensure")
        assert found["path"] == "resumed" and found["id"] == made["id"], found
        assert abs(found["created"] - made["created"]) < 0.01, (found, made)
        ended = finder.ask("wait")
        assert ended["state"] == "terminated", ended
        # At creation + 5 s (and some load), well before find + 5 s (>= creation + 7.5 s).
        assert lifetime - 0.1 <= ended["ended_at"] - made["created"] < lifetime + 2.0, (
            ended, made)
        assert len(ended["made"]) == 1 and "(max_lifetime_exceeded)" in ended["made"][0], ended
        assert ended["after"] == "MaxLifetimeExceeded", ended
    finally:
        for program in (maker, finder):
            if program is not None:
                program.end()


def test_a_deadline_set_in_one_program_is_every_program_s(home: Path) -> None:  # noqa: F811
    """B sets a deadline, A extends it: B's timer, due at the old deadline,
    reads the new one and waits for it; at the new one the sandbox ends once,
    by one program's timer, with timeout_expired for both programs' calls."""
    a, b = Program(_definition({})), None
    try:
        made = a.ask("ensure")
        b = Program(_definition({}))
        assert b.ask("ensure")["path"] == "resumed"
        old = b.ask("timeout 3")["deadline"]
        new = a.ask("timeout 6")["deadline"]
        assert new > old + 2
        ended = [a.ask("wait"), b.ask("wait")]
        assert {e["state"] for e in ended} == {"terminated"}, ended
        assert ended[0]["ended_at"] == ended[1]["ended_at"]
        # Not at B's old deadline: at A's new one (and some load).
        assert new - 0.1 <= ended[0]["ended_at"] < new + 3.0, (ended, old, new, made)
        recorded = ended[0]["made"] + ended[1]["made"]
        assert len(recorded) == 1 and "(timeout_expired)" in recorded[0], ended
        # Whichever program's timer acted, both see the same typed expiry.
        assert [e["after"] for e in ended] == ["TimeoutExpired", "TimeoutExpired"], ended
    finally:
        for program in (a, b):
            if program is not None:
                program.end()


def test_a_program_s_status_shows_the_deadline_another_program_just_set(
    home: Path,  # noqa: F811
) -> None:
    """Status is the truth at once, not after the next timer poll (which
    looks every second): B moves the deadline, later then earlier, and A's
    status says each one as soon as B's call has returned."""
    a, b = Program(_definition({})), None
    try:
        a.ask("ensure")
        b = Program(_definition({}))
        assert b.ask("ensure")["path"] == "resumed"
        for seconds in (600, 300, 900):
            deadline = b.ask(f"timeout {seconds}")["deadline"]
            assert a.ask("status")["deadline"] == pytest.approx(deadline, abs=0.01)
    finally:
        for program in (a, b):
            if program is not None:
                program.end()


def test_a_deadline_set_by_a_program_since_gone_is_kept_by_the_others(
    home: Path,  # noqa: F811
) -> None:
    """A sets a deadline on a sandbox B holds with none, and ends: B's timer
    (armed for nothing) learns the deadline from the store and ends the
    sandbox then, not never."""
    a, b = Program(_definition({})), None
    try:
        a.ask("ensure")
        b = Program(_definition({}))
        assert b.ask("ensure")["path"] == "resumed"
        deadline = a.ask("timeout 2")["deadline"]
        a.end()
        ended = b.ask("wait 20")
        assert ended["state"] == "terminated", ended
        assert deadline - 0.1 <= ended["ended_at"] < deadline + 3.0, (ended, deadline)
        assert len(ended["made"]) == 1 and "(timeout_expired)" in ended["made"][0], ended
        assert ended["after"] == "TimeoutExpired", ended
    finally:
        for program in (a, b):
            if program is not None:
                program.end()


def test_the_store_keeps_the_sandbox_s_limits_and_its_end_s_reason(
    home: Path,  # noqa: F811
) -> None:
    """The instance row carries its sandbox's creation time and deadline
    (the latest set_timeout's, earlier or later) and, once it ended, why."""
    from hutch.store import InstanceRow, SQLiteStore

    store = SQLiteStore(str(home / "hutch.db"))
    try:
        store.put_instance(InstanceRow(key="k", definition_id="d", thread_id="t", tenant=None,
                                       provider="local", sandbox_id="sb-1",
                                       created_at_unix=100.0))
        store.set_instance_deadline("sb-1", 300.0)
        store.set_instance_deadline("sb-1", 200.0)  # a shorter one stands too
        assert store.record_instance_sandbox("sb-1", "terminated", {},
                                             reason="max_lifetime_exceeded")
        found = store.instance_of_sandbox("sb-1")
        assert found is not None
        assert (found.created_at_unix, found.deadline_unix, found.reason) == (
            100.0, 200.0, "max_lifetime_exceeded")
    finally:
        store.close()
