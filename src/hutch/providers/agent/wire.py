"""The agent's frames, on the host's side: everything that arrives is untrusted.

A frame is a 4-byte big-endian header length, a 4-byte big-endian payload
length, a JSON object and raw bytes. Lengths past the bounds, a header that is
not a JSON object, a connection that ends mid-frame or goes silent past its
deadline all become :class:`AgentFailure` (a ``provider_error``): the daemon
never buffers more than one bounded frame, never waits without a deadline.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import stat
import struct
from collections.abc import Awaitable, Callable
from typing import Any

from ..._errors import ProviderError

MAX_HEADER = 4 << 20
MAX_PAYLOAD = 1 << 20
#: How long a request waits for the agent's next frame. The agent answers
#: at once or beats a heartbeat every second (every two for a running command).
ANSWER_TIMEOUT = 3.0
EXEC_SILENCE_TIMEOUT = 6.0
#: Descriptors the agent may have handed over and not yet been asked for.
MAX_PENDING_FDS = 2
_ANCILLARY = socket.CMSG_SPACE(MAX_PENDING_FDS * 4)
#: As a plain int: ``socket.MSG_CTRUNC`` is an IntFlag, and ``flags & it``
#: builds a member each time (~1.7 us a frame, against ~20 ns).
_MSG_CTRUNC = int(socket.MSG_CTRUNC)
_LENGTHS = struct.Struct(">II")


class AgentFailure(ProviderError):
    """The agent did not answer as the protocol says: gone, wedged or garbled."""


Header = dict[str, Any]


def connect_socket(path: str) -> socket.socket:
    """A connected socket to the agent's socket file at ``path``.

    The file lives in a directory the sandbox can write to, so it is opened
    without following links and checked to be a socket before connecting
    through its descriptor: a link planted there (to the Docker socket, say)
    is refused, with no window between the check and the connect.
    """
    try:
        fd = os.open(path, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise AgentFailure(f"agent socket {path}: {exc.strerror}") from None
    try:
        if not stat.S_ISSOCK(os.fstat(fd).st_mode):
            raise AgentFailure(f"agent socket {path} is not a socket")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            sock.connect(f"/proc/self/fd/{fd}")
        except OSError as exc:
            sock.close()
            raise AgentFailure(f"agent socket {path}: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
    sock.setblocking(False)
    return sock


def encode(header: Header, payload: bytes | memoryview = b"") -> bytes:
    raw = json.dumps(header, separators=(",", ":")).encode()
    return b"".join((_LENGTHS.pack(len(raw), len(payload)), raw, payload))  # one copy


class Channel:
    """One connection to the agent: whole frames out, checked frames in."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._loop = asyncio.get_running_loop()
        self._buffer = bytearray()
        self._send_lock = asyncio.Lock()
        #: Descriptors that came with the frames read so far, in order.
        self._fds: list[int] = []
        self._waiting: asyncio.Future[None] | None = None
        self.closed = False
        #: A send failed on it: the agent stopped reading (it hung up once a
        #: command ended, say). What it sent before is still read; it is not
        #: kept for another request.
        self.send_failed = False

    @property
    def usable(self) -> bool:
        """Open, and in step with the agent for another request."""
        return not self.closed and not self.send_failed

    def _send_broke(self, exc: OSError) -> AgentFailure:
        # Not closed here: the frames the agent sent before it hung up (a
        # command's last output and its exit) wait in the receive queue, and
        # whoever reads them closes it. Closing would throw them away, and
        # the reader would see a broken connection where an answer was.
        self.send_failed = True
        return AgentFailure(f"the agent's connection broke: {exc}")

    def _check_open(self) -> None:
        if self.closed:
            raise AgentFailure("the agent's connection was closed")

    async def send(self, header: Header, payload: bytes | memoryview = b"") -> None:
        frame = encode(header, payload)
        async with self._send_lock:
            self._check_open()
            try:
                await self._loop.sock_sendall(self.sock, frame)
            except OSError as exc:
                raise self._send_broke(exc) from None

    async def send_fds(self, header: Header, fds: list[int]) -> None:
        """A frame with descriptors attached (the agent takes them with it)."""
        frame = encode(header)
        ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack(f"{len(fds)}i", *fds))]
        async with self._send_lock:
            self._check_open()
            try:
                # A small frame on a connection nothing else writes: the
                # kernel takes it whole, the descriptors with its first byte.
                sent = self.sock.sendmsg([frame], ancillary)
                if sent < len(frame):
                    await self._loop.sock_sendall(self.sock, frame[sent:])
            except OSError as exc:
                raise self._send_broke(exc) from None

    async def _readable(self) -> None:
        ready = self._loop.create_future()
        fd = self.sock.fileno()
        if fd < 0:
            raise AgentFailure("the agent's connection was closed")
        self._loop.add_reader(fd, lambda: None if ready.done() else ready.set_result(None))
        self._waiting = ready
        try:
            await ready
        finally:
            self._waiting = None
            self._loop.remove_reader(fd)

    def _take_fds(self, ancillary: list[tuple[int, int, bytes]]) -> None:
        for level, kind, data in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                usable = len(data) - len(data) % 4
                self._fds.extend(struct.unpack(f"{usable // 4}i", data[:usable]))
        if len(self._fds) > MAX_PENDING_FDS:
            self.close()
            raise AgentFailure("the agent handed over descriptors nobody asked for")

    async def _fill(self, size: int) -> None:
        while len(self._buffer) < size:
            want = max(size - len(self._buffer), 1 << 16)
            try:
                chunk, ancillary, flags, _ = self.sock.recvmsg(want, _ANCILLARY)
            except (BlockingIOError, InterruptedError):
                await self._readable()
                continue
            except OSError as exc:
                self.close()
                raise AgentFailure(f"the agent's connection broke: {exc}") from None
            if ancillary:
                self._take_fds(ancillary)
            if flags & _MSG_CTRUNC:
                self.close()
                raise AgentFailure("the agent handed over more descriptors than one frame holds")
            if not chunk:
                self.close()
                raise AgentFailure("the agent closed its connection mid-answer")
            self._buffer += chunk

    async def _recv(self) -> tuple[Header, bytes]:
        await self._fill(8)
        header_len, payload_len = _LENGTHS.unpack_from(self._buffer)
        if not 0 < header_len <= MAX_HEADER or payload_len > MAX_PAYLOAD:
            self.close()
            raise AgentFailure(
                f"the agent sent a frame out of bounds ({header_len}+{payload_len} bytes)"
            )
        total = 8 + header_len + payload_len
        await self._fill(total)
        raw = bytes(self._buffer[8:8 + header_len])
        payload = bytes(self._buffer[8 + header_len:total])
        del self._buffer[:total]
        try:
            header = json.loads(raw)
        except ValueError:
            header = None
        if not isinstance(header, dict) or not isinstance(header.get("t"), str):
            self.close()
            raise AgentFailure("the agent sent a malformed frame")
        return header, payload

    async def recv(
        self, timeout: float | None, *, held: Callable[[], Awaitable[bool]] | None = None
    ) -> tuple[Header, bytes]:
        """The next frame; AgentFailure if none comes within ``timeout``
        seconds, but while ``held`` says the agent is held frozen (a pause):
        its silence then is no failure, and the wait goes on."""
        while True:
            try:
                async with asyncio.timeout(timeout):  # no task of its own, as wait_for makes
                    # Restartable: what a timed-out read took stays in the buffer.
                    return await self._recv()
            except TimeoutError:
                if held is not None and await held():
                    continue
                self.close()
                raise AgentFailure(f"the agent did not answer within {timeout} s") from None

    def take_fd(self) -> int:
        """The descriptor that came with the frame just read (the caller owns it)."""
        if not self._fds:
            self.close()
            raise AgentFailure("the agent promised a descriptor and sent none")
        return self._fds.pop(0)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            if self._waiting is not None and not self._waiting.done():
                self._waiting.set_result(None)  # a reader waiting on it finds it closed
                self._loop.remove_reader(self.sock.fileno())
            self.sock.close()
            for fd in self._fds:
                os.close(fd)
            self._fds.clear()
