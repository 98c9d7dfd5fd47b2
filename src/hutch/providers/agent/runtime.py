"""The agent runtime: exec, processes, files, grep and glob through hutch's
agent inside the sandbox, on kept connections to its unix socket.

Written once for every provider that can run the agent (docker, bubblewrap).
The provider gives it the socket's host path, the user commands run as by
default, and a ``recover`` callback: when the agent is gone or wedged, the
provider finds out why and brings it back (or says the sandbox is lost); a
request that never reached the agent is then tried once more, one that did
fails with a ``provider_error`` naming what happened. Nothing here waits
without a deadline: the agent beats a heartbeat while it works. A command
it runs is an :class:`~.process.AgentProcess`, a watch an
:class:`~.watch.AgentWatch`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import re
import socket
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
    OutputLimitExceeded,
    ProviderError,
)
from ..._globmatch import compile_glob
from ..._types import FileInfo, GrepMatch
from .._grep import GrepBatches
from .._grepfilter import required_literals
from .._hostproc import EXEC_MARKER
from ..base import (
    ProcessRequest,
    SandboxRuntime,
    bounded_pieces,
)
from ..watching import BackendWatch
from .handover import THREAD_BYTES, copy_into, read_handed_over, regular_file, write_all
from .process import AgentProcess, AgentUnconfirmed
from .replies import (
    CrossDevice,
    file_info,
    listing,
    number,
    ok,
    predates,
    typed_error,
)
from .watch import AgentWatch
from .wire import ANSWER_TIMEOUT, MAX_PAYLOAD, AgentFailure, Channel, Header, connect_socket
from .workload import WORKLOAD_NAME, open_task_files

log = logging.getLogger("hutch.agent")

#: Idle connections kept for the next request.
POOL_SIZE = 8
#: How long a warm-up command may take (see AgentRuntime.warm).
WARM_SECONDS = 10.0
#: Paths one walk may send back, in bytes.
MAX_WALK_BYTES = 256 << 20
#: Past this size, a write hands the bytes over through a descriptor.
FD_WRITE_THRESHOLD = 64 << 10

#: The provider's answer to a failed agent: True (or None) when it brought
#: the agent back (restarted: what ran is gone), False when the agent still
#: answers (the failure was the request's: slow, or its connection); raises
#: when the sandbox is lost.
Recover = Callable[[str], Awaitable[bool | None]]
T = TypeVar("T")


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
        held_now: Callable[[], Awaitable[bool]] | None = None,
        signals_here: bool = False,
        cgroup: Callable[[], str | None] | None = None,
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
        #: Whether the sandbox is held frozen (a pause): its agent cannot answer.
        self._frozen = frozen
        #: The provider's own look at whether the sandbox is held now, where
        #: ``frozen`` knows only this program's pauses (gVisor's: another
        #: program on the host may have paused or resumed it since).
        self._held_now = held_now
        #: Its processes are this host's to signal (in its /proc, their
        #: environments readable here): a frozen sandbox's kill goes from here.
        self.signals_here = signals_here
        #: The host directory of the sandbox's cgroup (holding all its
        #: processes), where a kill from here looks for a command's.
        self._cgroup = cgroup
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

    def frozen(self) -> bool:
        """Whether the sandbox is held frozen (its user's pause, or hutch's):
        its agent can neither answer nor act until the thaw."""
        return self._frozen is not None and self._frozen()

    async def held(self) -> bool:
        """Whether the sandbox is held frozen now, asked before a command's
        kill: the provider's own look where it has one (``frozen`` may not
        know another program's pause), else :meth:`frozen`."""
        if self._held_now is not None:
            return await self._held_now()
        return self.frozen()

    def frozen_here(self) -> bool:
        """Whether the sandbox is held frozen with its processes this host's
        to signal: a kill then goes from here, not through the frozen agent."""
        return self.signals_here and self.frozen()

    def host_cgroup(self) -> str | None:
        """The host directory of the sandbox's cgroup, where a kill from this
        host looks for a command's processes; None where not known (every
        process of this host's is looked at)."""
        return None if self._cgroup is None else self._cgroup()

    async def leave_request(self, header: Header) -> bool:
        """Send ``header`` on a connection of its own and hang up: a frozen
        agent reads it when it runs again, and its answer goes to no one.
        False where it could not be sent."""
        try:
            channel = Channel(self._dial())
        except AgentFailure:
            return False
        try:
            with anyio.move_on_after(ANSWER_TIMEOUT):
                await channel.send(header)
                return True
            return False
        except AgentFailure:
            return False
        finally:
            channel.close()

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
                    return await read_handed_over(channel.take_fd(), path, limit)
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
            size = regular_file(fd).st_size
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
            await self._write_through_fd(path, lambda fd: write_all(fd, data), len(data))
            return
        view = memoryview(data)
        await self._write(path, (view[i:i + MAX_PAYLOAD] for i in range(0, len(view), MAX_PAYLOAD)))

    async def write_file_from(self, path: str, source: IO[bytes]) -> None:
        # Piece by piece from the source (an upload spooled to disk) into the
        # handed-over file: never the whole file in memory.
        if not self.hands_over_fds:
            await self._write(path, iter(lambda: source.read(MAX_PAYLOAD), b""))
            return
        await self._write_through_fd(path, lambda fd: copy_into(fd, source), THREAD_BYTES + 1)

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
                regular_file(fd)
                if size > THREAD_BYTES:
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
        return AgentWatch(channel, self.sandbox_id, self.held)

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
