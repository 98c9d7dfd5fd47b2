"""Sandbox definitions through the daemon: the operator's in hutch.toml, a
client's by PUT, ensure/complete over HTTP with the SDK (sync and async) and
the CLI, and the thread's sandbox found again after the daemon restarts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import docker
import httpx
import pytest

import hutch
from hutch.client import EnsureProgress, RemoteEnsured
from hutch.definitions import Definition, SetupFailed, open_definitions
from tests.conftest import TEST_IMAGE
from tests.daemon_fixture import DaemonProcess
from tests.test_definitions import repo  # noqa: F401 - a fixture

SETUP = "echo setup says hello && sleep 2 && echo ran >> .setup-runs"


@pytest.fixture
def daemon(tmp_path: Path, repo: str) -> Iterator[DaemonProcess]:  # noqa: F811
    config = tmp_path / "hutch.toml"
    config.write_text(textwrap.dedent(f"""
        [definitions.repo-agent]
        provider = "local"
        workspace = {{ source = {{ git = "{repo}", ref = "main" }}, setup = ["{SETUP}"] }}
        lifecycle = {{ reuse = "thread", snapshot_max_age = "24h", destroy_on_complete = false }}
    """))
    (tmp_path / "data").mkdir()
    d = DaemonProcess(str(tmp_path / "data"), extra_args=["--config", str(config)]).start()
    try:
        yield d
    finally:
        # Sandboxes and snapshots outlive a daemon's stop by design: end this
        # test's own.
        d.remove_everything()
        d.stop()


def test_ensure_through_the_daemon(daemon: DaemonProcess) -> None:
    with hutch.Client(daemon.url, token=daemon.token) as c:
        listed = c.definitions()
        assert [d["id"] for d in listed] == ["repo-agent"]
        assert listed[0]["lifecycle"]["snapshot_max_age"] == 86400
        first = c.ensure("repo-agent", "thread-1")
        assert first.path == "created"
        assert [s["name"] for s in first.steps] == ["create", "fetch", "setup[0]", "snapshot"]
        assert first.sandbox.read_text(".setup-runs") == "ran\n"
        assert first.sandbox.read_text("README.md") == "second\n"
        second = c.ensure("repo-agent", "thread-1")
        assert second.path == "resumed" and second.sandbox.id == first.sandbox.id
        other = c.ensure("repo-agent", "thread-1", tenant="acme")
        assert other.sandbox.id != first.sandbox.id
        c.delete_sandbox(first.sandbox.id)
        third = c.ensure("repo-agent", "thread-1")
        assert third.path == "restored" and [s["name"] for s in third.steps] == ["restore"]
        assert third.sandbox.read_text(".setup-runs") == "ran\n"
        assert c.complete("repo-agent", "thread-1") is False  # kept for the next run

    # The daemon restarts: the thread's sandbox is found again, not rebuilt.
    daemon.stop()
    daemon.start()
    with hutch.Client(daemon.url, token=daemon.token) as c:
        again = c.ensure("repo-agent", "thread-1")
        assert again.path == "resumed" and again.sandbox.id == third.sandbox.id


@pytest.mark.anyio
async def test_async_client_and_cli(daemon: DaemonProcess) -> None:
    async with hutch.AsyncClient(daemon.url, token=daemon.token) as c:
        made = await c.ensure("repo-agent", "t-async")
        assert made.path == "created"
        assert await made.sandbox.read_text(".setup-runs") == "ran\n"
    env = {**os.environ, "HUTCH_URL": daemon.url, "HUTCH_TOKEN": daemon.token}
    cli = subprocess.run(
        [sys.executable, "-m", "hutch.cli.main", "ensure", "repo-agent", "--thread", "t-async"],
        capture_output=True, text=True, env=env, timeout=120,
    )
    assert cli.returncode == 0, cli.stderr
    assert f"{made.sandbox.id} (resumed)" in cli.stdout and "resume" in cli.stdout
    # A new thread: setup runs, and its output is shown as it comes.
    fresh = subprocess.run(
        [sys.executable, "-m", "hutch.cli.main", "ensure", "repo-agent", "--thread", "t-cli"],
        capture_output=True, text=True, env=env, timeout=120,
    )
    assert fresh.returncode == 0, fresh.stderr
    assert "(created)" in fresh.stdout and "setup[0]" in fresh.stdout
    assert "setup says hello" in fresh.stderr


def test_ensure_stream_tells_steps_and_output(daemon: DaemonProcess) -> None:
    with hutch.Client(daemon.url, token=daemon.token) as c:
        events = list(c.ensure_stream("repo-agent", "t-stream"))
        steps = [e.text for e in events if isinstance(e, EnsureProgress) and e.kind == "step"]
        output = "".join(e.text for e in events
                         if isinstance(e, EnsureProgress) and e.kind == "output")
        assert steps[:2] == ["create", "fetch"] and steps[-1] == "snapshot"
        assert "setup says hello" in output
        result = events[-1]
        assert isinstance(result, RemoteEnsured) and result.path == "created"
        assert result.sandbox.read_text(".setup-runs") == "ran\n"
        with pytest.raises(hutch.NotFound):
            list(c.ensure_stream("no-such-definition", "t"))


def test_put_definition_and_its_rules(daemon: DaemonProcess, tmp_path: Path) -> None:
    headers = {"Authorization": f"Bearer {daemon.token}"}
    with httpx.Client(base_url=daemon.url, headers=headers, timeout=60) as http:
        ok = http.put("/v1/definitions/plain", json={
            "id": "plain", "provider": {"type": "local"},
            "workspace": {"setup": ["echo hi > hello.txt"]},
            "lifecycle": {"reuse": "none", "keep_alive": "30m"},
        })
        assert ok.status_code == 200, ok.text
        assert ok.json()["lifecycle"]["keep_alive"] == 1800
        bad = http.put("/v1/definitions/plain", json={"lifecycle": {"keep_alive": "soon"}})
        assert bad.status_code == 400 and "lifecycle.keep_alive" in bad.json()["error"]["message"]
        # A source on the daemon's host is the operator's to give.
        for source in ({"dir": str(tmp_path)}, {"git": f"file://{tmp_path}"},
                       {"git": str(tmp_path)}, {"git": "../repo"},
                       {"git": "ext::sh -c touch% /tmp/hutch-pwned"},
                       {"git": "git@example.org:repo.git"}, {"git": "ssh://example.org/r"}):
            refused = http.put("/v1/definitions/host", json={"workspace": {"source": source}})
            assert refused.status_code == 403, source
            assert "hutch.toml" in refused.json()["error"]["message"]
        assert http.get("/v1/definitions").json()["definitions"][0]["id"] != "host"
        missing = http.post("/v1/definitions/nope/ensure", json={"thread_id": "t"})
        assert missing.status_code == 404
        made = http.post("/v1/definitions/plain/ensure", json={"thread_id": "t"})
        assert made.status_code == 200, made.text
        answer = made.json()
        assert answer["path"] == "created" and answer["sandbox"]["state"] == "running"
        failing = http.put("/v1/definitions/failing", json={
            "workspace": {"setup": ["echo partial; exit 7"]}})
        assert failing.status_code == 200
        failed = http.post("/v1/definitions/failing/ensure", json={"thread_id": "t"})
        assert failed.status_code == 422
        error = failed.json()["error"]
        assert error["code"] == "setup_failed" and "exited 7" in error["message"]
        assert "partial" in error["message"]
        # What the typed error carries travels in the body, beside the message.
        assert error["exit_code"] == 7 and error["output_tail"] == "partial\n"
        assert error["step"] == "echo partial; exit 7"
        # Nothing of the failed run is recorded as a good snapshot.
        assert not [s for s in http.get("/v1/snapshots").json()["snapshots"]
                    if s["label"].startswith("definition:")
                    and s["sandbox_id"] not in (answer["sandbox"]["id"],)]
        done = http.post("/v1/definitions/plain/complete", json={"thread_id": "t"})
        assert done.json() == {"destroyed": True}  # reuse none: the run's sandbox goes
        gone = http.get(f"/v1/sandboxes/{answer['sandbox']['id']}")
        assert gone.status_code == 404 or gone.json()["state"] == "terminated"


def test_setup_failed_is_rebuilt_by_the_sdk(daemon: DaemonProcess) -> None:
    """The SDK raises the same SetupFailed as in-process: its exit code, the
    step and the end of its output, from the answer and from the stream."""
    with hutch.Client(daemon.url, token=daemon.token) as c:
        c.put_definition({"id": "failing", "provider": "local",
                          "workspace": {"setup": ["true", "echo partial; echo oops >&2; exit 7"]}})
        with pytest.raises(SetupFailed) as answered:
            c.ensure("failing", "t")
        with pytest.raises(SetupFailed) as streamed:
            list(c.ensure_stream("failing", "t"))
        for caught in (answered, streamed):
            assert caught.value.exit_code == 7 and caught.value.code == "setup_failed"
            assert caught.value.step == "echo partial; echo oops >&2; exit 7"
            assert "partial" in caught.value.output_tail and "oops" in caught.value.output_tail
            assert "exited 7" in str(caught.value)
        assert c.list_sandboxes() == []  # the half-made sandboxes went too


@pytest.mark.anyio
async def test_a_daemon_s_thread_is_not_taken_in_process(daemon: DaemonProcess, repo: str) -> None:  # noqa: F811
    """A program opening the daemon's store in-process finds the thread's
    sandbox held by the daemon, and is told so (typed), rather than making
    a second one or failing on a record it cannot read."""
    with hutch.Client(daemon.url, token=daemon.token) as c:
        held = c.ensure("repo-agent", "t-held")
    definitions = open_definitions(os.path.join(daemon.data_dir, "hutch.db"))
    d = Definition.parse({"id": "repo-agent", "provider": "local",
                          "workspace": {"source": {"git": repo, "ref": "main"},
                                        "setup": [SETUP]},
                          "lifecycle": {"reuse": "thread", "snapshot_max_age": "24h",
                                        "destroy_on_complete": False}})
    try:
        with pytest.raises(hutch.SandboxUnavailable, match="held by the hutch daemon") as caught:
            await definitions.ensure(d, "t-held")
        assert held.sandbox.id in str(caught.value)
    finally:
        definitions.host.store.close()


_HOLDING_PROGRAM = """
import json, sys, anyio
from hutch.definitions import Definition, open_definitions
d = Definition.parse(json.loads(sys.argv[1]))
async def main():
    definitions = open_definitions()  # the daemon's store: HUTCH_HOME is its data directory
    e = await definitions.ensure(d, "t-program")
    await e.sandbox.write_text("notes.txt", "the program's work")
    deadline = await e.sandbox.set_timeout(3600)
    print("ready", e.path, e.sandbox.id, e.sandbox.status().created_at_unix, deadline,
          flush=True)
    while (await anyio.to_thread.run_sync(sys.stdin.readline)).strip() == "read":
        print(await e.sandbox.read_text("notes.txt"), flush=True)
anyio.run(main)
"""


def _program_s_thread_is_not_taken(daemon: DaemonProcess, definition_id: str) -> None:
    """A program holding a thread's sandbox in-process on the daemon's store:
    the daemon asked to ensure that thread says so (typed) and makes no
    second sandbox while the program lives; once the program is killed, the
    daemon takes its sandbox over, with the program's work in it."""
    with hutch.Client(daemon.url, token=daemon.token) as c:
        # The program ensures the definition as the daemon has it (same key).
        body = next(d for d in c.definitions() if d["id"] == definition_id)
    program = subprocess.Popen(
        [sys.executable, "-c", _HOLDING_PROGRAM, json.dumps(body)], text=True,
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        env={**os.environ, "HUTCH_HOME": daemon.data_dir})
    try:
        assert program.stdout is not None and program.stdin is not None
        ready = program.stdout.readline().split()
        assert ready[:2] == ["ready", "created"], program.stderr.read() if program.stderr else ""
        sandbox_id = ready[2]
        with hutch.Client(daemon.url, token=daemon.token) as c:
            with pytest.raises(hutch.SandboxUnavailable, match="held in-process") as caught:
                c.ensure(definition_id, "t-program")
            assert sandbox_id in str(caught.value) and str(program.pid) in str(caught.value)
            assert c.list_sandboxes() == []  # no second sandbox for the thread
            program.stdin.write("read\n")
            program.stdin.flush()
            assert program.stdout.readline().strip() == "the program's work"
            # The program dies without a word (a crash): its hold goes with it.
            program.kill()
            program.wait(30)
            taken = c.ensure(definition_id, "t-program")
            assert taken.path == "resumed" and taken.sandbox.id == sandbox_id
            assert taken.sandbox.read_text("notes.txt") == "the program's work"
            assert taken.sandbox.read_text(".setup-runs") == "ran\n"  # setup not run again
            assert [s["id"] for s in c.list_sandboxes()] == [sandbox_id]
            # Its time limits as the program left them: made then, its deadline kept.
            status = taken.sandbox.status()
            assert abs(status.created_at_unix - float(ready[3])) < 0.01, (status, ready)
            assert status.deadline_unix is not None
            assert abs(status.deadline_unix - float(ready[4])) < 0.01, (status, ready)
            again = c.ensure(definition_id, "t-program")
            assert again.path == "resumed" and again.sandbox.id == sandbox_id
    finally:
        if program.poll() is None:
            program.kill()
            program.wait(30)


def test_a_program_s_thread_is_not_taken_by_the_daemon_local(daemon: DaemonProcess) -> None:
    _program_s_thread_is_not_taken(daemon, "repo-agent")


@pytest.mark.docker
def test_a_program_s_thread_is_not_taken_by_the_daemon_docker(daemon: DaemonProcess) -> None:
    with hutch.Client(daemon.url, token=daemon.token) as c:
        c.put_definition({"id": "docker-agent",
                          "provider": {"type": "docker", "image": TEST_IMAGE, "runtime": "native"},
                          "workspace": {"setup": ["echo ran >> .setup-runs"]}})
    _program_s_thread_is_not_taken(daemon, "docker-agent")



_TAKING_PROGRAM = """
import json, sys, anyio
from hutch.definitions import Definition, open_definitions
d = Definition.parse(json.loads(sys.argv[1]))
async def main():
    definitions = open_definitions()  # the daemon's store: HUTCH_HOME is its data directory
    e = await definitions.ensure(d, sys.argv[2])
    status = e.sandbox.status()
    print(json.dumps({"path": e.path, "id": e.sandbox.id,
                      "notes": await e.sandbox.read_text("notes.txt"),
                      "created": status.created_at_unix, "deadline": status.deadline_unix}),
          flush=True)
    while (line := (await anyio.to_thread.run_sync(sys.stdin.readline)).strip()) == "exec":
        print((await e.sandbox.exec("cat notes.txt")).stdout, flush=True)
    await definitions.host.destroy(e.sandbox)
    definitions.host.store.delete_instance(e.key)
    print("ended", flush=True)
anyio.run(main)
"""


def _daemon_s_thread_is_taken_once_it_dies(
    daemon: DaemonProcess, definition_id: str, *, left_frozen: bool = False,
) -> None:
    """A daemon holding a thread's sandbox is killed (SIGKILL: nothing of it
    runs after): a program that ensures that thread in-process on its store
    sees the holder is dead and takes the sandbox over, the daemon's work in
    it, as the daemon does with a dead program's. The daemon started again
    finds it held in-process by a program that lives: it neither adopts it
    nor frees it as an orphan. ``left_frozen``: the daemon died with the
    container frozen (a suspend's commit cut short): the program finds it
    as it is, not as recorded, and brings it back."""
    with hutch.Client(daemon.url, token=daemon.token) as c:
        body = next(d for d in c.definitions() if d["id"] == definition_id)
        held = c.ensure(definition_id, "t-dead-daemon")
        held.sandbox.write_text("notes.txt", "the daemon's work")
        deadline = held.sandbox.set_timeout(3600)
        created = held.sandbox.status().created_at_unix
    daemon.kill()
    if left_frozen:
        docker.APIClient().pause(f"hutch-{held.sandbox.id}")
    program = subprocess.Popen(
        [sys.executable, "-c", _TAKING_PROGRAM, json.dumps(body), "t-dead-daemon"], text=True,
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        env={**os.environ, "HUTCH_HOME": daemon.data_dir})
    try:
        assert program.stdout is not None and program.stdin is not None
        line = program.stdout.readline()
        assert line, program.stderr.read() if program.stderr else ""
        taken = json.loads(line)
        assert taken["path"] == "resumed" and taken["id"] == held.sandbox.id
        assert taken["notes"] == "the daemon's work"
        # Its time limits as the daemon left them.
        assert abs(taken["created"] - created) < 0.01, (taken, created)
        assert taken["deadline"] is not None and abs(taken["deadline"] - deadline) < 0.01
        daemon.start()
        with hutch.Client(daemon.url, token=daemon.token) as c:
            assert c.list_sandboxes() == []  # not adopted as the daemon's again
            with pytest.raises(hutch.SandboxUnavailable, match="held in-process") as caught:
                c.ensure(definition_id, "t-dead-daemon")
            assert str(program.pid) in str(caught.value)
        # Nor freed by the restart's reconciliation: the program's handle works on.
        program.stdin.write("exec\n")
        program.stdin.flush()
        assert program.stdout.readline().strip() == "the daemon's work"
        program.stdin.write("end\n")
        program.stdin.flush()
        assert program.stdout.readline().strip() == "ended"
        assert program.wait(60) == 0
    finally:
        if program.poll() is None:
            program.kill()
            program.wait(30)


def test_a_dead_daemon_s_thread_is_taken_in_process_local(daemon: DaemonProcess) -> None:
    _daemon_s_thread_is_taken_once_it_dies(daemon, "repo-agent")


@pytest.mark.docker
@pytest.mark.parametrize("left_frozen", [False, True], ids=["running", "left-frozen"])
def test_a_dead_daemon_s_thread_is_taken_in_process_docker(
    daemon: DaemonProcess, left_frozen: bool,
) -> None:
    with hutch.Client(daemon.url, token=daemon.token) as c:
        c.put_definition({"id": "docker-agent",
                          "provider": {"type": "docker", "image": TEST_IMAGE, "runtime": "native"},
                          "workspace": {"setup": ["echo ran >> .setup-runs"]}})
    _daemon_s_thread_is_taken_once_it_dies(daemon, "docker-agent", left_frozen=left_frozen)
