"""The SDK's requests reach the daemon in as few writes as their size allows.

A request's head and a small body go out in one write (the daemon's server
wakes once for them, not twice); a large body still streams, a bounded piece
at a time. The real client against the real daemon is watched under strace
(its write syscalls, not timing); the client's network backend is also
driven directly against a plain HTTP/1.1 server, counting the writes that
reach the socket and the memory a 100 MB upload takes.
"""

from __future__ import annotations

import asyncio
import glob
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import tracemalloc
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from typing import Any

import h11
import httpcore
import httpx
import pytest

from hutch.client._coalesce import (
    WRITE_BOUND,
    AsyncCoalescingBackend,
    AsyncCoalescingStream,
    AsyncPoolTransport,
    CoalescingBackend,
    CoalescingStream,
    PoolTransport,
)
from tests.daemon_fixture import DaemonProcess

#: What the client reads from a file at a time for an upload (client._transports).
SEND_PIECE = 1024 * 1024
#: A chunk's framing in a chunked body: its length in hex, and two line ends.
CHUNK_FRAMING = 16

METHODS = (b"GET ", b"POST ", b"PUT ", b"DELETE ", b"PATCH ")


# -- the real client and daemon, under strace -------------------------------------------

CLIENT_SCRIPT = textwrap.dedent("""
    import asyncio, io, sys, tempfile
    import hutch

    url, token, face, workdir = sys.argv[1:5]
    UPLOAD = 5 * 1024 * 1024 + 123

    def sync_calls():
        with hutch.Client(url, token=token) as client:
            sandbox = client.create_sandbox("local", workdir=workdir)
            assert sandbox.exec(["echo", "hi"]).stdout == "hi\\n"
            sandbox.write_bytes("small", b"s" * 3000)
            sandbox.write_from("large", io.BytesIO(b"L" * UPLOAD))
            assert len(sandbox.read_bytes("large")) == UPLOAD
            sandbox.close()

    async def async_calls():
        async with hutch.AsyncClient(url, token=token) as client:
            sandbox = await client.create_sandbox("local", workdir=workdir)
            assert (await sandbox.exec(["echo", "hi"])).stdout == "hi\\n"
            await sandbox.write_bytes("small", b"s" * 3000)
            await sandbox.write_from("large", io.BytesIO(b"L" * UPLOAD))
            assert len(await sandbox.read_bytes("large")) == UPLOAD
            await sandbox.close()

    sync_calls() if face == "sync" else asyncio.run(async_calls())
""")

TS_CLIENT_SCRIPT = """
import { pathToFileURL } from "node:url";
const [sdkPath, workdir] = process.argv.slice(1);
const { Client } = await import(pathToFileURL(sdkPath).href);
const UPLOAD = 5 * 1024 * 1024 + 123;
const sandbox = await new Client().createSandbox("local", { workdir });
if ((await sandbox.exec(["echo", "hi"])).stdout !== "hi\\n") throw new Error("exec");
await sandbox.writeBytes("small", new Uint8Array(3000).fill(115));
async function* pieces() {
  for (let sent = 0; sent < UPLOAD; sent += 1024 * 1024) {
    yield new Uint8Array(Math.min(1024 * 1024, UPLOAD - sent)).fill(76);
  }
}
await sandbox.writeFrom("large", pieces());
if ((await sandbox.readBytes("large")).length !== UPLOAD) throw new Error("read back");
await sandbox.close();
"""

#: A write syscall to a loopback TCP port as ``strace -xx -yy`` shows it.
_WRITE = re.compile(
    r'^(?P<call>write|sendto|sendmsg|writev)\((?P<fd>\d+)'
    r'<TCP:\[[^\]]*->127\.0\.0\.1:(?P<port>\d+)\]>, '
    r'(?P<args>.*)\) += (?P<sent>-?\d+)'
)
#: A buffer's bytes as ``-xx`` prints them, and the length strace gives after it.
_BUFFER = re.compile(r'"(?P<data>(?:\\x[0-9a-f]{2})*)"(?:\.\.\.)?(?:, iov_len=|, )(?P<size>\d+)')


def socket_writes(trace_prefix: str, port: int) -> list[tuple[bytes, int]]:
    """Each write syscall to the daemon's port (write, send, writev), in each
    thread's order: its first bytes, and how many bytes it asked to send."""
    writes = []
    for path in sorted(glob.glob(trace_prefix + ".*")):
        with open(path, encoding="ascii") as fh:
            for line in fh:
                match = _WRITE.match(line)
                if match is None or int(match["port"]) != port:
                    continue
                assert match["call"] != "sendmsg", line  # never seen: its iovecs are deeper
                buffers = _BUFFER.findall(match["args"])
                assert buffers, line
                data = b"".join(bytes.fromhex(d.replace("\\x", "")) for d, _ in buffers)
                writes.append((data, sum(int(size) for _, size in buffers)))
    return writes


def requests_of(writes: list[tuple[bytes, int]]) -> list[tuple[bytes, list[int]]]:
    """The requests written: each one's head and body as written, and the
    sizes of the writes that carried it."""
    requests: list[tuple[bytes, list[int]]] = []
    for data, size in writes:
        if data.startswith(METHODS):
            requests.append((data, [size]))
        else:
            assert requests, f"a write before any request: {data[:80]!r}"
            requests[-1][1].append(size)
    return requests


def content_length(head: bytes) -> int | None:
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value)
    return None


@pytest.fixture(scope="module")
def daemon() -> Iterator[DaemonProcess]:
    d = DaemonProcess().start()
    yield d
    d.close()


def traced_requests(daemon: DaemonProcess, command: list[str]) -> list[tuple[bytes, list[int]]]:
    """Run ``command`` (a client, given a working directory as its last
    argument) under strace, and the requests it wrote to the daemon."""
    scratch = tempfile.mkdtemp(prefix="hutch-writes-")
    try:
        prefix = os.path.join(scratch, "trace")
        workdir = os.path.join(scratch, "work")
        os.mkdir(workdir)
        run = subprocess.run(
            ["strace", "-f", "-ff", "-xx", "-yy", "-s", "8192", "-o", prefix,
             "-e", "trace=write,sendto,sendmsg,writev", "-e", "signal=none", *command, workdir],
            capture_output=True, text=True, timeout=300,
            env=dict(os.environ, HUTCH_URL=daemon.url, HUTCH_TOKEN=daemon.token),
        )
        assert run.returncode == 0, run.stderr[-3000:]
        return requests_of(socket_writes(prefix, daemon.port))
    finally:
        shutil.rmtree(scratch)


def assert_written_whole(requests: list[tuple[bytes, list[int]]]) -> None:
    """Every request with a small body went out in the write of its head; the
    one upload (chunked, 5 MB) in pieces of about a MB, never held whole."""
    assert len(requests) >= 6, requests
    uploads = 0
    for data, sizes in requests:
        head, _, body = data.partition(b"\r\n\r\n")
        length = content_length(head)
        line = head.split(b"\r\n")[0].decode()
        if length is not None and len(head) + 4 + length <= WRITE_BOUND:
            assert sizes == [len(head) + 4 + length], (line, sizes)
            assert len(body) == length, line
        elif b"transfer-encoding: chunked" in head.lower():
            uploads += 1
            assert len(sizes) >= 5, (line, sizes)
            # A piece, its chunk's framing, and (in one) the head.
            assert max(sizes) <= SEND_PIECE + CHUNK_FRAMING + len(head) + 4, (line, sizes)
        else:
            assert sizes == [len(head) + 4] and not body, (line, sizes)
    assert uploads == 1


needs_strace = pytest.mark.skipif(shutil.which("strace") is None, reason="strace is not installed")


@needs_strace
@pytest.mark.parametrize("face", ["sync", "async"])
def test_sdk_request_head_and_small_body_go_in_one_write(daemon: DaemonProcess, face: str) -> None:
    requests = traced_requests(
        daemon, [sys.executable, "-c", CLIENT_SCRIPT, daemon.url, daemon.token, face])
    assert_written_whole(requests)


@needs_strace
def test_typescript_sdk_request_head_and_small_body_go_in_one_write(
        daemon: DaemonProcess) -> None:
    """Node's http module sends a request's head with a body given whole (a
    writev), and a streamed body's pieces as they come: held to it here."""
    from tests.test_typescript_sdk import build_sdk

    sdk = build_sdk() / "dist" / "index.js"
    requests = traced_requests(
        daemon, ["node", "--input-type=module", "-e", TS_CLIENT_SCRIPT, str(sdk)])
    assert_written_whole(requests)


# -- the network backend against a plain HTTP/1.1 server ---------------------------------


class PlainServer:
    """An HTTP/1.1 server on a unix socket or loopback TCP (a thread per
    connection): it reads each request whole and answers with the size of
    its body. ``early`` answers 413 after the head and closes, unread."""

    def __init__(self, family: int, *, early: bool = False) -> None:
        self.scratch = tempfile.mkdtemp(prefix="hutch-plain-")
        self.listener = socket.socket(family, socket.SOCK_STREAM)
        if family == socket.AF_UNIX:
            self.uds: str | None = os.path.join(self.scratch, "s")
            self.listener.bind(self.uds)
            self.base = "http://server"
        else:
            self.uds = None
            self.listener.bind(("127.0.0.1", 0))
            self.base = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.listener.listen()
        self.early = early
        self.threads: list[threading.Thread] = []
        self.accepting = threading.Thread(target=self.accept, daemon=True)
        self.accepting.start()

    def accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            thread = threading.Thread(target=self.serve, args=(conn,), daemon=True)
            self.threads.append(thread)
            thread.start()

    def serve(self, conn: socket.socket) -> None:
        http = h11.Connection(h11.SERVER)
        received = 0
        with conn:
            while True:
                event = http.next_event()
                if event is h11.NEED_DATA:
                    data = conn.recv(1024 * 1024)
                    if not data:
                        return
                    http.receive_data(data)
                elif isinstance(event, h11.Request) and self.early:
                    answer = b'{"error":"too large"}'
                    conn.sendall(http.send(h11.Response(status_code=413, headers=[
                        ("content-length", str(len(answer))), ("connection", "close")])))
                    conn.sendall(http.send(h11.Data(data=answer)))
                    conn.shutdown(socket.SHUT_WR)
                    return
                elif isinstance(event, h11.Data):
                    received += len(event.data)
                elif isinstance(event, h11.EndOfMessage):
                    answer = b'{"received":%d}' % received
                    conn.sendall(http.send(h11.Response(status_code=200, headers=[
                        ("content-length", str(len(answer)))])))
                    conn.sendall(http.send(h11.Data(data=answer)) + http.send(h11.EndOfMessage()))
                    http.start_next_cycle()
                    received = 0
                elif isinstance(event, h11.ConnectionClosed):
                    return

    def close(self) -> None:
        self.listener.shutdown(socket.SHUT_RDWR)
        self.listener.close()
        self.accepting.join(10)
        for thread in self.threads:
            thread.join(10)
        shutil.rmtree(self.scratch)


@pytest.fixture(params=[socket.AF_UNIX, socket.AF_INET], ids=["unix", "tcp"])
def server(request: pytest.FixtureRequest) -> Iterator[PlainServer]:
    s = PlainServer(request.param)
    yield s
    s.close()


class Counted:
    """What reached the socket: the size of each write, and the most bytes a
    coalescing stream held after any write."""

    def __init__(self) -> None:
        self.writes: list[int] = []
        self.most_held = 0

    def reached_socket(self, stream: object, buffer: bytes) -> None:
        self.writes.append(len(buffer))

    def held_after(self, stream: object, buffer: bytes) -> None:
        assert isinstance(stream, AsyncCoalescingStream | CoalescingStream)
        self.most_held = max(self.most_held, stream.held.size)


WriteSeen = Callable[[Any, bytes], None]


class AsyncRelayStream(httpcore.AsyncNetworkStream):
    """A stream passed through, telling ``seen`` of each write once it is done."""

    def __init__(self, stream: httpcore.AsyncNetworkStream, seen: WriteSeen) -> None:
        self.stream, self.seen = stream, seen

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        await self.stream.write(buffer, timeout)
        self.seen(self.stream, buffer)

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return await self.stream.read(max_bytes, timeout)

    async def aclose(self) -> None:
        await self.stream.aclose()

    def get_extra_info(self, info: str) -> Any:
        return self.stream.get_extra_info(info)


class AsyncRelayBackend(httpcore.AsyncNetworkBackend):
    def __init__(self, backend: httpcore.AsyncNetworkBackend, seen: WriteSeen) -> None:
        self.backend, self.seen = backend, seen

    async def connect_tcp(self, host: str, port: int, timeout: float | None = None,
                          local_address: str | None = None,
                          socket_options: Iterable[Any] | None = None,
                          ) -> httpcore.AsyncNetworkStream:
        stream = await self.backend.connect_tcp(host, port, timeout, local_address, socket_options)
        return AsyncRelayStream(stream, self.seen)

    async def connect_unix_socket(self, path: str, timeout: float | None = None,
                                  socket_options: Iterable[Any] | None = None,
                                  ) -> httpcore.AsyncNetworkStream:
        stream = await self.backend.connect_unix_socket(path, timeout, socket_options)
        return AsyncRelayStream(stream, self.seen)

    async def sleep(self, seconds: float) -> None:
        await self.backend.sleep(seconds)


class RelayStream(httpcore.NetworkStream):
    def __init__(self, stream: httpcore.NetworkStream, seen: WriteSeen) -> None:
        self.stream, self.seen = stream, seen

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self.stream.write(buffer, timeout)
        self.seen(self.stream, buffer)

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return self.stream.read(max_bytes, timeout)

    def close(self) -> None:
        self.stream.close()

    def get_extra_info(self, info: str) -> Any:
        return self.stream.get_extra_info(info)


class RelayBackend(httpcore.NetworkBackend):
    def __init__(self, backend: httpcore.NetworkBackend, seen: WriteSeen) -> None:
        self.backend, self.seen = backend, seen

    def connect_tcp(self, host: str, port: int, timeout: float | None = None,
                    local_address: str | None = None,
                    socket_options: Iterable[Any] | None = None) -> httpcore.NetworkStream:
        stream = self.backend.connect_tcp(host, port, timeout, local_address, socket_options)
        return RelayStream(stream, self.seen)

    def connect_unix_socket(self, path: str, timeout: float | None = None,
                            socket_options: Iterable[Any] | None = None,
                            ) -> httpcore.NetworkStream:
        return RelayStream(self.backend.connect_unix_socket(path, timeout, socket_options),
                           self.seen)


def async_backend(counted: Counted) -> httpcore.AsyncNetworkBackend:
    """httpcore, then a watch on what the coalescing stream holds, then it,
    then a count of what reaches the socket, then the socket."""
    below = AsyncRelayBackend(httpcore.AnyIOBackend(), counted.reached_socket)
    return AsyncRelayBackend(AsyncCoalescingBackend(below), counted.held_after)


def sync_backend(counted: Counted) -> httpcore.NetworkBackend:
    below = RelayBackend(httpcore.SyncBackend(), counted.reached_socket)
    return RelayBackend(CoalescingBackend(below), counted.held_after)


def sync_send(server: PlainServer, requests: list[httpx.Request]) -> tuple[Counted, list[Any]]:
    counted = Counted()
    transport = PoolTransport(server.base, server.uds, sync_backend(counted))
    answers = []
    try:
        for request in requests:
            response = transport.handle_request(request)
            answers.append((response.status_code, response.read()))
            response.close()
    finally:
        transport.close()
    return counted, answers


def async_send(server: PlainServer, requests: list[httpx.Request]) -> tuple[Counted, list[Any]]:
    async def main() -> list[Any]:
        transport = AsyncPoolTransport(server.base, server.uds, async_backend(counted))
        answers = []
        try:
            for request in requests:
                response = await transport.handle_async_request(request)
                answers.append((response.status_code, await response.aread()))
                await response.aclose()
        finally:
            await transport.aclose()
        return answers

    counted = Counted()
    return counted, asyncio.run(main())


SENDERS = {"sync": sync_send, "async": async_send}


@pytest.mark.parametrize("face", ["sync", "async"])
def test_small_requests_reach_the_socket_in_one_write_each(server: PlainServer, face: str) -> None:
    requests = [
        httpx.Request("POST", server.base + "/v1/sandboxes/sb-1/exec", json={"cmd": ["true"]}),
        httpx.Request("GET", server.base + "/v1/sandboxes/sb-1"),
        httpx.Request("PUT", server.base + "/v1/files", content=b"x" * 40_000),
    ]
    counted, answers = SENDERS[face](server, requests)
    assert answers == [(200, b'{"received":16}'), (200, b'{"received":0}'),
                       (200, b'{"received":40000}')]
    assert len(counted.writes) == 3, counted.writes


def pieces(total: int, piece: int) -> Iterator[bytes]:
    block = b"u" * piece
    for _ in range(total // piece):
        yield block


async def async_pieces(total: int, piece: int) -> AsyncIterator[bytes]:
    for block in pieces(total, piece):
        yield block


@pytest.mark.parametrize("face", ["sync", "async"])
def test_a_large_upload_streams_in_bounded_pieces(server: PlainServer, face: str) -> None:
    total = 100 * SEND_PIECE
    body: Any = pieces(total, SEND_PIECE) if face == "sync" else async_pieces(total, SEND_PIECE)
    many_small: Any = (pieces if face == "sync" else async_pieces)(8 * WRITE_BOUND, 1000)
    requests = [
        httpx.Request("PUT", server.base + "/v1/files?path=big", content=body),
        # Pieces smaller than the bound: held together, never past it.
        httpx.Request("PUT", server.base + "/v1/files?path=small", content=many_small),
    ]
    tracemalloc.start()
    try:
        counted, answers = SENDERS[face](server, requests)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert answers == [(200, b'{"received":%d}' % total),
                       (200, b'{"received":%d}' % (8 * WRITE_BOUND // 1000 * 1000))]
    assert len(counted.writes) >= 100 + 8, len(counted.writes)
    assert max(counted.writes) <= SEND_PIECE + CHUNK_FRAMING
    assert counted.most_held <= WRITE_BOUND
    # The 100 MB never sat in memory: some pieces in flight, on both sides of
    # the socket (this process runs the server too), a few MB in all.
    assert peak < 25 * SEND_PIECE, peak


@pytest.mark.parametrize("face", ["sync", "async"])
def test_an_answer_before_the_body_is_read_still_arrives(face: str) -> None:
    """The server answers 413 after the head and closes: the write of the body
    fails, and the client reads the answer (as httpcore's own streams do)."""
    server = PlainServer(socket.AF_UNIX, early=True)
    try:
        total = 16 * SEND_PIECE
        body: Any = pieces(total, SEND_PIECE) if face == "sync" else async_pieces(total, SEND_PIECE)
        _, answers = SENDERS[face](server, [httpx.Request("PUT", server.base + "/f", content=body)])
    finally:
        server.close()
    assert answers == [(413, b'{"error":"too large"}')]
