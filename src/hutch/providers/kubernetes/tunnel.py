"""Connections to the pod's agent over one kept ``pods/exec``.

The API server reaches into a pod only through exec (and port-forward, which
needs a listening port the sandbox could reach too). So one exec runs
``hutch-agent relay SOCKET`` in the pod, and its stdin and stdout carry every
connection hutch makes to the agent (the framing is the relay's: see
``agent/go/relay.go``). Here each connection is a socket pair: the agent
runtime gets one end, as it would get a connection to a socket, and this
side moves the other end's bytes through the relay, within the credit each
side gives, so a slow reader holds back its own stream only.

When the exec ends (the connection broke, the API server went away, the pod
is gone) every connection through it ends, and the tunnel is down until the
provider opens a new one (the runtime asks it to, through its recover).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import struct
from collections.abc import Awaitable, Callable

from ..agent import AgentFailure
from .execws import ExecSession

log = logging.getLogger("hutch.kubernetes")

OPEN, DATA, CLOSE, CREDIT = 1, 2, 3, 4
#: How far ahead of its credit each side may send one stream (the relay's too).
WINDOW = 1 << 20
#: The largest payload of one frame (the relay's too).
MAX_FRAME = 1 << 16
#: Credit goes back in pieces of at least this much (the relay's too): a
#: credit frame after every answer would double the messages.
CREDIT_STEP = WINDOW // 4
_HEAD = struct.Struct(">IBI")
_CREDIT = struct.Struct(">I")


class _Stream:
    """One connection: ``near`` is the socket the runtime holds the other end of."""

    def __init__(self, stream_id: int, near: socket.socket) -> None:
        self.id = stream_id
        self.near = near
        #: Bytes this side may still send the relay.
        self.window = WINDOW
        self.credited = asyncio.Event()
        self.credited.set()
        #: What the relay sent, to be written to ``near``; None: it closed.
        self.inbound: asyncio.Queue[bytes | None] = asyncio.Queue()
        self.tasks: list[asyncio.Task[None]] = []
        self.closed = False
        #: Bytes the relay sent that this side has not credited back yet:
        #: never past the window (a relay that ignores its credit is cut off
        #: rather than buffered without bound).
        self.owed = 0


class AgentTunnel:
    """One relay exec, and the connections through it."""

    def __init__(self, session: ExecSession, on_down: Callable[[], None] | None = None) -> None:
        self._session = session
        #: Told once the tunnel is down (the runtime drops its idle connections:
        #: its next request then asks for a new tunnel rather than failing).
        self._on_down = on_down
        self._closers: set[asyncio.Task[None]] = set()
        self._loop = asyncio.get_running_loop()
        self._streams: dict[int, _Stream] = {}
        self._next_id = 1
        self._send_lock = asyncio.Lock()
        self.up = True
        #: Why it went down, once it did.
        self.reason = ""
        self._reader = self._loop.create_task(self._read())

    @classmethod
    async def open(cls, start: Callable[[], Awaitable[ExecSession]],
                   on_down: Callable[[], None] | None = None) -> AgentTunnel:
        return cls(await start(), on_down)

    # -- the runtime's side ----------------------------------------------------------
    def connect(self) -> socket.socket:
        """A new connection to the agent (AgentFailure when the tunnel is down)."""
        if not self.up:
            raise AgentFailure(f"the relay to the pod's agent is down: {self.reason}")
        mine, near = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        mine.setblocking(False)
        near.setblocking(False)
        stream = _Stream(self._next_id, near)
        self._next_id += 1
        self._streams[stream.id] = stream
        stream.tasks = [self._loop.create_task(self._outbound(stream)),
                        self._loop.create_task(self._inbound(stream))]
        return mine

    # -- frames ----------------------------------------------------------------------
    async def _send(self, stream_id: int, kind: int, payload: bytes = b"") -> None:
        frame = _HEAD.pack(stream_id, kind, len(payload)) + payload
        async with self._send_lock:
            await self._session.write_stdin(frame)

    async def _read(self) -> None:
        buffer = bytearray()
        try:
            while (chunk := await self._session.read()) is not None:
                if chunk.stream == "stderr":
                    log.warning("the pod's agent relay said: %s",
                                chunk.data.decode("utf-8", "replace").strip()[:500])
                    continue
                buffer += chunk.data
                while len(buffer) >= _HEAD.size:
                    stream_id, kind, size = _HEAD.unpack_from(buffer)
                    if size > MAX_FRAME:
                        raise AgentFailure("the relay sent a frame out of bounds")
                    if len(buffer) < _HEAD.size + size:
                        break
                    payload = bytes(buffer[_HEAD.size:_HEAD.size + size])
                    del buffer[:_HEAD.size + size]
                    self._take(stream_id, kind, payload)
            self.reason = "its exec ended"
        except Exception as exc:  # the exec broke, or the relay garbled
            self.reason = str(exc) or type(exc).__name__
        finally:
            self.up = False
            if self._session.returncode is None:
                with contextlib.suppress(Exception):
                    # Its end taken (a broken exec's error is the reason above).
                    await asyncio.wait_for(self._session.wait(), 1)
            for stream in list(self._streams.values()):
                self._drop(stream)
            if self._on_down is not None:
                self._on_down()

    def _take(self, stream_id: int, kind: int, payload: bytes) -> None:
        stream = self._streams.get(stream_id)
        if stream is None:
            return  # closed here already
        if kind == DATA:
            stream.owed += len(payload)
            if stream.owed > WINDOW:
                raise AgentFailure(f"the relay sent stream {stream_id} past its credit")
            stream.inbound.put_nowait(payload)
        elif kind == CLOSE:
            if payload:
                log.debug("relay stream %d closed: %s", stream_id, payload[:200])
            stream.closed = True
            stream.inbound.put_nowait(None)
        elif kind == CREDIT and len(payload) == _CREDIT.size:
            stream.window += _CREDIT.unpack(payload)[0]
            stream.credited.set()

    # -- one stream ------------------------------------------------------------------
    async def _outbound(self, stream: _Stream) -> None:
        """What the runtime writes, to the relay, within the credit given."""
        try:
            await self._send(stream.id, OPEN)
            while True:
                while stream.window <= 0:
                    stream.credited.clear()
                    await stream.credited.wait()
                data = await self._loop.sock_recv(stream.near, min(MAX_FRAME, stream.window))
                if not data:
                    break
                stream.window -= len(data)
                await self._send(stream.id, DATA, data)
            if not stream.closed:
                stream.closed = True
                await self._send(stream.id, CLOSE)
        except (OSError, AgentFailure, Exception):
            pass  # the tunnel went down: _read drops every stream
        finally:
            self._drop(stream)

    async def _inbound(self, stream: _Stream) -> None:
        """What the relay sends, to the runtime's end, credited once written."""
        uncredited = 0
        with contextlib.suppress(OSError, Exception):
            while (data := await stream.inbound.get()) is not None:
                await self._loop.sock_sendall(stream.near, data)
                uncredited += len(data)
                if uncredited >= CREDIT_STEP and self.up:
                    stream.owed -= uncredited
                    await self._send(stream.id, CREDIT, _CREDIT.pack(uncredited))
                    uncredited = 0
        # Closed by the relay (or the tunnel is down): the runtime's end
        # reads what came, then the end.
        with contextlib.suppress(OSError):
            stream.near.shutdown(socket.SHUT_WR)

    def _drop(self, stream: _Stream) -> None:
        """The stream ended: its socket closes once its last bytes are passed on."""
        if self._streams.pop(stream.id, None) is None:
            return
        stream.inbound.put_nowait(None)
        stream.credited.set()

        async def close_after_inbound() -> None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(stream.tasks[1]), 5)
            for task in stream.tasks:
                task.cancel()
            stream.near.close()

        task = self._loop.create_task(close_after_inbound())
        self._closers.add(task)
        task.add_done_callback(self._closers.discard)

    async def close(self) -> None:
        """The relay's exec ended, every connection with it."""
        self.up = False
        self.reason = "closed"
        if self._session.closes_stdin:
            with contextlib.suppress(Exception):
                await self._session.close_stdin()
                # The relay ends at the end of its stdin, and the exec with
                # it; v4 cannot say so: the WebSocket is closed from here.
                await asyncio.wait_for(asyncio.shield(self._reader), 2)
        self._reader.cancel()
        with contextlib.suppress(BaseException):
            await self._reader
        # The WebSocket closed too: on v4, which cannot close stdin, the
        # relay would otherwise run on (and its exec stay open) until the pod goes.
        with contextlib.suppress(Exception):
            await self._session.close()
