"""A hypothesis state machine over a real daemon on a real Docker Engine.

Random sequences of create, exec, file writes, pause, suspend, resume,
set_timeout, delete, a daemon SIGKILL + restart and a container removed from
outside, driven through the SDK. After every step the daemon's answers, its
store (the SQLite file, read from outside) and the Docker Engine agree with a
model of what must be true, and no file written to a live sandbox is lost.

Bounded: a handful of short runs (well under 3 minutes here).
"""

from __future__ import annotations

import contextlib
import sqlite3
import time

import docker
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

import hutch
from tests.conftest import TEST_IMAGE
from tests.daemon_fixture import DaemonProcess

LIVE = ("running", "paused", "suspended")
#: Where a written file lives: the bind-mounted working directory, or the
#: container's own layer (which a suspend must carry over).
PLACES = ("/workspace", "/root")


class Truth(RuleBasedStateMachine):
    sandboxes = Bundle("sandboxes")

    def __init__(self) -> None:
        super().__init__()
        self.daemon = DaemonProcess().start()
        self.client = hutch.Client(self.daemon.url, token=self.daemon.token)
        self.api = docker.APIClient()
        #: sandbox id -> the state it must be in.
        self.state: dict[str, str] = {}
        #: sandbox id -> {path: content} written and acknowledged.
        self.files: dict[str, dict[str, str]] = {}
        self.handles: dict[str, hutch.RemoteSandbox] = {}
        self.writes = 0
        self.steps_since_restart = 0

    # -- the steps ------------------------------------------------------------------
    @initialize(target=sandboxes)
    def first(self) -> str:
        return self.create()

    @precondition(lambda self: sum(s in LIVE for s in self.state.values()) < 3)
    @rule(target=sandboxes)
    def create(self) -> str:
        sb = self.client.create_sandbox("docker", image=TEST_IMAGE)
        self.state[sb.id], self.files[sb.id], self.handles[sb.id] = "running", {}, sb
        return sb.id

    @rule(sandbox_id=sandboxes, where=st.sampled_from(PLACES))
    def write_and_exec(self, sandbox_id: str, where: str) -> None:
        sb, state = self.handles[sandbox_id], self.state[sandbox_id]
        self.writes += 1
        path, content = f"{where}/note-{self.writes}.txt", f"written {self.writes}"
        if state in ("running", "suspended"):  # a suspended one resumes on the call
            sb.write_text(path, content)
            self.files[sandbox_id][path] = content
            self.state[sandbox_id] = "running"
            assert sb.exec(["cat", path]).stdout == content
        else:
            with pytest.raises(hutch.SandboxUnavailable):
                sb.write_text(path, content)

    @rule(sandbox_id=sandboxes)
    def pause(self, sandbox_id: str) -> None:
        self.lifecycle(sandbox_id, "pause", {"running": "paused"})

    @rule(sandbox_id=sandboxes)
    def suspend(self, sandbox_id: str) -> None:
        self.lifecycle(sandbox_id, "suspend", {"running": "suspended"})

    @rule(sandbox_id=sandboxes)
    def resume(self, sandbox_id: str) -> None:
        self.lifecycle(sandbox_id, "resume", {"paused": "running", "suspended": "running"})

    def lifecycle(self, sandbox_id: str, action: str, moves: dict[str, str]) -> None:
        sb, state = self.handles[sandbox_id], self.state[sandbox_id]
        if state in moves:
            getattr(sb, action)()
            self.state[sandbox_id] = moves[state]
        elif state in LIVE:
            with pytest.raises(hutch.InvalidState):
                getattr(sb, action)()
        else:
            with pytest.raises(hutch.SandboxUnavailable):
                getattr(sb, action)()

    @rule(sandbox_id=sandboxes, seconds=st.integers(600, 3600))
    def set_timeout(self, sandbox_id: str, seconds: int) -> None:
        sb = self.handles[sandbox_id]
        if self.state[sandbox_id] in LIVE:
            before = time.time()
            deadline = sb.set_timeout(seconds)
            assert before + seconds - 1 <= deadline <= time.time() + seconds + 1
        else:
            with pytest.raises(hutch.SandboxUnavailable):
                sb.set_timeout(seconds)

    @rule(sandbox_id=sandboxes)
    def delete(self, sandbox_id: str) -> None:
        self.handles[sandbox_id].close()  # ending what ended already succeeds too
        if self.state[sandbox_id] in LIVE:
            self.state[sandbox_id] = "terminated"

    # At most every third step: a restart costs seconds, and the steps between
    # restarts are what a restart must keep.
    @precondition(lambda self: self.steps_since_restart >= 3
                  and any(s in LIVE for s in self.state.values()))
    @rule()
    def crash_and_restart(self) -> None:
        self.daemon.restart()
        self.steps_since_restart = 0

    @precondition(lambda self: any(s in ("running", "paused") for s in self.state.values()))
    @rule(data=st.data())
    def remove_container_outside(self, data: st.DataObject) -> None:
        candidates = sorted(k for k, s in self.state.items() if s in ("running", "paused"))
        sandbox_id = data.draw(st.sampled_from(candidates))
        for container in self.containers(sandbox_id):
            self.api.remove_container(container["Id"], force=True)
        self.state[sandbox_id] = "failed"
        deadline = time.monotonic() + 8  # 5 s is the promise; margin for a loaded machine
        while self.client.get_sandbox(sandbox_id).info()["state"] != "failed":
            assert time.monotonic() < deadline, f"{sandbox_id} not failed within 8 s"
            time.sleep(0.2)

    # -- what must hold after every step --------------------------------------------------
    def containers(self, sandbox_id: str) -> list[dict[str, object]]:
        return list(self.api.containers(
            all=True, filters={"label": f"hutch.sandbox_id={sandbox_id}"}
        ))

    def stored(self, sandbox_id: str) -> str:
        uri = f"file:{self.daemon.data_dir}/hutch.db?mode=ro"
        with contextlib.closing(sqlite3.connect(uri, uri=True)) as db:
            row = db.execute("SELECT state FROM sandboxes WHERE id = ?", (sandbox_id,)).fetchone()
        return str(row[0]) if row else "missing"

    @invariant()
    def daemon_store_and_engine_agree(self) -> None:
        self.steps_since_restart += 1
        answered = {s["id"]: s["state"]
                    for s in self.client.list_sandboxes(include_ended=True)}
        for sandbox_id, state in self.state.items():
            assert answered.get(sandbox_id) == state, (sandbox_id, state, answered)
            assert self.stored(sandbox_id) == state, (sandbox_id, state)
            containers = self.containers(sandbox_id)
            if state in ("running", "paused"):
                assert len(containers) == 1, (sandbox_id, state, containers)
                details = self.api.inspect_container(containers[0]["Id"])["State"]
                assert details["Running"] and details["Paused"] == (state == "paused"), details
            else:
                assert not containers, (sandbox_id, state, containers)
        live = {k for k, s in answered.items() if s in LIVE}
        assert live == {k for k, s in self.state.items() if s in LIVE}

    @invariant()
    def no_acknowledged_write_is_lost(self) -> None:
        for sandbox_id, state in self.state.items():
            if state != "running" or not self.files[sandbox_id]:
                continue
            paths = sorted(self.files[sandbox_id])
            shown = self.handles[sandbox_id].exec(
                ["sh", "-c", 'for f; do printf "%s\\0" "$(cat "$f")"; done', "sh", *paths]
            ).stdout.split("\0")[:-1]
            assert dict(zip(paths, shown, strict=True)) == self.files[sandbox_id]

    def teardown(self) -> None:
        try:
            # The last word: every live sandbox brought back still has every file.
            for sandbox_id, state in self.state.items():
                if state in ("paused", "suspended"):
                    self.handles[sandbox_id].resume()
                    self.state[sandbox_id] = "running"
            self.no_acknowledged_write_is_lost()
            for sb in self.handles.values():
                sb.close()
        finally:
            self.client.close()
            self.daemon.close()  # with what a failed example left


TestTruth = pytest.mark.docker(Truth.TestCase)
Truth.TestCase.settings = settings(
    max_examples=6, stateful_step_count=12, deadline=None, database=None,
    suppress_health_check=list(HealthCheck), print_blob=True,
)
