"""envd's process service (``process.Process``) over hutch's sandboxes.

A command started through it is a hutch background command (or, with a
``pty``, a terminal) known by a number, its pid, as envd's callers name it.
It lives on its own, apart from the stream that started it: that stream (or
one made later by ``Connect``) only follows it, and a follower gone leaves it
running, as envd does. Its output is handed to the streams watching it as it
comes, from the moment each began to watch. The deadline of the ``Start``
call is the command's: at it the command's whole process tree is killed and
its streams end with ``deadline_exceeded``.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from ...._errors import HutchError
from ...._process import Process, kill_shielded
from ...._sandbox import Sandbox, forget_process
from ...._types import MAX_OUTPUT_LIMIT, ExitStatus, OutputChunk
from ....providers.base import PtyProcess
from .calls import Call
from .connect import (
    ConnectError,
    b64,
    connect_error,
    flag,
    member,
    submessage,
    text,
    uint,
    unb64,
)

#: Bytes of events a stream may fall behind by; past them it is cut off
#: (its end says so) rather than hold the command or the daemon's memory.
MAX_BACKLOG_BYTES = 32 * 1024 * 1024

#: Signals by the names envd's enum gives them (and their numbers).
SIGNALS = {"SIGNAL_SIGKILL": 9, "SIGNAL_SIGTERM": 15, 9: 9, 15: 15}

#: An event for followers: a ProcessEvent, or the error their stream ends with.
Item = dict[str, Any] | ConnectError


class Follower:
    """One stream's view of a command's events: those not yet sent. Handing
    them over never waits for the stream (a caller that reads slowly, or
    not at all, holds neither the command nor the others watching it)."""

    def __init__(self) -> None:
        self.backlog: collections.deque[tuple[Item, int]] = collections.deque()
        self.backlog_bytes = 0
        self.ready = asyncio.Event()
        self.gone = False

    def put(self, item: Item, size: int) -> None:
        if self.gone:
            return
        if self.backlog_bytes + size > MAX_BACKLOG_BYTES:
            self.backlog.clear()
            self.backlog_bytes = 0
            self.gone = True
            item, size = ConnectError(
                "resource_exhausted", f"the stream fell more than {MAX_BACKLOG_BYTES} bytes "
                "behind the command and was cut off (the command runs on: connect again)"), 0
        self.backlog.append((item, size))
        self.backlog_bytes += size
        self.ready.set()

    async def get(self) -> Item:
        while not self.backlog:
            self.ready.clear()
            await self.ready.wait()
        item, size = self.backlog.popleft()
        self.backlog_bytes -= size
        return item

    def leave(self) -> None:
        self.gone = True
        self.backlog.clear()
        self.backlog_bytes = 0


@dataclass
class EnvdProcess:
    """A command started through envd, with the streams watching it."""

    pid: int
    sandbox: Sandbox
    config: dict[str, Any]
    tag: str | None
    process: Process | None = None
    pty: PtyProcess | None = None
    followers: set[Follower] = field(default_factory=set)
    #: Set when its Start call's deadline killed it.
    expired: bool = False
    ended: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None
    deadline_task: asyncio.Task[None] | None = None

    def follow(self) -> Follower:
        follower = Follower()
        self.followers.add(follower)
        return follower

    def unfollow(self, follower: Follower) -> None:
        self.followers.discard(follower)
        follower.leave()

    def publish(self, item: Item, size: int = 0) -> None:
        """Hand ``item`` (of ``size`` bytes of output) to every stream watching."""
        for follower in list(self.followers):
            follower.put(item, size)

    def info(self) -> dict[str, Any]:
        out: dict[str, Any] = {"config": self.config, "pid": self.pid}
        if self.tag is not None:
            out["tag"] = self.tag
        return out

    async def kill(self) -> None:
        """End its whole process tree, and wait for it to be over."""
        if self.ended.is_set():
            return
        if self.process is not None:
            await self.process.kill()
        elif self.pty is not None:
            await kill_shielded(self.pty)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.ended.wait(), 30)

    async def expire(self) -> None:
        """Its Start call's deadline has passed: it is killed."""
        if not self.ended.is_set():
            self.expired = True
            await self.kill()

    def arm_deadline(self, seconds: float | None) -> None:
        if seconds is None:
            return

        async def at_deadline() -> None:
            await asyncio.sleep(seconds)
            await self.expire()

        self.deadline_task = asyncio.get_running_loop().create_task(at_deadline())

    def end_item(self, exit_code: int, *, oom_killed: bool = False) -> Item:
        if self.expired:
            return deadline_error(f"command {self.pid} ran past its deadline and was killed")
        end: dict[str, Any] = {"exited": True, "status": f"exit status {exit_code}"}
        if exit_code:
            end["exitCode"] = exit_code
            end["error"] = end["status"]
        if oom_killed:
            end["status"] = end["error"] = "signal: killed (out of memory)"
        return {"end": end}


def deadline_error(message: str) -> ConnectError:
    return ConnectError("deadline_exceeded", message)


class ProcessTable:
    """The commands envd has started, by sandbox and pid."""

    def __init__(self) -> None:
        self._by_sandbox: dict[str, dict[int, EnvdProcess]] = {}
        self._pids = itertools.count(1000)

    def of(self, sandbox: Sandbox) -> dict[int, EnvdProcess]:
        return self._by_sandbox.get(sandbox.id, {})

    def add(self, entry: EnvdProcess) -> None:
        self._by_sandbox.setdefault(entry.sandbox.id, {})[entry.pid] = entry

    def remove(self, entry: EnvdProcess) -> None:
        table = self._by_sandbox.get(entry.sandbox.id)
        if table is not None:
            table.pop(entry.pid, None)
            if not table:
                self._by_sandbox.pop(entry.sandbox.id, None)

    def new_pid(self) -> int:
        return next(self._pids)

    def find(self, sandbox: Sandbox, selector: dict[str, Any] | None) -> EnvdProcess:
        """The command a ProcessSelector names: ``{"pid"}`` or ``{"tag"}``."""
        if selector is None:
            raise ConnectError("invalid_argument", "process (a pid or a tag) is required")
        table = self.of(sandbox)
        tag = member(selector, "tag")
        if tag is not None:
            for entry in table.values():
                if entry.tag == tag:
                    return entry
            raise ConnectError("not_found", f"process with tag {tag!r} not found")
        pid = uint(selector, "pid")
        found = table.get(pid)
        if found is None:
            raise ConnectError("not_found", f"process with pid {pid} not found")
        return found

    async def close(self) -> None:
        """Kill what still runs (the server is stopping)."""
        for table in list(self._by_sandbox.values()):
            for entry in list(table.values()):
                await entry.kill()


# -- the service ---------------------------------------------------------------------------------


class ProcessService:
    def __init__(self, table: ProcessTable) -> None:
        self.table = table

    # Start and Connect: server streams ---------------------------------------------------
    async def start(self, call: Call, request: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        config = submessage(request, "process")
        if config is None:
            raise ConnectError("invalid_argument", "process (its cmd) is required")
        cmd = text(config, "cmd", required=True)
        args = member(config, "args") or []
        envs = member(config, "envs") or {}
        if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
            raise ConnectError("invalid_argument", "process.args must be a list of strings")
        if not isinstance(envs, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in envs.items()
        ):
            raise ConnectError("invalid_argument", "process.envs must map names to strings")
        cwd = text(config, "cwd") or None
        tag = member(request, "tag")
        if tag is not None and not isinstance(tag, str):
            raise ConnectError("invalid_argument", "tag must be a string")
        pty = submessage(request, "pty")
        stdin = flag(request, "stdin")
        entry = EnvdProcess(
            pid=self.table.new_pid(), sandbox=call.sandbox, tag=tag,
            config={"cmd": cmd, "args": args, "envs": envs, **({"cwd": cwd} if cwd else {})},
        )
        argv = [cmd, *args]
        follower = entry.follow()
        if pty is not None:
            size = submessage(pty, "size") or {}
            rows, cols = uint(size, "rows", default=24), uint(size, "cols", default=80)
            await self._start_pty(entry, call, argv, envs, cwd, rows, cols)
        else:
            await self._start_command(entry, call, argv, envs, cwd, stdin)
        self.table.add(entry)
        entry.arm_deadline(call.timeout)
        return self._events(entry, follower, call, kills=True)

    async def _start_command(
        self, entry: EnvdProcess, call: Call, argv: list[str], envs: dict[str, str],
        cwd: str | None, stdin: bool,
    ) -> None:
        process = await call.sandbox.start(
            argv, cwd=cwd, env=envs, user=call.user, output_limit=MAX_OUTPUT_LIMIT,
            keep_stdin=stdin,
        )
        entry.process = process

        async def pump() -> None:
            try:
                async for event in process.stream():
                    if isinstance(event, OutputChunk):
                        entry.publish({"data": {event.stream: b64(event.data)}}, len(event.data))
                    elif isinstance(event, ExitStatus):
                        entry.publish(entry.end_item(
                            event.exit_code, oom_killed=event.oom_killed))
            except HutchError as exc:
                entry.publish(
                    entry.end_item(-1) if entry.expired else connect_error(exc))
            finally:
                self._ended(entry)
                forget_process(entry.sandbox, process.id)

        entry.task = asyncio.get_running_loop().create_task(pump())

    async def _start_pty(
        self, entry: EnvdProcess, call: Call, argv: list[str], envs: dict[str, str],
        cwd: str | None, rows: int, cols: int,
    ) -> None:
        started: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        async def run() -> None:
            try:
                async with call.sandbox.pty(
                    argv, rows=rows, cols=cols, cwd=cwd, env=envs, user=call.user,
                ) as proc:
                    entry.pty = proc
                    started.set_result(None)
                    while (chunk := await proc.read()) is not None:
                        entry.publish({"data": {"pty": b64(chunk.data)}}, len(chunk.data))
                    code = await proc.wait()
                    entry.publish(entry.end_item(code))
            except BaseException as exc:
                if not started.done():
                    started.set_exception(exc)
                elif isinstance(exc, Exception):
                    entry.publish(connect_error(exc))
                else:
                    raise
            finally:
                self._ended(entry)

        entry.task = asyncio.get_running_loop().create_task(run())
        await started

    def _ended(self, entry: EnvdProcess) -> None:
        entry.ended.set()
        self.table.remove(entry)
        if entry.deadline_task is not None:
            entry.deadline_task.cancel()

    async def connect(self, call: Call, request: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        entry = self.table.find(call.sandbox, submessage(request, "process"))
        return self._events(entry, entry.follow(), call, kills=False)

    async def _events(
        self, entry: EnvdProcess, follower: Follower, call: Call, *, kills: bool,
    ) -> AsyncIterator[dict[str, Any]]:
        """A stream's messages: the start, the command's events as they come
        (keepalives between them when asked for), its end."""
        try:
            yield {"event": {"start": {"pid": entry.pid}}}
            while True:
                waits = [w for w in (call.keepalive, call.timeout) if w is not None]
                try:
                    item = await asyncio.wait_for(follower.get(), min(waits, default=None))
                except TimeoutError:
                    if call.deadline is not None and time.monotonic() >= call.deadline:
                        if kills:
                            await entry.expire()
                            raise deadline_error(
                                f"command {entry.pid} ran past its deadline and was killed"
                            ) from None
                        raise deadline_error(
                            f"the stream of command {entry.pid} reached its deadline "
                            "(the command still runs)"
                        ) from None
                    yield {"event": {"keepalive": {}}}
                    continue
                if isinstance(item, ConnectError):
                    raise item
                yield {"event": item}
                if "end" in item:
                    return
        finally:
            entry.unfollow(follower)

    # unary calls ------------------------------------------------------------------------------
    async def list(self, call: Call, request: dict[str, Any]) -> dict[str, Any]:
        return {"processes": [e.info() for e in self.table.of(call.sandbox).values()]}

    async def send_signal(self, call: Call, request: dict[str, Any]) -> dict[str, Any]:
        entry = self.table.find(call.sandbox, submessage(request, "process"))
        signal = member(request, "signal")
        if signal not in SIGNALS:
            raise ConnectError(
                "invalid_argument",
                f"signal must be SIGNAL_SIGKILL or SIGNAL_SIGTERM, got {signal!r}",
            )
        # hutch ends a command's whole tree: TERM, a grace, then KILL.
        await entry.kill()
        return {}

    async def send_input(self, call: Call, request: dict[str, Any]) -> dict[str, Any]:
        entry = self.table.find(call.sandbox, submessage(request, "process"))
        given = submessage(request, "input") or {}
        if member(given, "pty") is not None:
            if entry.pty is None:
                raise ConnectError("invalid_argument", f"process {entry.pid} has no terminal")
            await entry.pty.write(unb64(member(given, "pty"), "input.pty"))
            return {}
        data = unb64(member(given, "stdin") or "", "input.stdin")
        if entry.pty is not None:
            await entry.pty.write(data)
            return {}
        await self._write_stdin(entry, data)
        return {}

    async def _write_stdin(self, entry: EnvdProcess, data: bytes) -> None:
        if entry.process is None:
            raise ConnectError("failed_precondition", f"process {entry.pid} has no stdin")
        await entry.process.write_stdin(data)

    async def close_stdin(self, call: Call, request: dict[str, Any]) -> dict[str, Any]:
        entry = self.table.find(call.sandbox, submessage(request, "process"))
        if entry.pty is not None:
            await entry.pty.write(b"\x04")  # a terminal's end of input
        elif entry.process is not None:
            await entry.process.close_stdin()
        return {}

    async def update(self, call: Call, request: dict[str, Any]) -> dict[str, Any]:
        entry = self.table.find(call.sandbox, submessage(request, "process"))
        pty = submessage(request, "pty")
        if pty is None:
            return {}
        if entry.pty is None:
            raise ConnectError("invalid_argument", f"process {entry.pid} has no terminal")
        size = submessage(pty, "size") or {}
        await entry.pty.resize(uint(size, "rows", default=24), uint(size, "cols", default=80))
        return {}

    async def stream_input(
        self, call: Call, requests: AsyncIterator[dict[str, Any]],
    ) -> dict[str, Any]:
        """Input in pieces: a ``start`` naming the command, then ``data``
        (and ``keepalive``) messages, until the client ends its stream."""
        entry: EnvdProcess | None = None
        async for message in requests:
            start = submessage(message, "start")
            data = submessage(message, "data")
            if start is not None:
                entry = self.table.find(call.sandbox, submessage(start, "process"))
            elif data is not None:
                if entry is None:
                    raise ConnectError(
                        "invalid_argument", "StreamInput begins with a start message")
                await self.send_input(call, {"process": {"pid": entry.pid},
                                             "input": submessage(data, "input") or {}})
        return {}

    def unary(self) -> dict[str, Callable[[Call, dict[str, Any]], Any]]:
        return {
            "List": self.list, "SendSignal": self.send_signal, "SendInput": self.send_input,
            "CloseStdin": self.close_stdin, "Update": self.update,
        }

    def streams(self) -> dict[str, Callable[[Call, dict[str, Any]], Any]]:
        return {"Start": self.start, "Connect": self.connect}
