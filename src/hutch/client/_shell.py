"""PTYs through the daemon: ``Sandbox.pty`` on a remote sandbox, and
``hutch shell`` (a terminal attached to one).

The daemon's websocket route ``/v1/sandboxes/{id}/pty``: the client's first
message is text, JSON ``{"cmd", "cwd", "env", "user", "rows", "cols"}``; then
bytes typed go as binary messages and the terminal's output comes back as
binary messages; ``{"resize": [rows, cols]}`` changes the window; the last
text message says how it ended (``{"exit": code}`` or ``{"error": {...}}``).
"""

from __future__ import annotations

import json
import os
import select
import signal
import threading
from collections.abc import AsyncIterator, Iterator, Mapping
from contextlib import asynccontextmanager, contextmanager
from typing import Any
from urllib.parse import quote

from .._errors import HutchError, error_from_wire
from .._refwire import UNIX_HOST, unix_socket_of
from .._types import OutputChunk
from ._http import SESSION_HEADER, client_headers, client_url, raise_for_error, unreachable

#: The largest message either side sends (the daemon's own bound is the same).
MAX_MESSAGE = 16 * 1024 * 1024


def pty_start(
    cmd: str | list[str] | None, rows: int, cols: int, cwd: str | None,
    env: Mapping[str, str] | None, user: str | None,
) -> dict[str, Any]:
    return {"cmd": cmd, "rows": rows, "cols": cols, "cwd": cwd, "env": dict(env or {}),
            "user": user}


def _ws_headers(headers: Mapping[str, str]) -> dict[str, str]:
    """Of an HTTP client's headers, those a websocket handshake carries too (its
    own Connection, Upgrade and the like must not be overridden)."""
    wanted = {"authorization", SESSION_HEADER.lower()}
    return {k: v for k, v in headers.items() if k.lower() in wanted}


def _ws_url(base: str, sandbox_id: str) -> str:
    if unix_socket_of(base) is not None:
        base = f"http://{UNIX_HOST}"
    return "ws" + base[len("http"):] + f"/v1/sandboxes/{quote(sandbox_id, safe='')}/pty"


def _refused(base: str, exc: BaseException) -> HutchError:
    from websockets.exceptions import InvalidStatus

    if isinstance(exc, InvalidStatus):
        # The daemon answers a refused handshake with its error's status and body.
        status = exc.response.status_code
        try:
            raise_for_error(status, bytes(exc.response.body or b""))
        except HutchError as refused:
            return refused
        return HutchError(f"the daemon refused the terminal: HTTP {status}")
    return unreachable(base, exc if isinstance(exc, Exception) else Exception(str(exc)))


class _Ending:
    """How the remote terminal ended, from its last text message."""

    def __init__(self) -> None:
        self.code: int | None = None
        self.error: HutchError | None = None

    def absorb(self, text: str) -> None:
        try:
            ending = json.loads(text)
        except ValueError:
            return
        if not isinstance(ending, dict):
            return
        if isinstance(ending.get("exit"), int):
            self.code = ending["exit"]
        elif isinstance(ending.get("error"), dict):
            detail = ending["error"]
            self.error = error_from_wire(detail)

    def result(self, sandbox_id: str) -> int:
        if self.error is not None:
            raise self.error
        if self.code is None:
            raise HutchError(f"the terminal in sandbox {sandbox_id} ended without an exit status")
        return self.code


class AsyncRemotePty:
    """A remote sandbox's PTY from async code: what ``Sandbox.pty`` yields."""

    def __init__(self, ws: Any, sandbox_id: str) -> None:
        self._ws = ws
        self._sandbox_id = sandbox_id
        self._ending = _Ending()
        self._done = False

    async def read(self) -> OutputChunk | None:
        from websockets.exceptions import ConnectionClosed

        while not self._done:
            try:
                message = await self._ws.recv()
            except ConnectionClosed:
                self._done = True
                break
            if isinstance(message, bytes):
                return OutputChunk("stdout", message)
            self._ending.absorb(message)
        if self._ending.error is not None:
            raise self._ending.error
        return None

    async def write(self, data: bytes) -> None:
        await self._ws.send(bytes(data))

    async def resize(self, rows: int, cols: int) -> None:
        await self._ws.send(json.dumps({"resize": [rows, cols]}))

    async def wait(self) -> int:
        while await self.read() is not None:
            pass
        return self._ending.result(self._sandbox_id)

    async def kill(self, grace: float = 1.0) -> None:
        await self._ws.close()  # the daemon kills what runs on the terminal

    @property
    def returncode(self) -> int | None:
        return self._ending.code


class RemotePty:
    """A remote sandbox's PTY from sync code: what ``Sandbox.pty`` yields."""

    def __init__(self, ws: Any, sandbox_id: str) -> None:
        self._ws = ws
        self._sandbox_id = sandbox_id
        self._ending = _Ending()
        self._done = False

    def read(self, timeout: float | None = None) -> OutputChunk | None:
        from websockets.exceptions import ConnectionClosed

        while not self._done:
            try:
                message = self._ws.recv(timeout)
            except ConnectionClosed:
                self._done = True
                break
            if isinstance(message, bytes):
                return OutputChunk("stdout", message)
            self._ending.absorb(message)
        if self._ending.error is not None:
            raise self._ending.error
        return None

    def write(self, data: bytes) -> None:
        self._ws.send(bytes(data))

    def resize(self, rows: int, cols: int) -> None:
        self._ws.send(json.dumps({"resize": [rows, cols]}))

    def wait(self) -> int:
        while self.read() is not None:
            pass
        return self._ending.result(self._sandbox_id)

    def kill(self, grace: float = 1.0) -> None:
        self._ws.close()

    @property
    def returncode(self) -> int | None:
        return self._ending.code


@asynccontextmanager
async def open_async_pty(
    base: str, headers: Mapping[str, str], sandbox_id: str, start: dict[str, Any]
) -> AsyncIterator[AsyncRemotePty]:
    from websockets.asyncio.client import connect, unix_connect

    uds = unix_socket_of(base)
    opening = (
        connect(_ws_url(base, sandbox_id), additional_headers=_ws_headers(headers),
                max_size=MAX_MESSAGE) if uds is None else
        unix_connect(uds, _ws_url(base, sandbox_id), additional_headers=_ws_headers(headers),
                     max_size=MAX_MESSAGE)
    )
    try:
        ws = await opening.__aenter__()
    except Exception as exc:
        raise _refused(base, exc) from None
    try:
        await ws.send(json.dumps(start))
        yield AsyncRemotePty(ws, sandbox_id)
    finally:
        await opening.__aexit__(None, None, None)


@contextmanager
def open_sync_pty(
    base: str, headers: Mapping[str, str], sandbox_id: str, start: dict[str, Any]
) -> Iterator[RemotePty]:
    from websockets.sync.client import connect, unix_connect

    uds = unix_socket_of(base)
    try:
        ws = (
            connect(_ws_url(base, sandbox_id), additional_headers=_ws_headers(headers),
                    max_size=MAX_MESSAGE) if uds is None else
            unix_connect(uds, _ws_url(base, sandbox_id), additional_headers=_ws_headers(headers),
                         max_size=MAX_MESSAGE)
        )
    except Exception as exc:
        raise _refused(base, exc) from None
    with ws:  # closed on the way out, whatever happened
        ws.send(json.dumps(start))
        yield RemotePty(ws, sandbox_id)


def attach_shell(
    sandbox_id: str,
    *,
    url: str | None = None,
    token: str | None = None,
    stdin_fd: int = 0,
    stdout_fd: int = 1,
    size: tuple[int, int] = (24, 80),
    watch_window: bool = False,
) -> int:
    """Run an interactive shell in the sandbox on this process's terminal
    (``stdin_fd``/``stdout_fd``) until it exits; return its exit code. With
    ``watch_window``, a SIGWINCH resizes the remote terminal (main thread only)."""
    from websockets.exceptions import ConnectionClosed

    # A terminal that has not been sized says 0 x 0: the usual 24 x 80 then.
    rows, cols = min(size[0], 999) or 24, min(size[1], 999) or 80
    start = pty_start(None, rows, cols, None, None, None)
    base = client_url(url)
    with open_sync_pty(base, client_headers(token, base), sandbox_id, start) as term:
        stop = threading.Event()

        def typed() -> None:
            try:
                while not stop.is_set():
                    ready, _, _ = select.select([stdin_fd], [], [], 0.2)
                    if not ready:
                        continue
                    data = os.read(stdin_fd, 65536)
                    if not data:
                        return
                    term.write(data)
            except (OSError, ConnectionClosed):
                return

        previous: Any = None
        if watch_window:
            def resized(_signum: int, _frame: Any) -> None:
                now = os.get_terminal_size(stdout_fd)
                try:
                    term.resize(min(now.lines, 999) or 24, min(now.columns, 999) or 80)
                except ConnectionClosed:
                    pass

            previous = signal.signal(signal.SIGWINCH, resized)
        threading.Thread(target=typed, daemon=True).start()
        try:
            while (chunk := term.read()) is not None:
                os.write(stdout_fd, chunk.data)
            return term.wait()
        finally:
            stop.set()
            if watch_window:
                signal.signal(signal.SIGWINCH, previous)
