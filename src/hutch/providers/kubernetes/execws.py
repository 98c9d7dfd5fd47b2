"""Commands through ``pods/exec``: the WebSocket channel protocol
(``v5.channel.k8s.io``, ``v4`` as fallback), one session per command.

Each frame is one channel byte and its data: 0 stdin, 1 stdout, 2 stderr,
3 the final ``Status`` (JSON: ``Success``, or ``Failure`` with the exit code
as the ``ExitCode`` cause), 255 close (v5: ``255 0`` closes stdin). The
API's exec has no working directory, environment or user: a small ``sh``
prologue sets the first two; the exec marker in the environment lets a
second exec find and kill the command's processes (the API has no signals).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import TYPE_CHECKING, Any

from ..._errors import KillIncomplete, ProviderError, SandboxUnavailable, StdinClosed
from ..._lazy import lazy_module
from ..._types import OutputChunk
from .._hostproc import EXEC_MARKER
from ..base import FutureExitProcess, ProcessRequest

if TYPE_CHECKING:
    import httpx2
    from httpx2 import websockets as httpx2_websockets
else:  # imported at their first use: see hutch._lazy
    httpx2 = lazy_module("httpx2")
    httpx2_websockets = lazy_module("httpx2.websockets")

PROTOCOLS = ["v5.channel.k8s.io", "v4.channel.k8s.io"]
STDIN, STDOUT, STDERR, STATUS, CLOSE = 0, 1, 2, 3, 255
#: Checks what pods/exec cannot tell apart (a missing working directory,
#: user or command, a command not executable), says the outcome in one
#: line on stderr, sets the directory, environment and user, then becomes
#: the command. $1 cwd, $2 user (empty: the pod's), $3 how many NAME=VALUE
#: follow, then those and the argv.
_PROLOGUE = r"""
say() { printf '\036hutch-start:%s\n' "$1" >&2; }
cwd=$1 user=$2 n=$3; shift 3
if [ -n "$user" ] && ! id -u -- "$user" >/dev/null 2>&1; then say nouser; exit 126; fi
cd -- "$cwd" 2>/dev/null || { say nocwd; exit 126; }
i=0; for a in "$@"; do [ "$i" -eq "$n" ] && { cmd=$a; break; }; i=$((i+1)); done
case $cmd in
  */*) [ -e "$cmd" ] || { say notfound; exit 127; }
       { [ -x "$cmd" ] && [ ! -d "$cmd" ]; } || { say denied; exit 126; } ;;
  *) command -v -- "$cmd" >/dev/null 2>&1 || { say notfound; exit 127; } ;;
esac
say ok
if [ -n "$user" ]; then
  exec setpriv --reuid="$user" --regid="$(id -g -- "$user")" --init-groups env "$@"
fi
exec env "$@"
"""
START_MARK = b"\036hutch-start:"
#: Kills every process whose environment carries the marker given ($1):
#: SIGTERM, up to $2 tenths of a second for them to go, then SIGKILL rounds
#: until none is alive (what forked between a look and its kill, the next
#: look finds; a zombie's environ is empty), for at most 10 s: exit 3 says
#: some outlived it. Its own processes do not carry the marker.
KILL_TREE_OUTLIVED = 3
_KILL_MARKED = r"""
m=$1; grace=$2
marked() {
  for d in /proc/[0-9]*; do
    tr '\0' '\n' < "$d/environ" 2>/dev/null | grep -qxF -e "$m" && echo "${d#/proc/}"
  done
}
pids=$(marked); [ -z "$pids" ] && exit 0
kill -TERM $pids 2>/dev/null
i=0
while [ "$i" -lt "$grace" ]; do
  sleep 0.1; i=$((i + 1))
  pids=$(marked); [ -z "$pids" ] && exit 0
done
j=0
while pids=$(marked); [ -n "$pids" ]; do
  [ "$j" -ge 100 ] && exit 3
  kill -KILL $pids 2>/dev/null; sleep 0.1; j=$((j + 1))
done
exit 0
"""


def wrapped(request: ProcessRequest, exec_id: str, sandbox_env: dict[str, str]) -> list[str]:
    env = {**sandbox_env, **request.env, EXEC_MARKER: exec_id}
    return ["sh", "-c", _PROLOGUE, "hutch", request.cwd, request.user or "", str(len(env)),
            *(f"{k}={v}" for k, v in env.items()), *request.argv]


def kill_argv(exec_id: str, grace: float) -> list[str]:
    return ["sh", "-c", _KILL_MARKED, "hutch-kill", f"{EXEC_MARKER}={exec_id}",
            str(max(1, int(grace * 10)))]


def _described(exc: BaseException) -> str:
    """An exception for a person: a task group's own (the WebSocket session
    runs in one) rather than the group, and its kind when it says nothing."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return str(exc) or type(exc).__name__


def exit_code(status: dict[str, Any]) -> int:
    """The command's exit code from the final Status frame."""
    if status.get("status") == "Success":
        return 0
    for cause in (status.get("details") or {}).get("causes") or []:
        if cause.get("reason") == "ExitCode":
            return int(cause.get("message", "1"))
    raise ProviderError(f"the command did not run: {status.get('message') or status}")


class ExecSession(FutureExitProcess):
    """One command on one ``pods/exec`` WebSocket."""

    def __init__(self, *, stdin_open: bool, kill: Any) -> None:
        self._ws: Any = None
        self._v5 = False
        self._queue: asyncio.Queue[OutputChunk | BaseException | None] = asyncio.Queue(64)
        self._exit = asyncio.get_running_loop().create_future()
        self._exit_code: int | None = None
        self._oom_killed = False
        self._stdin_open = stdin_open
        self._kill = kill
        self._opened: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        #: The prologue's word on the start (ok, nocwd, notfound, ...), once said.
        self.started: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self._expect_mark = False
        self._pump_task: asyncio.Task[None] | None = None

    @classmethod
    async def open(cls, http: httpx2.AsyncClient, path: str, argv: list[str], *,
                   stdin: bytes | None, keep_stdin: bool, kill: Any,
                   marked: bool = False) -> ExecSession:
        params: list[tuple[str, str | int | float | bool | None]] = [
            ("command", a) for a in argv]
        params += [("container", "sandbox"), ("stdout", "true"), ("stderr", "true")]
        piped = stdin is not None or keep_stdin
        if piped:
            params.append(("stdin", "true"))
        session = cls(stdin_open=piped, kill=kill)
        session._expect_mark = marked
        # The WebSocket session lives in one task (httpx's sessions hold a
        # task group): the pump opens it, reads it, and closes it.
        session._pump_task = asyncio.ensure_future(
            session._pump(http, path, httpx2.QueryParams(params)))
        await asyncio.shield(session._opened)
        if stdin:
            await session.write_stdin(stdin)
        if piped and not keep_stdin:
            await session.close_stdin()
        return session

    async def _pump(self, http: httpx2.AsyncClient, path: str,
                    params: httpx2.QueryParams) -> None:
        code: int | BaseException = ProviderError("pods/exec ended without a status")
        try:
            async with http.websocket(path + "/exec", subprotocols=PROTOCOLS, params=params,
                                      keepalive_ping_interval_seconds=None) as ws:
                self._ws = ws
                self._v5 = ws.subprotocol == PROTOCOLS[0]
                self._opened.set_result(None)
                code = await self._frames(ws)
        except Exception as exc:  # it never opened, or the connection broke
            if not self._opened.done():
                self._opened.set_exception(
                    SandboxUnavailable(f"pods/exec failed: {_described(exc)}"))
                return
            code = ProviderError(f"pods/exec broke: {_described(exc)}")
        finally:
            self._stdin_open = False
            if not self.started.done():
                self.started.set_result("")
        if isinstance(code, BaseException):
            self._exit.set_exception(code)
        else:
            self._exit_code = code
            self._exit.set_result(code)
        await self._queue.put(None)

    async def _frames(self, ws: Any) -> int | BaseException:
        code: int | BaseException | None = None
        while True:
            try:
                frame = await ws.receive_bytes()
            except (httpx2_websockets.WebSocketDisconnect,
                    httpx2_websockets.WebSocketNetworkError) as closed:
                if code is not None:  # the Status came: the command's end is known
                    return code
                if not isinstance(closed, httpx2_websockets.WebSocketDisconnect):
                    return ProviderError(
                        "pods/exec's connection dropped before its status (no WebSocket close)")
                # No Status: the close's code and reason are all the API said.
                return ProviderError(
                    "pods/exec ended without a status (closed with code "
                    f"{closed.code}{': ' + closed.reason if closed.reason else ''})")
            if not frame:
                continue
            channel, data = frame[0], frame[1:]
            if channel == STDERR and self._expect_mark and not self.started.done():
                data = self._take_mark(bytes(data))
            if channel in (STDOUT, STDERR) and data:
                await self._queue.put(
                    OutputChunk("stdout" if channel == STDOUT else "stderr", bytes(data)))
            elif channel == STATUS:
                try:
                    code = exit_code(json.loads(data))
                except (ValueError, ProviderError) as exc:
                    code = exc

    def _take_mark(self, data: bytes) -> bytes:
        """The prologue's line taken off the front of stderr."""
        if data.startswith(START_MARK) and b"\n" in data:
            line, _, rest = data.partition(b"\n")
            self.started.set_result(line[len(START_MARK):].decode("ascii", "replace"))
            return rest
        return data

    @property
    def closes_stdin(self) -> bool:
        """Whether the command can be told its stdin ended (v5; v4 cannot)."""
        return self._v5

    async def read(self) -> OutputChunk | None:
        item = await self._queue.get()
        if item is None:
            self._queue.put_nowait(None)  # every later read ends too
        if isinstance(item, BaseException):
            raise item
        return item

    async def write_stdin(self, data: bytes) -> None:
        if not self._stdin_open:
            raise StdinClosed("the command's stdin is closed")
        view = memoryview(data)
        for start in range(0, len(view), 1 << 16):
            await self._ws.send_bytes(bytes([STDIN]) + bytes(view[start:start + (1 << 16)]))

    async def close_stdin(self) -> None:
        if not self._stdin_open:
            return
        self._stdin_open = False
        if self._v5:
            await self._ws.send_bytes(bytes([CLOSE, STDIN]))

    async def close(self) -> None:
        """The WebSocket closed, whatever runs: the API server ends the
        command's streams (it reads the end of its stdin)."""
        if self._pump_task is not None and not self._pump_task.done():
            if self._ws is not None:
                # A close frame first: the server ends its side at once
                # rather than wait out its close timeout for one.
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(self._ws.close(), 2)
            self._pump_task.cancel()
            with contextlib.suppress(BaseException):
                await self._pump_task
        if not self._exit.done():
            self._exit.set_exception(ProviderError("pods/exec closed"))
            self._exit.exception()  # retrieved: nobody need wait for it
        with contextlib.suppress(asyncio.QueueFull):
            self._queue.put_nowait(None)  # a reader waiting ends

    async def kill(self, grace: float) -> None:
        if self._kill is None:
            return
        # The whole tree, its leader ended or not (what it left running holds
        # its output open), gone before this answers, or said not to be.
        said = await self._kill(grace)
        with contextlib.suppress(asyncio.TimeoutError, Exception):
            await asyncio.wait_for(asyncio.shield(self._exit), 5)
        if said == KILL_TREE_OUTLIVED:
            raise KillIncomplete(
                "processes of the command outlived its kill by 10 s; they still hold "
                "their share of the pod")
