"""Commands in an E2B sandbox, through the SDK's own envd client.

The SDK's ``commands`` decode output as UTF-8 (replacing what is not), and
run every command through ``bash -l -c``; hutch keeps output as bytes and
runs an argv as it is, so the process service is driven with the SDK's
generated client (``e2b.envd.process``) and its transport, the one its
``commands`` use.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
from collections.abc import AsyncGenerator, Mapping
from typing import Any

from e2b.envd.client_async import as_stream, create_rpc_client
from e2b.envd.process import process_connect, process_pb
from protobuf import Oneof

from ..._errors import ProviderError, SandboxUnavailable
from ..._types import OutputChunk
from ..base import BackendProcess, ProcessRequest
from .errors import mapped

#: Bytes of stdin one SendInput carries.
STDIN_PIECE = 1 << 20


def user_header(user: str | None) -> dict[str, str]:
    """envd's way to name the user a call runs as (HTTP Basic, no password)."""
    if not user:
        return {}
    return {"Authorization": "Basic " + base64.b64encode(f"{user}:".encode()).decode()}


class Envd:
    """The process service of one E2B sandbox."""

    def __init__(self, sandbox: Any) -> None:
        self.rpc: Any = create_rpc_client(
            process_connect.ProcessClient, sandbox.envd_api_url, sandbox.connection_config)

    async def start(self, request: ProcessRequest) -> E2BProcess:
        argv = list(request.argv)
        events = as_stream(self.rpc.start(
            process_pb.StartRequest(
                process=process_pb.ProcessConfig(
                    cmd=argv[0], args=argv[1:], envs=dict(request.env), cwd=request.cwd),
                stdin=request.stdin_piped,
            ),
            headers=user_header(request.user),
            timeout_ms=0,
        ))
        with mapped(f"start {argv[0]}"):
            first = await events.__anext__()
        match first.event.event if first.event is not None else None:
            case Oneof(field="start", value=start):
                pid = int(start.pid)
            case _:
                raise ProviderError(f"E2B answered a start with {first}")
        process = E2BProcess(self, pid, events)
        if request.stdin:
            await process.write_stdin(request.stdin)
        if request.stdin is not None and not request.keep_stdin:
            await process.close_stdin()
        return process

    async def count(self) -> int:
        with mapped("list processes"):
            answer = await self.rpc.list(process_pb.ListRequest())
        return len(answer.processes)

    def selector(self, pid: int) -> Any:
        # The stubs type a oneof's field name as a Literal that a call cannot spell.
        return process_pb.ProcessSelector(selector=Oneof("pid", pid))  # type: ignore[arg-type]


class E2BProcess(BackendProcess):
    """A command's events, pumped from envd's stream by a task of its own:
    a reader hutch cancels (a timeout, a caller gone) waits on a queue, never
    inside the SDK's transport (which turns a cancellation into an error)."""

    def __init__(self, envd: Envd, pid: int, events: AsyncGenerator[Any, Any]) -> None:
        self.envd = envd
        self.pid = pid
        self._code: int | None = None
        self._done = False
        self._items: asyncio.Queue[OutputChunk | BaseException | None] = asyncio.Queue()
        self._pump = asyncio.get_running_loop().create_task(self._read_events(events))

    async def _read_events(self, events: AsyncGenerator[Any, Any]) -> None:
        try:
            with mapped(f"process {self.pid}"):
                async for event in events:
                    item = _item(event)
                    if isinstance(item, int):
                        self._code = item
                    elif item is not None:
                        self._items.put_nowait(item)
            if self._code is None:
                raise SandboxUnavailable(
                    f"E2B ended the stream of process {self.pid} before its exit")
            self._items.put_nowait(None)
        except Exception as exc:
            self._items.put_nowait(exc)
        finally:
            with contextlib.suppress(Exception):
                await events.aclose()

    async def read(self) -> OutputChunk | None:
        if self._done:
            return None
        item = await self._items.get()
        if isinstance(item, BaseException):
            self._done = True
            raise item
        if item is None:
            self._done = True
        return item

    async def wait(self) -> int:
        while await self.read() is not None:
            pass
        assert self._code is not None
        return self._code

    @property
    def returncode(self) -> int | None:
        return self._code

    async def kill(self, grace: float) -> None:
        if self._pump.done():
            return
        try:
            with mapped(f"kill process {self.pid}"):
                await self.envd.rpc.send_signal(process_pb.SendSignalRequest(
                    process=self.envd.selector(self.pid),
                    signal=process_pb.Signal.SIGKILL))
        except FileNotFoundError:
            pass  # it ended meanwhile

    async def write_stdin(self, data: bytes) -> None:
        for start in range(0, len(data), STDIN_PIECE):
            with mapped(f"stdin of process {self.pid}"):
                await self.envd.rpc.send_input(process_pb.SendInputRequest(
                    process=self.envd.selector(self.pid),
                    input=process_pb.ProcessInput(
                        input=Oneof("stdin", data[start:start + STDIN_PIECE]))))  # type: ignore[arg-type]

    async def close_stdin(self) -> None:
        with mapped(f"stdin of process {self.pid}"):
            await self.envd.rpc.close_stdin(process_pb.CloseStdinRequest(
                process=self.envd.selector(self.pid)))


def _item(event: Any) -> OutputChunk | int | None:
    """What one of envd's process events says: output, the exit code, or nothing."""
    match event.event.event if event.event is not None else None:
        case Oneof(field="data", value=data):
            match data.output:
                case Oneof(field="stdout", value=chunk) if chunk:
                    return OutputChunk("stdout", bytes(chunk))
                case Oneof(field="stderr", value=chunk) if chunk:
                    return OutputChunk("stderr", bytes(chunk))
                case Oneof(field="pty", value=chunk) if chunk:
                    return OutputChunk("stdout", bytes(chunk))
        case Oneof(field="end", value=end):
            return exit_code(end)
    return None


def exit_code(end: Any) -> int:
    """The exit code envd reports, a kill by signal N as 128 + N (envd says
    ``signal: killed`` with code -1 where hutch's own stand-in gives 128 + N)."""
    code = int(end.exit_code)
    if code >= 0:
        return code
    status = str(getattr(end, "status", "") or "")
    return 128 + _SIGNALS.get(status.removeprefix("signal: "), 9)


_SIGNALS: Mapping[str, int] = {"killed": 9, "terminated": 15, "interrupt": 2, "hangup": 1,
                               "aborted": 6, "segmentation fault": 11, "user defined signal 1": 10}
