"""The agent runtime: exec, processes, files, grep and glob through hutch's
agent inside the sandbox, on kept connections to its unix socket.

Written once for every provider that can run the agent (docker, bubblewrap).
The provider gives it the socket's host path, the user commands run as by
default, and a ``recover`` callback: when the agent is gone or wedged, the
provider finds out why and brings it back (or says the sandbox is lost); a
request that never reached the agent is then tried once more, one that did
fails with a ``provider_error`` naming what happened. Nothing here waits
without a deadline: the agent beats a heartbeat while it works.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import re
import signal
import socket
import stat
import uuid
from collections.abc import (
    AsyncGenerator,
    AsyncIterator,
    Awaitable,
    Callable,
    Iterator,
    Mapping,
)
from typing import IO, Any, TypeVar

import anyio
import anyio.to_thread

from ..._errors import (
    HutchError,
    InvalidArgument,
    KillIncomplete,
    OutputLimitExceeded,
    ProviderError,
    SandboxUnavailable,
    StdinClosed,
)
from ..._globmatch import compile_glob
from ..._types import FileEvent, FileInfo, GrepMatch, OutputChunk
from .._grep import GrepBatches
from .._grepfilter import required_literals
from .._hostproc import EXEC_MARKER
from .._proctree import REAP_SECONDS, ProcessTree
from ..base import (
    FutureExitProcess,
    ProcessRequest,
    PtyProcess,
    SandboxRuntime,
    bounded_pieces,
)
from ..watching import BackendWatch
from .replies import (
    CrossDevice,
    file_event,
    file_info,
    listing,
    number,
    ok,
    predates,
    typed_error,
)
from .wire import MAX_PAYLOAD, AgentFailure, Channel, Header, connect_socket
from .workload import WORKLOAD_NAME, open_task_files

log = logging.getLogger("hutch.agent")

#: How long a request waits for the agent's next frame. The agent answers
#: at once or beats a heartbeat every second (every two for a running command).
ANSWER_TIMEOUT = 3.0
EXEC_SILENCE_TIMEOUT = 6.0
#: Idle connections kept for the next request.
POOL_SIZE = 8
#: How long a warm-up command may take (see AgentRuntime.warm).
WARM_SECONDS = 10.0
#: Paths one walk may send back, in bytes.
MAX_WALK_BYTES = 256 << 20
#: Past this size, a write hands the bytes over through a descriptor.
FD_WRITE_THRESHOLD = 64 << 10
#: Past this size, file I/O on a handed-over descriptor moves off the event loop.
_THREAD_BYTES = 4 << 20
#: Output chunks a process holds before its reader waits for the consumer.
_QUEUE_CHUNKS = 64

#: The provider's answer to a failed agent: True (or None) when it brought
#: the agent back (restarted: what ran is gone), False when the agent still
#: answers (the failure was the request's: slow, or its connection); raises
#: when the sandbox is lost.
Recover = Callable[[str], Awaitable[bool | None]]
T = TypeVar("T")


def _regular(fd: int) -> os.stat_result:
    """The handed-over descriptor's stat, refused unless a regular file (a
    pipe or a socket could block this process)."""
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        raise AgentFailure("the agent handed over a descriptor that is not a regular file")
    return info


async def _read_handed_over(fd: int, path: str, limit: int) -> bytes:
    try:
        size = _regular(fd).st_size
        if size > limit:
            raise OutputLimitExceeded(
                f"{path} is {size} bytes, over the read limit of {limit} bytes"
            )

        def read() -> bytes:
            # What fstat promised and a byte more, to notice a file still growing.
            data = os.pread(fd, size + 1, 0)
            if len(data) > size:
                # It grew (or is a /proc file, which says 0): the rest in
                # pieces, up to the limit and a byte, never the limit up front.
                parts = [data]
                total = len(data)
                while total <= limit:
                    piece = os.pread(fd, min(MAX_PAYLOAD, limit + 1 - total), total)
                    if not piece:
                        break
                    parts.append(piece)
                    total += len(piece)
                data = b"".join(parts)
            if len(data) > limit:
                raise OutputLimitExceeded(f"{path} is over the read limit of {limit} bytes")
            return data

        try:
            if size > _THREAD_BYTES:
                return await anyio.to_thread.run_sync(read)
            return read()
        except OSError as exc:
            # A procfs or sysfs file that cannot be read at an offset (EINVAL):
            # not a file the file API reads (grep skips it), as a FIFO is not.
            raise InvalidArgument(
                f"{path} cannot be read as a file ({exc.strerror or exc}); read it with exec"
            ) from None
    finally:
        os.close(fd)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _copy_into(fd: int, source: IO[bytes]) -> None:
    while piece := source.read(MAX_PAYLOAD):
        _write_all(fd, piece)


class AgentUnconfirmed(ProviderError):
    """A request the agent failed while it is alive (it answers a ping, or
    its keeper runs): nothing was restarted, so whatever the request was to
    do may or may not have been done."""


class AgentProcess(FutureExitProcess, PtyProcess):
    """One command the agent runs: a reader task turns its frames into chunks.
    On a PTY, what is typed goes as it comes (``write``), and the window size
    can change (``resize``)."""

    def __init__(
        self, runtime: AgentRuntime, channel: Channel, marker: str, pid: int,
        stdin: bytes | None, *, reusable: bool = False, keep_stdin: bool = False,
    ) -> None:
        self._runtime = runtime
        self._channel = channel
        self._marker = marker
        self._pid = pid
        loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[OutputChunk | BaseException | None] = asyncio.Queue()
        self._space = asyncio.Event()
        self._exit: asyncio.Future[int] = loop.create_future()
        self._exit_code: int | None = None
        self._oom_killed = False
        self._killing = False
        self._eof = False
        #: A plain command's connection serves again once it exits (see _pump).
        self._reusable = reusable
        self._tasks = [loop.create_task(self._pump())]
        #: What feeds the bytes given at the start (writes wait for it).
        self._fed: asyncio.Task[None] | None = None
        if stdin is not None:
            self._fed = loop.create_task(self._feed(stdin, close=not keep_stdin))
            self._tasks.append(self._fed)

    async def _feed(self, data: bytes, *, close: bool) -> None:
        with contextlib.suppress(AgentFailure):
            await self._send_input(data)
            if close:
                await self._channel.send({"t": "eof"})

    async def _send_input(self, data: bytes) -> None:
        view = memoryview(data)
        for start in range(0, len(view), MAX_PAYLOAD):
            await self._channel.send({"t": "in"}, view[start:start + MAX_PAYLOAD])

    async def _fed_first(self) -> None:
        if self._fed is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.shield(self._fed)

    async def write_stdin(self, data: bytes) -> None:
        await self._fed_first()
        if self._exit.done():
            raise StdinClosed("the command has ended")
        try:
            await self._send_input(data)
        except AgentFailure:
            raise StdinClosed("the command has ended (its connection closed)") from None

    async def close_stdin(self) -> None:
        await self._fed_first()
        with contextlib.suppress(AgentFailure):
            await self._channel.send({"t": "eof"})

    async def _put(self, item: OutputChunk | BaseException | None) -> None:
        while self._queue.qsize() >= _QUEUE_CHUNKS and not self._killing and item is not None:
            self._space.clear()
            await self._space.wait()
        if self._killing and isinstance(item, OutputChunk) and self._queue.qsize() >= _QUEUE_CHUNKS:
            return  # being killed, nobody reading: its last output is dropped
        self._queue.put_nowait(item)

    async def _pump(self) -> None:
        exited = False
        try:
            while True:
                header, payload = await self._channel.recv(EXEC_SILENCE_TIMEOUT)
                kind = header["t"]
                if kind == "out":
                    chunk = OutputChunk("stderr" if header.get("s") == 2 else "stdout", payload)
                    await self._put(chunk)
                elif kind == "exit":
                    code = int(number(header, "code"))
                    self._exit_code = code
                    self._oom_killed = header.get("oom") is True
                    if self._oom_killed and self._runtime.on_oom is not None:
                        self._runtime.on_oom()
                    if not self._exit.done():
                        self._exit.set_result(code)
                    exited = True
                    break
                elif kind != "hb":
                    raise AgentFailure(f"the agent sent {kind!r} while running a command")
        except AgentFailure as exc:
            if self._killing and self._exit.done():
                # Closed by a kill that settled the end itself (a frozen
                # sandbox's, see _kill_frozen): the output ends here.
                return
            # Closed on purpose (a kill that an orphan outlived): no fault of the agent's.
            failure = exc if self._killing else await self._runtime.failed(exc)
            if not self._exit.done():
                self._exit.set_exception(failure)
                self._exit.exception()  # retrieved here; wait() raises it again
            await self._put(failure)
        finally:
            reuse = exited and self._reusable and not self._killing
            if not reuse:
                self._channel.close()
            await self._put(None)
        if reuse:
            # Declared at the start (see start_process): the agent sends
            # nothing more for it, and serves the next request on it.
            self._runtime.keep(self._channel)

    async def read(self) -> OutputChunk | None:
        if self._eof:
            return None
        item = await self._queue.get()
        self._space.set()
        if item is None:
            self._eof = True
            return None
        if isinstance(item, BaseException):
            self._eof = True
            raise item
        return item

    async def write(self, data: bytes) -> None:
        view = memoryview(data)
        for start in range(0, len(view), MAX_PAYLOAD):
            await self._channel.send({"t": "in"}, view[start:start + MAX_PAYLOAD])

    async def resize(self, rows: int, cols: int) -> None:
        await self._channel.send({"t": "resize", "rows": rows, "cols": cols})

    async def kill(self, grace: float) -> None:
        if self._exit_code is None and self._runtime.frozen_here():
            # Also when its reader gave up on the frozen agent's silence: the
            # tree is still there, held.
            await self._kill_frozen(grace)
            return
        if self._exit.done():
            return
        self._killing = True
        self._space.set()
        # The agent answers once the whole tree is gone and reaped, or says
        # what outlived its bound (KillIncomplete, raised after the cleanup).
        incomplete: KillIncomplete | None = None
        try:
            await self._runtime.request(
                {"op": "kill", "pid": self._pid, "marker": f"{EXEC_MARKER}={self._marker}",
                 "grace": grace},
                ok, timeout=grace + REAP_SECONDS + ANSWER_TIMEOUT,
            )
        except KillIncomplete as exc:
            incomplete = exc
        except AgentUnconfirmed as exc:
            # Not answered is not done: an agent alive but stopped, or starved
            # of CPU, may not have sent a signal, and the tree may run on.
            incomplete = KillIncomplete(
                f"the sandbox's agent did not confirm the command's kill ({exc}); its "
                "processes may still be running and holding their share of the sandbox")
        except HutchError:
            pass
        with contextlib.suppress(TimeoutError, HutchError):
            await asyncio.wait_for(asyncio.shield(self._exit), 5)
        if not self._exit.done():
            self._channel.close()  # an orphan kept the output open: stop listening
        if incomplete is not None:
            raise incomplete

    async def _kill_frozen(self, grace: float) -> None:
        """The kill of a command in a sandbox held frozen (its user's pause),
        sent from this host: the frozen agent can neither answer nor signal
        until the thaw, but the tree's processes are this host's, and none
        forks while frozen, so one look finds them all. It answers once each
        has its SIGKILL, which ends it at the thaw before it runs again (see
        :meth:`ProcessTree.kill`; a thaw meanwhile is waited out as any kill).
        Its exit is then the SIGKILL's: the agent tells none until the thaw."""
        self._killing = True
        self._space.set()
        frozen = self._runtime.frozen_here
        tree = ProcessTree(f"{EXEC_MARKER}={self._marker}", held=frozen)
        try:
            await tree.kill(grace)
        finally:
            if not frozen():  # thawed meanwhile: the agent tells the exit
                with contextlib.suppress(TimeoutError, HutchError, AgentFailure):
                    await asyncio.wait_for(asyncio.shield(self._exit), 5)
            if not self._exit.done():
                self._exit_code = 128 + signal.SIGKILL
                self._exit.set_result(self._exit_code)
            self._channel.close()


class AgentWatch(BackendWatch):
    """A directory the agent watches, its events read off their connection."""

    def __init__(self, channel: Channel, sandbox_id: str) -> None:
        self._channel = channel
        self._sandbox_id = sandbox_id

    async def batch(self) -> list[FileEvent] | None:
        while True:
            try:
                header, _ = await self._channel.recv(EXEC_SILENCE_TIMEOUT)
            except AgentFailure as exc:
                self._channel.close()
                raise SandboxUnavailable(
                    f"the watch in sandbox {self._sandbox_id} ended: its agent went away "
                    f"({exc}); watch again once the sandbox runs"
                ) from None
            kind = header["t"]
            if kind == "hb":
                continue
            if kind == "end":
                self._channel.close()
                return None
            if kind == "err":
                self._channel.close()
                raise typed_error(header)
            events = header.get("events")
            if kind != "ev" or not isinstance(events, list):
                self._channel.close()
                raise ProviderError(f"the agent sent {kind!r} in a watch")
            return [file_event(e) for e in events]

    async def close(self) -> None:
        self._channel.close()


class AgentRuntime(SandboxRuntime):
    """A sandbox's runtime served by hutch's agent inside it."""

    runtime_name = "agent"
    watch_kind = "inotify"

    def __init__(
        self,
        sandbox_id: str,
        workdir: str,
        socket_path: str,
        *,
        provider_name: str,
        recover: Recover,
        default_user: str | None = None,
        on_oom: Callable[[], None] | None = None,
        connect: Callable[[], socket.socket] | None = None,
        frozen: Callable[[], bool] | None = None,
    ) -> None:
        super().__init__(sandbox_id, workdir)
        self.socket_path = socket_path
        #: How a connection is made, where the agent is not behind a socket
        #: file here (a pod's, through a relay): AgentFailure when it cannot be.
        self._connect_by = connect
        #: Told when the OOM killer ended a command (where the provider's own
        #: watch cannot see it: in the workload's cgroup).
        self.on_oom = on_oom
        self.provider_name = provider_name
        self.default_user = default_user
        self._recover = recover
        #: Whether the sandbox is held frozen (a pause) with its processes
        #: this host's to signal (see AgentProcess._kill_frozen).
        self._frozen = frozen
        self._idle: list[Channel] = []
        #: The agent keeps an exec's connection for the next request (its
        #: version, learnt from its ping, is 2 or later).
        self.keeps_exec_connections = False
        #: The agent hands open files' descriptors over (read and written
        #: here, not through the socket); not where its descriptors are not
        #: the host's (gVisor's user-space kernel): the bytes travel in frames.
        self.hands_over_fds = True
        #: Only processes on a CPU (running, or in uninterruptible I/O) keep
        #: the sandbox busy, not any alive: where a suspend keeps processes
        #: (gVisor's checkpoint), a server waiting for a connection costs
        #: nothing if suspended, while work in progress would be held up.
        self.busy_means_running = False

    def frozen_here(self) -> bool:
        """Whether the sandbox is held frozen with its processes this host's
        to signal: a kill then goes from here, not through the frozen agent."""
        return self._frozen is not None and self._frozen()

    # -- connections ----------------------------------------------------------------
    def _dial(self) -> socket.socket:
        if self._connect_by is not None:
            return self._connect_by()
        return connect_socket(self.socket_path)

    async def _connect(self) -> Channel:
        """A fresh connection; when there is none to be had, the provider is
        asked to bring the agent back and it is tried once more."""
        try:
            return Channel(self._dial())
        except AgentFailure as exc:
            await self._recover(str(exc))
        try:
            return Channel(self._dial())
        except AgentFailure as exc:
            raise await self.failed(exc) from None

    async def failed(self, exc: AgentFailure) -> HutchError:
        """The error a request ends with when the agent failed under it, once
        the provider has had its say (it raises if the sandbox is lost)."""
        self.drop_connections()
        try:
            restarted = await self._recover(str(exc))
        except HutchError as lost:
            return lost
        if restarted is False:
            return AgentUnconfirmed(
                f"{self.provider_name} sandbox {self.sandbox_id}: {exc} (its agent is alive: "
                "the request was too slow, or its connection broke)"
            )
        return ProviderError(
            f"{self.provider_name} sandbox {self.sandbox_id}: {exc}; its agent was restarted "
            "(commands running in it were lost); try again"
        )

    def _top_up(self) -> None:
        if self._idle:
            return
        try:
            self._idle.append(Channel(self._dial()))
        except AgentFailure:
            pass  # the next request finds out, and recovers

    async def warm(self) -> None:
        # The first process started in a sandbox costs about half a
        # millisecond more than any later one (measured: the same whichever
        # command it is, and whether or not a connection or a file request
        # came first): one that does nothing and exits pays it, leaving
        # nothing behind, and its connection is kept for the next request.
        self._top_up()
        with anyio.move_on_after(WARM_SECONDS):
            try:
                proc = await self.start_process(ProcessRequest(["true"], cwd="/"))
                while await proc.read() is not None:
                    pass
                await proc.wait()
            except HutchError as exc:
                log.info("%s sandbox %s: its warm-up command failed: %s",
                         self.provider_name, self.sandbox_id, exc)

    def keep(self, channel: Channel) -> None:
        """A connection in step with the agent, for the next request."""
        if channel.usable and len(self._idle) < POOL_SIZE:
            self._idle.append(channel)
        else:
            channel.close()

    def drop_connections(self) -> None:
        for channel in self._idle:
            channel.close()
        self._idle.clear()

    @contextlib.asynccontextmanager
    async def _channel(self) -> AsyncIterator[Channel]:
        channel = self._idle.pop() if self._idle else await self._connect()
        try:
            yield channel
        except AgentFailure as exc:
            channel.close()
            raise await self.failed(exc) from None
        except BaseException:
            channel.close()  # cancelled mid-answer: out of step
            raise
        self.keep(channel)

    async def request(
        self,
        header: Header,
        parse: Callable[[Header], T],
        *,
        timeout: float = ANSWER_TIMEOUT,
    ) -> T:
        """One request answered by one frame (or a typed error), read by
        ``parse``: an answer it cannot read is the agent's failure too."""
        async with self._channel() as channel:
            await channel.send(header)
            reply, _ = await self._answer(channel, timeout)
            return parse(reply)

    @staticmethod
    async def _answer(channel: Channel, timeout: float = ANSWER_TIMEOUT) -> tuple[Header, bytes]:
        """The next frame that is not a heartbeat; an ``err`` raises its typed error."""
        while True:
            header, payload = await channel.recv(timeout)
            if header["t"] == "hb":
                continue
            if header["t"] == "err":
                raise typed_error(header)
            return header, payload

    # -- processes -------------------------------------------------------------------
    def shell_argv(self, command: str) -> list[str]:
        return ["bash", "-c", command]  # the agent runs sh where there is no bash

    async def start_process(
        self, request: ProcessRequest, pty: tuple[int, int] | None = None
    ) -> AgentProcess:
        argv, stdin = request.argv, request.stdin
        marker = uuid.uuid4().hex
        # A command with no stdin and no PTY: the host sends nothing while it
        # runs, so an agent that can (version 2 on) keeps its connection for
        # the next request once the exit is sent.
        reuse = not request.stdin_piped and pty is None and self.keeps_exec_connections
        header: Header = {
            "op": "exec", "argv": list(argv), "cwd": request.cwd,
            "env": {**request.env, EXEC_MARKER: marker},
            "user": request.user or self.default_user or "",
            "stdin": request.stdin_piped or pty is not None,
            "shell_fallback": bool(argv) and argv[0] == "bash",
            "marker": f"{EXEC_MARKER}={marker}", "reuse": reuse,
        }
        if pty is not None:
            header["pty"] = {"rows": pty[0], "cols": pty[1]}
        # A kept connection, already accepted, saves the agent's accept on
        # this command's path.
        channel = self._idle.pop() if self._idle else await self._connect()
        try:
            await channel.send(header)
            reply, _ = await self._answer(channel)
            if reply["t"] != "started":
                raise AgentFailure(f"the agent answered an exec with {reply['t']!r}")
            pid = int(number(reply, "pid"))
        except AgentFailure as exc:
            channel.close()
            raise await self.failed(exc) from None
        except BaseException:
            channel.close()
            raise
        if not reuse:
            # Topped up once the command has started (a dial and an accept
            # beside its start would slow it). A kept connection comes back
            # when its command exits: the next request after it takes that.
            self._top_up()
        return AgentProcess(self, channel, marker, pid, stdin, reusable=reuse,
                            keep_stdin=request.keep_stdin)

    async def start_pty(self, request: ProcessRequest, rows: int, cols: int) -> AgentProcess:
        # What is typed is written: no stdin is fed.
        return await self.start_process(
            dataclasses.replace(request, stdin=None), pty=(rows, cols)
        )

    async def count_busy_processes(self) -> int:
        ask: dict[str, Any] = {"op": "busy"}
        if self.busy_means_running:
            ask["running"] = True
        return await self.request(ask, lambda r: max(0, int(number(r, "count"))))

    # -- files --------------------------------------------------------------------------
    async def read_file(self, path: str, limit: int) -> bytes:
        """The agent opens the file and hands its descriptor over: the bytes
        are read here, straight from the page cache, not through the socket."""
        async with self._channel() as channel:
            await channel.send(
                {"op": "read", "path": path, "limit": limit, "fd": self.hands_over_fds}
            )
            parts: list[bytes] = []
            total = 0
            while True:
                header, payload = await self._answer(channel)
                if header["t"] == "fd":
                    return await _read_handed_over(channel.take_fd(), path, limit)
                if header["t"] == "end":
                    return b"".join(parts)
                if header["t"] != "data":
                    raise AgentFailure(f"the agent sent {header['t']!r} in a read")
                total += len(payload)
                if total > limit:
                    channel.close()
                    raise OutputLimitExceeded(
                        f"{path} is over the read limit of {limit} bytes"
                    )
                parts.append(payload)

    async def read_file_pieces(self, path: str, limit: int) -> AsyncGenerator[bytes, None]:
        """The file in pieces of at most a frame's size, read here from the
        descriptor the agent hands over: never whole in memory."""
        if not self.hands_over_fds:
            yield await self.read_file(path, limit)
            return
        async with self._channel() as channel:
            await channel.send({"op": "read", "path": path, "limit": limit, "fd": True})
            header, _ = await self._answer(channel)
            if header["t"] != "fd":
                raise AgentFailure(f"the agent answered a read with {header['t']!r}")
            fd = channel.take_fd()
        try:
            size = _regular(fd).st_size
            if size > limit:
                raise OutputLimitExceeded(
                    f"{path} is {size} bytes, over the read limit of {limit} bytes"
                )
            offset = 0

            async def read() -> bytes:
                nonlocal offset
                piece = os.pread(fd, MAX_PAYLOAD, offset)
                offset += len(piece)
                return piece

            async for piece in bounded_pieces(read, path, limit):
                yield piece
        finally:
            os.close(fd)

    async def write_file(self, path: str, data: bytes) -> None:
        if len(data) > FD_WRITE_THRESHOLD and self.hands_over_fds:
            await self._write_through_fd(path, lambda fd: _write_all(fd, data), len(data))
            return
        view = memoryview(data)
        await self._write(path, (view[i:i + MAX_PAYLOAD] for i in range(0, len(view), MAX_PAYLOAD)))

    async def write_file_from(self, path: str, source: IO[bytes]) -> None:
        # Piece by piece from the source (an upload spooled to disk) into the
        # handed-over file: never the whole file in memory.
        if not self.hands_over_fds:
            await self._write(path, iter(lambda: source.read(MAX_PAYLOAD), b""))
            return
        await self._write_through_fd(path, lambda fd: _copy_into(fd, source), _THREAD_BYTES + 1)

    async def _write_through_fd(
        self, path: str, fill: Callable[[int], None], size: int
    ) -> None:
        """The agent makes the temporary file and hands its descriptor over;
        the bytes are written here (``fill``), and the agent puts it in place."""
        async with self._channel() as channel:
            await channel.send({"op": "write", "path": path, "fd": True})
            header, _ = await self._answer(channel)
            if header["t"] != "fd":
                raise AgentFailure(f"the agent answered a write with {header['t']!r}")
            fd = channel.take_fd()
            try:
                _regular(fd)
                if size > _THREAD_BYTES:
                    await anyio.to_thread.run_sync(fill, fd)
                else:
                    fill(fd)
            except OSError as exc:
                raise ProviderError(f"writing {path}: {exc.strerror or exc}") from None
            finally:
                os.close(fd)
            await channel.send({"t": "eof"})
            reply, _ = await self._answer(channel, ANSWER_TIMEOUT * 2)
            ok(reply)

    async def _write(self, path: str, pieces: Iterator[bytes | memoryview]) -> None:
        async with self._channel() as channel:
            await channel.send({"op": "write", "path": path})
            for piece in pieces:
                await channel.send({"t": "in"}, piece)
            await channel.send({"t": "eof"})
            reply, _ = await self._answer(channel, ANSWER_TIMEOUT * 2)
            ok(reply)

    async def stat(self, path: str) -> FileInfo:
        return await self.request({"op": "stat", "path": path}, file_info)

    async def list_dir(self, path: str) -> list[FileInfo]:
        return await self.request({"op": "list", "path": path}, listing)

    async def remove(self, path: str, recursive: bool) -> None:
        await self.request({"op": "remove", "path": path, "recursive": recursive}, ok,
                           timeout=ANSWER_TIMEOUT * 8)

    async def make_dir(self, path: str, parents: bool) -> None:
        try:
            await self.request({"op": "mkdir", "path": path, "parents": parents}, ok)
        except InvalidArgument as exc:
            if not predates(exc):
                raise
            await super().make_dir(path, parents)

    async def rename(self, source: str, destination: str) -> None:
        try:
            await self.request({"op": "rename", "src": source, "dst": destination}, ok)
        except CrossDevice:
            # Two file systems, or a directory of an overlay's lower layer
            # (the image's): mv in the sandbox copies it.
            await super().rename(source, destination)
        except InvalidArgument as exc:
            if not predates(exc):
                raise
            await super().rename(source, destination)

    async def watch(self, path: str, recursive: bool) -> BackendWatch:
        """By inotify, in the agent (``go/watch.go``), on a connection of its own."""
        channel = await self._connect()
        try:
            await channel.send({"op": "watch", "path": path, "recursive": recursive})
            reply, _ = await self._answer(channel)
            ok(reply)
        except InvalidArgument as exc:
            channel.close()
            if not predates(exc):
                raise
            return await super().watch(path, recursive)
        except AgentFailure as exc:
            channel.close()
            raise await self.failed(exc) from None
        except BaseException:
            channel.close()
            raise
        return AgentWatch(channel, self.sandbox_id)

    async def walk_files(self, root: str) -> list[str]:
        async with self._channel() as channel:
            await channel.send({"op": "walk", "root": root})
            paths: list[str] = []
            total = 0
            while True:
                header, payload = await self._answer(channel)
                if header["t"] == "end":
                    return paths
                if header["t"] != "data":
                    raise AgentFailure(f"the agent sent {header['t']!r} in a walk")
                total += len(payload)
                if total > MAX_WALK_BYTES:
                    channel.close()
                    raise OutputLimitExceeded(
                        f"the file list below {root} is over {MAX_WALK_BYTES} bytes"
                    )
                paths.extend(
                    p.decode("utf-8", "surrogateescape") for p in payload.split(b"\0") if p
                )

    async def grep(
        self, pattern: re.Pattern[str], root: str, glob: str | None, limit: int
    ) -> list[GrepMatch]:
        """The agent sends the text files that hold a literal every match must
        contain; their lines are matched by the one rule (grep_contents, in a
        worker process), in batches, as they come."""
        literals = required_literals(pattern)
        name = ""
        if glob and "/" not in glob and "[" not in glob and "\\" not in glob:
            name = glob  # a prefilter on names; the glob is checked again below
        matcher = compile_glob(glob) if glob else None
        prefix = root.rstrip("/") + "/"
        batches = GrepBatches(pattern)
        big: list[str] = []
        async with self._channel() as channel:
            await channel.send({
                "op": "grep", "root": root, "name": name, "literals": literals or [],
                "icase": bool(pattern.flags & re.IGNORECASE),
            })
            while True:
                header, payload = await self._answer(channel)
                kind = header["t"]
                if kind == "end":
                    break
                path = header.get("path")
                if kind not in ("file", "big") or not isinstance(path, str):
                    raise AgentFailure(f"the agent sent {kind!r} in a grep")
                if (matcher is not None and path.startswith(prefix)
                        and not matcher.match(path[len(prefix):])):
                    continue
                if kind == "big":
                    big.append(path)
                    continue
                await batches.add(path, payload)
        matches = await batches.matches()
        matches.extend(await self.grep_files(pattern, big, limit))
        return sorted(matches, key=lambda m: (m.path, m.line_number))

    async def place_workload(
        self, dirs: Mapping[str, str], timeout: float = ANSWER_TIMEOUT
    ) -> None:
        """Have the agent start every command in the workload's cgroups
        (``dirs``, by controller: see :mod:`.workload`). On a connection of its
        own, as a ping: called while the agent is brought up, and AgentFailure
        if it does not answer."""
        fds = open_task_files(dirs)
        channel: Channel | None = None
        try:
            channel = Channel(self._dial())
            await channel.send_fds({"op": "workload", "name": WORKLOAD_NAME}, fds)
            reply, _ = await channel.recv(timeout)
            if reply["t"] == "err":
                raise ProviderError(
                    f"{self.provider_name} sandbox {self.sandbox_id}: its agent could not "
                    f"enter the workload's cgroup: {str(reply.get('msg', ''))[:500]}"
                )
            ok(reply)
        finally:
            for fd in fds:
                os.close(fd)
            if channel is not None:
                channel.close()

    async def let_go(self, timeout: float = ANSWER_TIMEOUT) -> None:
        """An agent serving shared (under gVisor) closes its socket and every
        connection, its processes kept, until its sandbox wakes it again (a
        checkpoint refuses the host sockets it holds). AgentFailure where it
        did not say it would."""
        self.drop_connections()
        channel = Channel(self._dial())
        try:
            await channel.send({"op": "release"})
            reply, _ = await channel.recv(timeout)
            if reply["t"] != "ok":
                raise AgentFailure(f"the agent did not let go: {reply.get('message', '')}")
        finally:
            channel.close()

    async def ping(self, timeout: float = ANSWER_TIMEOUT) -> int:
        """The agent's pid, once it answers (AgentFailure if it does not)."""
        channel = Channel(self._dial())
        try:
            await channel.send({"op": "ping"})
            reply, _ = await channel.recv(timeout)
            if reply["t"] != "ok":
                raise AgentFailure("the agent did not answer a ping")
            version = str(reply.get("version", ""))
            self.keeps_exec_connections = version.isdigit() and int(version) >= 2
            return int(number(reply, "pid"))
        finally:
            channel.close()
