"""Two programs holding one thread's sandbox in-process (no daemon), each
with a lifecycle engine of its own: the idle rule reads the activity of both,
kept in the store they share, so that one program's timer never suspends
(or reaps) the sandbox while the other is using it, and once both stop it is
suspended (or reaped) once, by one of them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import anyio
import pytest

from hutch import Sandbox, SandboxUnavailable
from hutch.definitions import Definition, Definitions, LocalHost
from hutch.store import InstanceRow, SQLiteStore

from .conftest import TEST_IMAGE
from .test_definitions import home  # noqa: F401 - a fixture

#: The idle rule of the definition: short, so that the test is; the busy
#: program works for three of these past the idle one's last call.
KEEP_ALIVE = 2.0

_PROGRAM = """
import json, logging, sys, time, anyio
from hutch.definitions import Definition, open_definitions
body, role, busy_for = json.loads(sys.argv[1]), sys.argv[2], float(sys.argv[3])
d = Definition.parse(body)
made = []  # the idle transitions this program's own engine made

class Noted(logging.Handler):
    def emit(self, record):
        text = record.getMessage()
        if "-> suspended" in text or "-> terminated" in text:
            made.append(text)

logging.getLogger("hutch.lifecycle").addHandler(Noted())
logging.getLogger("hutch.lifecycle").setLevel(logging.INFO)
ENDED = ("suspended", "terminated")

async def main():
    definitions = open_definitions()
    store = definitions.host.store
    e = await definitions.ensure(d, "thread-shared")
    print("ready", e.path, e.sandbox.id, flush=True)
    failures, states = [], set()
    if role == "idle":
        # Active until told to go quiet (once the busy one is ready): how
        # long the other program takes to start is not this test's business.
        told = []

        async def touch():
            while not told:
                try:
                    await e.sandbox.read_text(".setup-runs")
                except Exception as exc:
                    failures.append(f"{type(exc).__name__}: {exc}")
                await anyio.sleep(0.25)

        async with anyio.create_task_group() as group:
            group.start_soon(touch)
            await anyio.to_thread.run_sync(sys.stdin.readline)
            told.append(True)
    if role == "busy":
        sys.stdin.readline()  # told to start once the idle one has gone quiet
        until = time.monotonic() + busy_for
        while time.monotonic() < until:
            try:
                await e.sandbox.read_text(".setup-runs")
            except Exception as exc:
                failures.append(f"{type(exc).__name__}: {exc}")
            states.add(store.get_instance(e.key).state)
            await anyio.sleep(0.25)
    # Both quiet now: wait for the idle rule, then long enough for the other
    # program's timer to have fired too.
    deadline = time.monotonic() + 60
    while store.get_instance(e.key).state not in ENDED and time.monotonic() < deadline:
        await anyio.sleep(0.1)
    await anyio.sleep(3 * body["lifecycle"]["keep_alive"])
    final = store.get_instance(e.key).state
    after = "-"
    if role == "busy":  # back at work: its handle follows what the other program did
        try:
            after = await e.sandbox.read_text(".setup-runs")
        except Exception as exc:
            after = type(exc).__name__
    print(json.dumps({"failures": failures, "states_while_busy": sorted(states),
                      "made": made, "final": final, "after": after}), flush=True)
anyio.run(main)
"""


def _definition(provider: dict[str, object]) -> dict[str, object]:
    return {"id": "shared", "provider": provider,
            "workspace": {"setup": ["echo ran >> .setup-runs"]},
            "lifecycle": {"keep_alive": KEEP_ALIVE, "snapshot": "none"}}


def _two_programs_one_idle_rule(home: Path, provider: dict[str, object],  # noqa: F811
                                ended: str, after: set[str]) -> None:
    body = json.dumps(_definition(provider))

    def start(role: str) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [sys.executable, "-c", _PROGRAM, body, role, str(3 * KEEP_ALIVE)], text=True,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)

    idle = start("idle")
    busy = None
    try:
        assert idle.stdout is not None
        ready = idle.stdout.readline().split()
        assert ready[:2] == ["ready", "created"], idle.stderr.read() if idle.stderr else ""
        busy = start("busy")
        assert busy.stdout is not None and busy.stdin is not None
        assert busy.stdout.readline().split() == ["ready", "resumed", ready[2]]
        # The idle program goes quiet; from here the busy one works for three
        # of its idle windows.
        assert idle.stdin is not None
        idle.stdin.write("quiet\n")
        idle.stdin.flush()
        busy.stdin.write("go\n")
        busy.stdin.flush()
        answers = []
        for proc in (idle, busy):
            out, err = proc.communicate(timeout=180)
            assert proc.returncode == 0, err
            answers.append(json.loads(out.splitlines()[-1]))
    finally:
        for proc in (idle, busy):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
    idle_answer, busy_answer = answers
    assert idle_answer["failures"] == busy_answer["failures"] == [], answers
    assert busy_answer["states_while_busy"] == ["running"], busy_answer
    # Once both stopped: one program's timer acted, once; the other's stood down.
    made = idle_answer["made"] + busy_answer["made"]
    assert len(made) == 1 and f"-> {ended}" in made[0], (idle_answer, busy_answer)
    assert idle_answer["final"] == busy_answer["final"] == ended
    # The busy one's next call: resumed from the other's suspend (its handle
    # found the sandbox again as recorded), or the typed error of its end.
    assert busy_answer["after"] in after, busy_answer


def test_two_programs_share_the_idle_rule_local(home: Path) -> None:  # noqa: F811
    # local cannot suspend: keep_alive reaps an idle sandbox instead.
    _two_programs_one_idle_rule(home, {"type": "local"}, "terminated",
                                {"SandboxUnavailable", "IdleTimeoutExpired"})


@pytest.mark.docker
def test_two_programs_share_the_idle_rule_docker(home: Path) -> None:  # noqa: F811
    _two_programs_one_idle_rule(
        home, {"type": "docker", "image": TEST_IMAGE, "runtime": "native"}, "suspended",
        {"ran\n"})
    # The suspended sandbox is the thread's still: resumed with its files, then ended.

    async def end() -> None:
        definitions = Definitions(LocalHost(SQLiteStore(str(home / "hutch.db"))))
        try:
            again = await definitions.ensure(Definition.parse(_definition(
                {"type": "docker", "image": TEST_IMAGE, "runtime": "native"})), "thread-shared")
            assert again.path == "resumed"
            assert await again.sandbox.read_text(".setup-runs") == "ran\n"
            await again.sandbox.close()
        finally:
            await definitions.settle()
            definitions.host.store.close()

    anyio.run(end)


def test_the_store_keeps_the_latest_activity(home: Path) -> None:  # noqa: F811
    """Programs write their activity in any order; the latest stands."""


    store = SQLiteStore(str(home / "hutch.db"))
    try:
        store.put_instance(InstanceRow(key="k", definition_id="d", thread_id="t", tenant=None,
                                       provider="local", sandbox_id="sb-1",
                                       last_active_unix=100.0))
        store.note_instance_activity("sb-1", 200.0)
        store.note_instance_activity("sb-1", 150.0)  # a slower program's older call
        found = store.instance_of_sandbox("sb-1")
        assert found is not None and found.key == "k" and found.last_active_unix == 200.0
        assert store.instance_of_sandbox("sb-other") is None
    finally:
        store.close()


def test_a_holder_whose_pid_was_reused_holds_nothing(home: Path) -> None:  # noqa: F811
    """A hold or lease names its program by pid and start time: a live
    process that got the pid later is not that program."""
    from hutch._liveness import this_process
    from hutch.definitions.ensure import live_holders, program_alive, this_program

    pid, start = this_process()
    host = os.uname().nodename
    reused = f"{host}:{pid}:{start + 1}"  # this pid, but a process started at another time
    assert program_alive(this_program()) and not program_alive(reused)
    store = SQLiteStore(str(home / "hutch.db"))
    try:
        assert store.take_lease("k", f"{reused}:a", 60)
        assert store.take_lease("k", f"{this_program()}:b", 60)  # the first one's was free
        assert not store.take_lease("k", f"{this_program()}:c", 60)  # a live one's is not
        store.hold_instance("key", reused)
        store.hold_instance("key", this_program())
        assert live_holders(store, "key") == [this_program()]
        assert store.instance_holders("key") == [this_program()]  # the dead one's dropped
    finally:
        store.close()


@pytest.mark.anyio
async def test_an_operation_open_in_one_program_keeps_the_sandbox_for_all(
    home: Path,  # noqa: F811
) -> None:
    """A long upload in one program (no process in the sandbox to count) is
    activity for the other program's idle rule all along, not only when it
    began: the sandbox is not reaped under it."""
    d = Definition.parse({**_definition({"type": "local"}),
                          "lifecycle": {"keep_alive": 1.0, "snapshot": "none"}})
    programs = [Definitions(LocalHost(SQLiteStore(str(home / "hutch.db")))) for _ in range(2)]
    idle = await programs[0].ensure(d, "t")
    busy = await programs[1].ensure(d, "t")
    assert busy.path == "resumed" and busy.sandbox.id == idle.sandbox.id
    read_end, write_end = os.pipe()

    def trickle() -> None:  # four idle windows, a byte at a time
        with os.fdopen(write_end, "wb", buffering=0) as out:
            for _ in range(20):
                out.write(b"x")
                time.sleep(0.2)

    try:
        with os.fdopen(read_end, "rb", buffering=0) as source:
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(anyio.to_thread.run_sync, trickle)
                await busy.sandbox.write_from("upload.bin", source)
        assert await busy.sandbox.read_bytes("upload.bin") == b"x" * 20
        row = programs[0].host.store.get_instance(idle.key)
        assert row is not None and row.state == "running"
        assert not idle.sandbox.closed
    finally:
        await busy.sandbox.close()
        for program in programs:
            await program.settle()
            program.host.store.close()


@pytest.mark.docker
@pytest.mark.anyio
async def test_a_handle_follows_what_another_program_did_docker(
    home: Path,  # noqa: F811
) -> None:
    """A program's handle of a sandbox another program has suspended or
    resumed since goes by the record, never by what it last did itself: its
    timer, finding the sandbox suspended elsewhere, takes that state (its next
    call resumes it from the other program's suspend), and a handle that
    suspended it resumes nothing once another program has: it works on that
    program's container, not a second one of its own."""
    d = Definition.parse({**_definition({"type": "docker", "image": TEST_IMAGE,
                                         "runtime": "native"}),
                          "lifecycle": {"keep_alive": 1.0, "snapshot": "none"}})
    programs = [Definitions(LocalHost(SQLiteStore(str(home / "hutch.db")))) for _ in range(2)]
    first = (await programs[0].ensure(d, "t")).sandbox
    second = (await programs[1].ensure(d, "t")).sandbox
    try:
        await first.write_text("one.txt", "one")
        # The second program suspends it before the first one's idle timer fires.
        await second.suspend()
        deadline = time.monotonic() + 30
        while first.state.value != "suspended":  # the first one's timer followed
            assert time.monotonic() < deadline, first.state
            await anyio.sleep(0.1)
        assert await first.read_text("one.txt") == "one"  # resumed from the other's suspend
        # Now the other way round: the first suspends, the second's ensure
        # resumes (a new container), and the first's next call uses that one.
        await first.suspend()
        again = await programs[1].ensure(d, "t")
        assert again.path == "resumed"
        await again.sandbox.write_text("two.txt", "two")
        assert await first.read_text("two.txt") == "two"
        containers = subprocess.run(
            ["docker", "ps", "-q", "--filter", f"label=hutch.sandbox_id={first.id}"],
            capture_output=True, text=True, check=True).stdout.split()
        assert len(containers) == 1, containers
    finally:
        await first.close()
        for program in programs:
            await program.settle()
            program.host.store.close()


async def _two_handles(home: Path, provider: dict[str, object]) -> tuple[  # noqa: F811
        list[Definitions], Sandbox, Sandbox]:
    """Two programs (store handles of their own, no idle rule) holding one
    thread's sandbox; a file written by the first."""
    d = Definition.parse({**_definition(provider), "lifecycle": {"snapshot": "none"}})
    programs = [Definitions(LocalHost(SQLiteStore(str(home / "hutch.db")))) for _ in range(2)]
    first = (await programs[0].ensure(d, "t")).sandbox
    second = await programs[1].ensure(d, "t")
    assert second.path == "resumed" and second.sandbox.id == first.id
    await first.write_text("one.txt", "one")
    return programs, first, second.sandbox


async def _end(programs: list[Definitions]) -> None:
    for program in programs:
        await program.settle()
        program.host.store.close()


@pytest.mark.anyio
async def test_a_handle_of_a_sandbox_another_program_ended_says_so_local(
    home: Path,  # noqa: F811
) -> None:
    """The other program closed it: this program's next call is the typed
    error of a sandbox ended elsewhere, not a missing file of its working
    directory."""
    programs, first, second = await _two_handles(home, {"type": "local"})
    try:
        await second.close()
        with pytest.raises(SandboxUnavailable, match="ended by another program"):
            await first.read_text("one.txt")
    finally:
        await first.close()
        await _end(programs)


@pytest.mark.docker
@pytest.mark.anyio
async def test_a_call_resumes_a_sandbox_another_program_suspended_docker(
    home: Path,  # noqa: F811
) -> None:
    """The other program suspended it (no idle timer here to notice): this
    program's next call resumes it from that suspend, transparently, as it
    would its own."""
    programs, first, second = await _two_handles(
        home, {"type": "docker", "image": TEST_IMAGE, "runtime": "native"})
    try:
        await second.suspend()
        assert await first.read_text("one.txt") == "one"
        assert first.state.value == "running"
        row = programs[1].host.store.instance_of_sandbox(first.id)
        assert row is not None and row.state == "running"
    finally:
        await first.close()
        await _end(programs)


@pytest.mark.docker
@pytest.mark.anyio
async def test_a_call_during_another_program_s_suspend_waits_and_resumes_docker(
    home: Path,  # noqa: F811
) -> None:
    """A call made while another program is suspending the sandbox (its
    claim held, its container going down) waits for that suspend, then
    resumes the sandbox from it, rather than reach a container being removed."""
    programs, first, second = await _two_handles(
        home, {"type": "docker", "image": TEST_IMAGE, "runtime": "native"})
    store = programs[0].host.store
    try:
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(second.suspend)
            deadline = time.monotonic() + 30
            while store.lease_holder(f"lifecycle:{first.id}") is None:
                assert time.monotonic() < deadline, "the suspend never took its claim"
                await anyio.sleep(0.005)
            assert await first.read_text("one.txt") == "one"
        row = store.instance_of_sandbox(first.id)
        assert row is not None and row.state == "running" and first.state.value == "running"
        containers = subprocess.run(
            ["docker", "ps", "-q", "--filter", f"label=hutch.sandbox_id={first.id}"],
            capture_output=True, text=True, check=True).stdout.split()
        assert len(containers) == 1, containers
    finally:
        await first.close()
        await _end(programs)


_RACER = """
import json, sys, time, anyio
from hutch.definitions import Definition, open_definitions
d, role, suspends = Definition.parse(json.loads(sys.argv[1])), sys.argv[2], int(sys.argv[3])

async def main():
    definitions = open_definitions()
    store = definitions.host.store
    e = await definitions.ensure(d, "t-race")
    print("ready", e.path, e.sandbox.id, flush=True)
    await anyio.to_thread.run_sync(sys.stdin.readline)  # go
    results = []
    if role == "worker":  # back to back, until told to stop: a call is always in flight
        stop = anyio.Event()

        async def told_to_stop():
            await anyio.to_thread.run_sync(sys.stdin.readline)
            stop.set()

        async with anyio.create_task_group() as tasks:
            tasks.start_soon(told_to_stop)
            while not stop.is_set():
                try:
                    done = await e.sandbox.exec("sleep 0.3; echo done")
                    results.append([done.exit_code, done.stdout])
                except Exception as exc:
                    results.append(f"{type(exc).__name__}: {exc}")
        print(json.dumps(results), flush=True)
        await definitions.host.destroy(e.sandbox)
        store.delete_instance(e.key)
    else:  # suspends it each time the worker has resumed it
        for _ in range(suspends):
            deadline = time.monotonic() + 120
            while store.get_instance(e.key).state != "running":
                assert time.monotonic() < deadline, "the worker never resumed it"
                await anyio.sleep(0.02)
            try:
                await e.sandbox.suspend()
                results.append("suspended")
            except Exception as exc:
                results.append(f"{type(exc).__name__}: {exc}")
        print(json.dumps(results), flush=True)
anyio.run(main)
"""


@pytest.mark.docker
def test_a_suspend_in_one_program_waits_for_the_other_s_calls_docker(
    home: Path,  # noqa: F811
) -> None:
    """Two programs race on one thread's sandbox: one runs commands back to
    back (a call is always in flight), the other suspends it again and again.
    Every command runs whole, before a suspend (the suspend waits for the
    other program's call in flight: it never kills a busy sandbox) or after
    it (the call resumes the sandbox from that suspend); none meets the
    container going down."""
    body = json.dumps({**_definition({"type": "docker", "image": TEST_IMAGE,
                                      "runtime": "native"}),
                       "lifecycle": {"snapshot": "none"}})
    suspends = 3

    def start(role: str) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [sys.executable, "-c", _RACER, body, role, str(suspends)], text=True,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)

    worker = start("worker")
    suspender = None
    try:
        assert worker.stdout is not None and worker.stdin is not None
        ready = worker.stdout.readline().split()
        assert ready[:2] == ["ready", "created"], worker.stderr.read() if worker.stderr else ""
        suspender = start("suspender")
        assert suspender.stdout is not None
        assert suspender.stdout.readline().split() == ["ready", "resumed", ready[2]]
        worker.stdin.write("go\n")
        worker.stdin.flush()
        suspended_out, suspended_err = suspender.communicate("go\n", timeout=300)
        assert suspender.returncode == 0, suspended_err
        assert json.loads(suspended_out.splitlines()[-1]) == ["suspended"] * suspends
        worker.stdin.write("stop\n")
        worker.stdin.flush()
        worked = json.loads(worker.stdout.readline())
        _, worker_err = worker.communicate(timeout=180)
        assert worker.returncode == 0, worker_err
    finally:
        for proc in (worker, suspender):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
    # Each suspend after the first waited for the worker to resume it (a
    # call of its own); the worker's calls ran back to back, one always in
    # flight, and every one ran whole.
    assert len(worked) >= suspends, worked
    assert all(result == [0, "done\n"] for result in worked), worked


_CALLER = """
import sys
from hutch._inflight import InFlightCalls
calls = InFlightCalls(sys.argv[1])
for line in sys.stdin:
    if line.strip() == "begin":
        print(calls.begin("sb-shared").value, flush=True)
    elif line.strip() == "end":
        calls.end("sb-shared")
        print("ended", flush=True)
"""


def test_calls_in_flight_are_seen_by_another_program(tmp_path: Path) -> None:
    """The marks a suspend goes by, between two real processes: another
    program's call in flight keeps the sandbox from being taken down (this
    program is refused the hold-off) until its last call ends; while this
    one holds it off, that program's new call is refused its mark (it waits
    instead); a program killed in the middle of a call holds nothing."""
    from hutch._inflight import CallMark, InFlightCalls

    directory = str(tmp_path / "calls")
    caller = subprocess.Popen([sys.executable, "-c", _CALLER, directory], text=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert caller.stdin is not None and caller.stdout is not None

    def say(word: str) -> str:
        assert caller.stdin is not None and caller.stdout is not None
        caller.stdin.write(word + "\n")
        caller.stdin.flush()
        return caller.stdout.readline().strip()

    here = InFlightCalls(directory)
    try:
        assert say("begin") == "first"
        assert say("begin") == "joined"
        with here.held_off("sb-shared") as held:
            assert not held  # two calls in flight there
        assert say("end") == "ended"
        with here.held_off("sb-shared") as held:
            assert not held  # one still is
        assert say("end") == "ended"
        with here.held_off("sb-shared") as held:
            assert held
            assert say("begin") == "refused"
            # This program's own call, made while it holds the sandbox off, waits too.
            assert here.begin("sb-shared") is CallMark.REFUSED
        assert say("begin") == "first"
        caller.kill()  # in the middle of its call
        caller.wait(30)
        with here.held_off("sb-shared") as held:
            assert held
    finally:
        if caller.poll() is None:
            caller.kill()
            caller.wait(30)
        here.drop("sb-shared", ended=True)
    assert os.listdir(directory) == []
