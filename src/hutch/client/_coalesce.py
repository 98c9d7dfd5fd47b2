"""The client's connections to the daemon: a request goes out in one write.

httpcore's HTTP/1.1 connection writes a request's head, then each piece of
its body, then (chunked) its end, each as a write of its own: a small JSON
call (an exec) reaches the daemon as two packets, and the daemon's server
wakes for each. The streams here hold what a request writes until it is
about to read its answer (or holds :data:`WRITE_BOUND` bytes), then send it
as one write: the head and a small body arrive together. A large body (a
file uploaded) still streams: what is held never passes the bound, and a
piece that large is written as it comes, never copied into another.

HTTP/1.1 from this client is a request written whole, then its answer read
(no ``Expect: 100-continue``, no upgrade: the PTY's websocket has its own
connection), so "flush before reading" never holds back a byte the daemon
waits for.

httpx gives its transports no network backend of our choosing, so the
transports here are httpcore's connection pool (given the backend through
its public constructor) behind httpx's transport interface, as httpx's own
transport maps requests, answers and errors.
"""

from __future__ import annotations

import contextlib
import ssl
from collections.abc import AsyncIterator, Iterable, Iterator
from typing import Any

import httpcore
import httpx

#: The most bytes a stream holds back before writing: a request's head and a
#: small body go out together; a larger body goes in writes of its own pieces.
WRITE_BOUND = 64 * 1024

SocketOption = Any  # httpcore's SOCKET_OPTION (a tuple of its setsockopt arguments)


class _Held:
    """Bytes written and not yet sent: at most :data:`WRITE_BOUND` of them."""

    def __init__(self) -> None:
        self.pieces: list[bytes] = []
        self.size = 0
        self.timeout: float | None = None

    def take(self) -> bytes:
        data = self.pieces[0] if len(self.pieces) == 1 else b"".join(self.pieces)
        self.pieces = []
        self.size = 0
        return data

    def fits(self, buffer: bytes) -> bool:
        return self.size + len(buffer) <= WRITE_BOUND

    def hold(self, buffer: bytes, timeout: float | None) -> None:
        self.pieces.append(buffer)
        self.size += len(buffer)
        self.timeout = timeout


class AsyncCoalescingStream(httpcore.AsyncNetworkStream):
    """A network stream whose writes go out together when it next reads."""

    def __init__(self, stream: httpcore.AsyncNetworkStream) -> None:
        self.stream = stream
        self.held = _Held()

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        if not buffer:
            return
        if self.held.fits(buffer):
            self.held.hold(buffer, timeout)
            return
        await self.flush()
        if len(buffer) < WRITE_BOUND:
            self.held.hold(buffer, timeout)
        else:
            await self.stream.write(buffer, timeout)

    async def flush(self) -> None:
        if self.held.size:
            timeout = self.held.timeout
            await self.stream.write(self.held.take(), timeout)

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        try:
            await self.flush()
        except httpcore.WriteError:
            # As httpcore does when a write of the request fails: read on,
            # for the daemon may have answered (an error) and closed.
            pass
        return await self.stream.read(max_bytes, timeout)

    async def aclose(self) -> None:
        self.held.take()
        await self.stream.aclose()

    async def start_tls(
        self,
        ssl_context: ssl.SSLContext,
        server_hostname: str | None = None,
        timeout: float | None = None,
    ) -> httpcore.AsyncNetworkStream:
        await self.flush()
        tls = await self.stream.start_tls(ssl_context, server_hostname, timeout)
        return AsyncCoalescingStream(tls)

    def get_extra_info(self, info: str) -> Any:
        return self.stream.get_extra_info(info)


class CoalescingStream(httpcore.NetworkStream):
    """The sync twin of :class:`AsyncCoalescingStream`."""

    def __init__(self, stream: httpcore.NetworkStream) -> None:
        self.stream = stream
        self.held = _Held()

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        if not buffer:
            return
        if self.held.fits(buffer):
            self.held.hold(buffer, timeout)
            return
        self.flush()
        if len(buffer) < WRITE_BOUND:
            self.held.hold(buffer, timeout)
        else:
            self.stream.write(buffer, timeout)

    def flush(self) -> None:
        if self.held.size:
            timeout = self.held.timeout
            self.stream.write(self.held.take(), timeout)

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        try:
            self.flush()
        except httpcore.WriteError:
            pass  # read on, as httpcore does (see the async twin)
        return self.stream.read(max_bytes, timeout)

    def close(self) -> None:
        self.held.take()
        self.stream.close()

    def start_tls(
        self,
        ssl_context: ssl.SSLContext,
        server_hostname: str | None = None,
        timeout: float | None = None,
    ) -> httpcore.NetworkStream:
        self.flush()
        return CoalescingStream(self.stream.start_tls(ssl_context, server_hostname, timeout))

    def get_extra_info(self, info: str) -> Any:
        return self.stream.get_extra_info(info)


class AsyncCoalescingBackend(httpcore.AsyncNetworkBackend):
    """A network backend (by default httpcore's anyio one) whose streams coalesce writes."""

    def __init__(self, backend: httpcore.AsyncNetworkBackend | None = None) -> None:
        self.backend = httpcore.AnyIOBackend() if backend is None else backend

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[SocketOption] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        stream = await self.backend.connect_tcp(host, port, timeout, local_address, socket_options)
        return AsyncCoalescingStream(stream)

    async def connect_unix_socket(
        self,
        path: str,
        timeout: float | None = None,
        socket_options: Iterable[SocketOption] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        stream = await self.backend.connect_unix_socket(path, timeout, socket_options)
        return AsyncCoalescingStream(stream)

    async def sleep(self, seconds: float) -> None:
        await self.backend.sleep(seconds)


class CoalescingBackend(httpcore.NetworkBackend):
    """The sync twin of :class:`AsyncCoalescingBackend` (over httpcore's sync backend)."""

    def __init__(self, backend: httpcore.NetworkBackend | None = None) -> None:
        self.backend = httpcore.SyncBackend() if backend is None else backend

    def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[SocketOption] | None = None,
    ) -> httpcore.NetworkStream:
        stream = self.backend.connect_tcp(host, port, timeout, local_address, socket_options)
        return CoalescingStream(stream)

    def connect_unix_socket(
        self,
        path: str,
        timeout: float | None = None,
        socket_options: Iterable[SocketOption] | None = None,
    ) -> httpcore.NetworkStream:
        return CoalescingStream(self.backend.connect_unix_socket(path, timeout, socket_options))

    def sleep(self, seconds: float) -> None:
        self.backend.sleep(seconds)


# -- httpx transports over the pool -------------------------------------------------------

#: httpcore's errors and httpx's, the most specific first (as httpx's transport maps them).
_ERRORS: tuple[tuple[type[Exception], type[httpx.TransportError]], ...] = (
    (httpcore.ConnectTimeout, httpx.ConnectTimeout),
    (httpcore.ReadTimeout, httpx.ReadTimeout),
    (httpcore.WriteTimeout, httpx.WriteTimeout),
    (httpcore.PoolTimeout, httpx.PoolTimeout),
    (httpcore.TimeoutException, httpx.TimeoutException),
    (httpcore.ConnectError, httpx.ConnectError),
    (httpcore.ReadError, httpx.ReadError),
    (httpcore.WriteError, httpx.WriteError),
    (httpcore.NetworkError, httpx.NetworkError),
    (httpcore.ProxyError, httpx.ProxyError),
    (httpcore.UnsupportedProtocol, httpx.UnsupportedProtocol),
    (httpcore.RemoteProtocolError, httpx.RemoteProtocolError),
    (httpcore.LocalProtocolError, httpx.LocalProtocolError),
    (httpcore.ProtocolError, httpx.ProtocolError),
)


@contextlib.contextmanager
def _httpx_errors() -> Iterator[None]:
    try:
        yield
    except Exception as exc:
        for theirs, ours in _ERRORS:
            if isinstance(exc, theirs):
                raise ours(str(exc)) from exc
        raise


def _core_request(request: httpx.Request) -> httpcore.Request:
    return httpcore.Request(
        method=request.method,
        url=httpcore.URL(
            scheme=request.url.raw_scheme, host=request.url.raw_host,
            port=request.url.port, target=request.url.raw_path,
        ),
        headers=request.headers.raw,
        content=request.stream,
        extensions=request.extensions,
    )


def pool_settings(base: str, uds: str | None) -> dict[str, Any]:
    """The connection pool's settings, httpx's defaults: certificates are
    checked (and loaded) only for an https daemon."""
    secure = base.lower().startswith("https:")
    return {
        "ssl_context": httpx.create_ssl_context() if secure else None,
        "max_connections": 100,
        "max_keepalive_connections": 20,
        "keepalive_expiry": 5.0,
        "uds": uds,
    }


class _AsyncAnswer(httpx.AsyncByteStream):
    def __init__(self, stream: Any) -> None:
        self.stream = stream

    async def __aiter__(self) -> AsyncIterator[bytes]:
        with _httpx_errors():
            async for piece in self.stream:
                yield piece

    async def aclose(self) -> None:
        with _httpx_errors():
            await self.stream.aclose()


class _Answer(httpx.SyncByteStream):
    def __init__(self, stream: Any) -> None:
        self.stream = stream

    def __iter__(self) -> Iterator[bytes]:
        with _httpx_errors():
            yield from self.stream

    def close(self) -> None:
        with _httpx_errors():
            self.stream.close()


class AsyncPoolTransport(httpx.AsyncBaseTransport):
    """httpx's transport interface over httpcore's pool of coalescing connections."""

    def __init__(self, base: str, uds: str | None,
                 backend: httpcore.AsyncNetworkBackend | None = None) -> None:
        self.pool = httpcore.AsyncConnectionPool(
            network_backend=AsyncCoalescingBackend() if backend is None else backend,
            **pool_settings(base, uds),
        )

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        with _httpx_errors():
            answer = await self.pool.handle_async_request(_core_request(request))
        return httpx.Response(
            status_code=answer.status, headers=answer.headers,
            stream=_AsyncAnswer(answer.stream), extensions=answer.extensions,
        )

    async def aclose(self) -> None:
        await self.pool.aclose()


class PoolTransport(httpx.BaseTransport):
    """The sync twin of :class:`AsyncPoolTransport`."""

    def __init__(self, base: str, uds: str | None,
                 backend: httpcore.NetworkBackend | None = None) -> None:
        self.pool = httpcore.ConnectionPool(
            network_backend=CoalescingBackend() if backend is None else backend,
            **pool_settings(base, uds),
        )

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        with _httpx_errors():
            answer = self.pool.handle_request(_core_request(request))
        return httpx.Response(
            status_code=answer.status, headers=answer.headers,
            stream=_Answer(answer.stream), extensions=answer.extensions,
        )

    def close(self) -> None:
        self.pool.close()
