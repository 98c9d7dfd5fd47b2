"""A docker exec (native runtime) never hangs and never lies about its output.

An exec's output comes back over the connection the Engine hijacks for it.
The HTTP client reads the response's headers through a buffered reader, which
may read the first frames of output with them when the command is fast and
the reading thread slow (under load: one fast exec in a hundred while pauses
ran answered exit 0 and no output): those bytes are the stream's start, not
lost. And once the command's process is gone, its output stream must end in
a bounded time: an exec whose stream the Engine never ends (seen under load:
its output all there, its process long gone, the Engine still saying it ran)
fails with a clear error instead of waiting forever.
"""

from __future__ import annotations

import asyncio
import io
import socket
import threading
import time
import types
from typing import Any

import anyio
import pytest

import hutch
from hutch._sandbox import backend_of
from hutch.providers import _docker_engine as docker_engine
from hutch.providers import docker as docker_provider
from hutch.providers.docker import DockerSandbox
from hutch.providers.docker import process as docker_exec
from tests.late_headers import exec_headers_read_late
from tests.test_docker_freeze import sb  # noqa: F401 - a fixture: a native docker sandbox

pytestmark = [pytest.mark.anyio, pytest.mark.docker]


async def test_output_read_with_the_headers_is_kept(
    sb: Any, monkeypatch: pytest.MonkeyPatch  # noqa: F811
) -> None:
    monkeypatch.setattr(docker_engine, "_api_client",
                        exec_headers_read_late(monkeypatch, docker_provider.engine(), 1.0))
    for n in range(3):
        result = await sb.exec(["sh", "-c", f"echo out-{n}; echo err-{n} >&2"])
        assert (result.exit_code, result.stdout, result.stderr) == (
            0, f"out-{n}\n", f"err-{n}\n"), result
    big = await sb.exec(["head", "-c", "300000", "/dev/zero"])  # more than the reader's buffer
    assert big.stdout_bytes == bytes(300000), len(big.stdout_bytes)


class StreamHeldOpen:
    """An exec's hijacked connection that passes on what the Engine sends but
    never ends: the stream of an exec whose end the Engine never sent."""

    def __init__(self, real: Any) -> None:
        early = docker_provider.read_ahead(real)
        self._sock, self._far = socket.socketpair()
        self._response = types.SimpleNamespace(
            raw=types.SimpleNamespace(_fp=types.SimpleNamespace(fp=io.BytesIO(early))))
        threading.Thread(target=self._relay, args=(real._sock,), daemon=True).start()

    def _relay(self, engine_side: socket.socket) -> None:
        engine_side.settimeout(None)
        while data := engine_side.recv(65536):
            self._far.sendall(data)
        engine_side.close()  # ... and self._far stays open

    def close(self) -> None:
        self._far.close()


class EngineThatNeverEnds:
    """The real Engine, whose exec streams never end; with ``lose_exit`` it
    also never records an exit (says Running, as it did under load)."""

    def __init__(self, real: Any, *, lose_exit: bool) -> None:
        self._real = real
        self._lose_exit = lose_exit
        self.held: list[StreamHeldOpen] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def exec_start(self, *args: Any, **kwargs: Any) -> Any:
        held = StreamHeldOpen(self._real.exec_start(*args, **kwargs))
        self.held.append(held)
        return held

    def exec_inspect(self, exec_id: str) -> Any:
        state = dict(self._real.exec_inspect(exec_id))
        if self._lose_exit and state.get("Pid"):
            state.update(Running=True, ExitCode=None)
        return state


@pytest.mark.parametrize("lose_exit", [False, True], ids=["stream-open", "exit-lost"])
async def test_an_exec_whose_stream_never_ends_fails_once_its_process_is_gone(
    sb: Any, monkeypatch: pytest.MonkeyPatch, lose_exit: bool  # noqa: F811
) -> None:
    backend = backend_of(sb)
    assert isinstance(backend, DockerSandbox)
    broken = EngineThatNeverEnds(docker_provider.engine(), lose_exit=lose_exit)
    monkeypatch.setattr(docker_engine, "_api_client", broken)
    monkeypatch.setattr(docker_exec, "EXEC_DRAIN_SECONDS", 1.0)
    monkeypatch.setattr(docker_exec, "EXEC_DRAIN_LOAD_FACTOR", 1)
    try:
        with anyio.fail_after(60):  # without the guard: forever
            with pytest.raises(hutch.HutchError) as caught:
                await sb.exec(["echo", "hello"])
    finally:
        for held in broken.held:
            held.close()
    said = str(caught.value)
    assert caught.value.code == "provider_error", said
    assert "output may be incomplete" in said, said
    assert ("lost its exit" in said) == lose_exit, said
    assert ("exited with status 0" in said) == (not lose_exit), said
    monkeypatch.undo()
    assert (await sb.exec(["echo", "alive"])).stdout == "alive\n"


async def test_a_quiet_command_and_one_that_closed_its_output_are_waited_for(
    sb: Any, monkeypatch: pytest.MonkeyPatch  # noqa: F811
) -> None:
    # Far past the drain time while the process is there: still waited for.
    monkeypatch.setattr(docker_exec, "EXEC_DRAIN_SECONDS", 0.5)
    monkeypatch.setattr(docker_exec, "EXEC_DRAIN_LOAD_FACTOR", 1)
    quiet = await sb.exec(["sh", "-c", "sleep 2; echo done"])
    assert (quiet.exit_code, quiet.stdout) == (0, "done\n"), quiet
    # Its stream ends at once; its exit status comes two seconds later.
    closed = await sb.exec(["sh", "-c", "exec >&- 2>&-; sleep 2; exit 3"])
    assert (closed.exit_code, closed.stdout, closed.stderr) == (3, "", ""), closed



class StreamWithGaps(StreamHeldOpen):
    """An exec's hijacked connection that takes everything the Engine sends
    at once (so the command ends at once), then passes it on in pieces with
    pauses, as a loaded Engine and a slow reader do, and ends."""

    def _relay(self, engine_side: socket.socket) -> None:
        engine_side.settimeout(None)
        held = bytearray()
        while data := engine_side.recv(65536):
            held += data
        engine_side.close()
        for start in range(0, len(held), 65536):
            time.sleep(0.3)
            self._far.sendall(held[start:start + 65536])
        self._far.close()


class EngineWithGaps(EngineThatNeverEnds):
    def exec_start(self, *args: Any, **kwargs: Any) -> Any:
        held = StreamWithGaps(self._real.exec_start(*args, **kwargs))
        self.held.append(held)
        return held


async def test_output_still_flowing_after_its_process_is_gone_is_read_whole(
    sb: Any, monkeypatch: pytest.MonkeyPatch  # noqa: F811
) -> None:
    """The drain time is for a stream that has gone quiet, not a limit on how
    long the rest of the output may take to arrive once the command has
    ended. Seen in CI: four 50 MB outputs at once through a loaded daemon,
    each cut off with provider_error 15 s after its command ended while its
    bytes were still arriving."""
    monkeypatch.setattr(docker_exec, "EXEC_DRAIN_SECONDS", 1.0)
    monkeypatch.setattr(docker_exec, "EXEC_DRAIN_LOAD_FACTOR", 1)
    monkeypatch.setattr(docker_engine, "_api_client",
                        EngineWithGaps(docker_provider.engine(), lose_exit=False))
    size = 1 << 20
    with anyio.fail_after(120):
        result = await sb.exec(["head", "-c", str(size), "/dev/zero"])
    assert (result.exit_code, len(result.stdout_bytes)) == (0, size)


async def test_a_reader_that_stalls_past_the_drain_time_still_gets_everything(
    sb: Any, monkeypatch: pytest.MonkeyPatch  # noqa: F811
) -> None:
    """While the reader is stalled the exec's thread waits for room, not for
    the stream: bytes waiting when it looks again are not a quiet stream."""
    monkeypatch.setattr(docker_exec, "EXEC_DRAIN_SECONDS", 1.0)
    monkeypatch.setattr(docker_exec, "EXEC_DRAIN_LOAD_FACTOR", 1)
    monkeypatch.setattr(docker_engine, "_api_client",
                        EngineWithGaps(docker_provider.engine(), lose_exit=False))
    size = 2 << 20
    got, stalled = 0, False
    with anyio.fail_after(120):
        async for event in sb.exec_stream(["head", "-c", str(size), "/dev/zero"]):
            if isinstance(event, hutch.OutputChunk):
                got += len(event.data)
                if not stalled and got >= size // 4:
                    stalled = True
                    await anyio.sleep(3)
            elif isinstance(event, hutch.ExitStatus):
                assert event.exit_code == 0, event
    assert got == size


class StreamEndedInTurn(StreamHeldOpen):
    """An exec's hijacked connection that passes on all the Engine sends,
    then stays open until :class:`EngineWithQueuedExits` ends it."""

    def __init__(self, real: Any) -> None:
        self.relayed = threading.Event()
        super().__init__(real)

    def _relay(self, engine_side: socket.socket) -> None:
        try:
            super()._relay(engine_side)
        finally:
            self.relayed.set()


class EngineWithQueuedExits(EngineThatNeverEnds):
    """The Engine handles a container's exec exits one at a time, each
    waiting up to 2 s for its stream's copy before it ends the stream and
    records the exit (moby's ProcessEvent, on a queue per container): with
    many execs ending together under load, the last one's end comes many
    seconds after its process's, behind the others'. Here each end takes
    ``gap`` seconds, in turn."""

    def __init__(self, real: Any, gap: float) -> None:
        super().__init__(real, lose_exit=False)
        self.gap = gap
        self.ended: set[str] = set()
        self._turn = threading.Lock()

    def exec_start(self, exec_id: Any, *args: Any, **kwargs: Any) -> Any:
        held = StreamEndedInTurn(self._real.exec_start(exec_id, *args, **kwargs))
        self.held.append(held)
        name = exec_id["Id"] if isinstance(exec_id, dict) else str(exec_id)
        threading.Thread(target=self._end_in_turn, args=(name, held), daemon=True).start()
        return held

    def _end_in_turn(self, exec_id: str, held: StreamEndedInTurn) -> None:
        held.relayed.wait(60)
        while self._real.exec_inspect(exec_id)["Running"]:
            time.sleep(0.01)
        with self._turn:
            time.sleep(self.gap)
            self.ended.add(exec_id)
            held.close()

    def exec_inspect(self, exec_id: str) -> Any:
        state = dict(self._real.exec_inspect(exec_id))
        if exec_id not in self.ended:
            state.update(Running=True, ExitCode=None)
        return state


async def test_execs_ending_together_wait_their_turn_for_the_engine(
    sb: Any, monkeypatch: pytest.MonkeyPatch  # noqa: F811
) -> None:
    """Execs of one sandbox that end together have their ends told one at a
    time: while the Engine goes on ending the sandbox's other execs, an exec
    whose turn has not come is not one whose exit was lost. Seen in CI under
    load: seven large outputs at once in one container, one failed 'the
    Engine still says it runs' 15 s after its process ended."""
    # Room for the real Engine's own end of the first; the last one's comes
    # more than twice the drain time after its process's.
    monkeypatch.setattr(docker_exec, "EXEC_DRAIN_SECONDS", 3.0)
    monkeypatch.setattr(docker_exec, "EXEC_DRAIN_LOAD_FACTOR", 1)
    engine = EngineWithQueuedExits(docker_provider.engine(), gap=1.0)
    monkeypatch.setattr(docker_engine, "_api_client", engine)
    try:
        with anyio.fail_after(120):
            results = await asyncio.gather(*(
                sb.exec(["sh", "-c", f"echo turn-{n}"]) for n in range(6)))
    finally:
        for held in engine.held:
            held.close()
    assert [(r.exit_code, r.stdout) for r in results] == [
        (0, f"turn-{n}\n") for n in range(6)]


def test_the_drain_time_stretches_with_the_hosts_load(monkeypatch: pytest.MonkeyPatch) -> None:
    """The Engine's steps from an exit to its stream's end wait for a CPU as
    everything does: on an oversubscribed host the drain time is longer, by
    as much (up to a bound), and never shorter than on an idle one."""
    monkeypatch.setattr(docker_exec.os, "cpu_count", lambda: 2)
    for load, stretched in ((0.3, 1.0), (2.0, 1.0), (6.0, 3.0), (24.0, 8.0), (400.0, 8.0)):
        monkeypatch.setattr(docker_exec.os, "getloadavg", lambda load=load: (load, 0.0, 0.0))
        assert docker_exec.drain_seconds() == docker_exec.EXEC_DRAIN_SECONDS * stretched, load
