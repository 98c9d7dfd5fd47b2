"""The two drivers of the core's operations: over httpx, async and sync."""

from __future__ import annotations

import functools
import json
from collections.abc import AsyncIterator, Iterator
from contextlib import AbstractAsyncContextManager, AbstractContextManager
from typing import IO, TYPE_CHECKING, Any

import httpx

from .._errors import HutchError
from .._limits import CLIENT_IDLE_SECONDS
from ._answers import EnsuredRef, decode_event
from ._core import Op
from ._handles import note_exit
from ._http import (
    Call,
    PlainCalls,
    check_answer,
    client_headers,
    client_url,
    decode_answer,
    env_proxies,
    http_target,
    request_kwargs,
    tls_verify,
    unreachable,
)
from ._refs import BranchRef, ForkRef, ProcessRef, RemoteEnsured, SandboxRef, WatcherRef

if TYPE_CHECKING:
    from ._shell import AsyncRemotePty, RemotePty


def step(gen: Op[Any], answer: Any = None, error: BaseException | None = None) -> tuple[bool, Any]:
    """Advance an operation: (done, value) where value is its result or next Call."""
    try:
        if error is not None:
            return False, gen.throw(error)
        return False, gen.send(answer)
    except StopIteration as stop:
        return True, stop.value


class _Transport:
    """What both drivers share: where the daemon is, and how answers become objects."""

    def __init__(self, url: str | None, factories: dict[str, Any]) -> None:
        self.url = client_url(url)
        self.factories = factories

    def wrap(self, value: Any) -> Any:
        if isinstance(value, SandboxRef):
            return self.factories["sandbox"](self, value.info)
        if isinstance(value, BranchRef):
            branch = self.factories["sandbox"](self, value.info)
            value.fork.branches.append(branch)
            return branch
        if isinstance(value, EnsuredRef):
            sandbox = self.factories["sandbox"](self, value.sandbox)
            return RemoteEnsured(sandbox, value.path, value.steps)
        if isinstance(value, ForkRef):
            branches = [self.factories["sandbox"](self, info) for info in value.sandboxes]
            return self.factories["fork"](self, value.snapshot, branches)
        if isinstance(value, ProcessRef):
            return self.factories["process"](self, value.sandbox_id, value.info)
        if isinstance(value, WatcherRef):
            return self.factories["watcher"](self, value.sandbox_id, value.info)
        if isinstance(value, list) and value and isinstance(value[0], SandboxRef | ProcessRef):
            return [self.wrap(v) for v in value]
        return value


#: What one piece of a file sent as a request body holds.
_SEND_PIECE = 1024 * 1024
#: The pool's: an idle connection is dropped before a daemon would close it.
LIMITS = httpx.Limits(keepalive_expiry=CLIENT_IDLE_SECONDS)


async def _pieces_of(source: IO[bytes]) -> AsyncIterator[bytes]:
    """A binary file, from its position on, in pieces read off the event loop."""
    import anyio.to_thread  # here: the sync client, and every command of the CLI, need none

    while piece := await anyio.to_thread.run_sync(source.read, _SEND_PIECE):
        yield piece


class AsyncTransport(_Transport):
    def __init__(self, url: str | None, token: str | None, factories: dict[str, Any]) -> None:
        super().__init__(url, factories)
        base, uds = http_target(self.url)
        self.pool = httpx.AsyncHTTPTransport(uds=uds, verify=tls_verify(base), limits=LIMITS)
        # One pool for plain and streamed calls alike (one connection, not
        # one each), except where the environment names a proxy: the client
        # honours it only with a transport of its own making.
        self.http = httpx.AsyncClient(
            base_url=base, headers=client_headers(token, self.url), verify=tls_verify(base),
            transport=self.pool if uds is not None or not env_proxies() else None,
            limits=LIMITS,
        )
        self.plain = PlainCalls(base, self.http.headers)

    async def send(self, call: Call) -> Any:
        kwargs = request_kwargs(call)
        if call.content is not None and not isinstance(call.content, bytes):
            kwargs["content"] = _pieces_of(call.content)  # httpx's async face wants these
        try:
            if self.plain.direct:
                request = self.plain.request(call, kwargs.get("content"))
                response = await self.pool.handle_async_request(request)
                response.request = request
                try:
                    await response.aread()
                finally:
                    await response.aclose()
            else:
                response = await self.http.request(call.method, call.path, **kwargs)
        except httpx.TransportError as exc:
            raise unreachable(self.url, exc) from None
        check_answer(response)
        return decode_answer(call, response)

    async def drive(self, gen: Op[Any], owner: Any) -> Any:
        done, value = step(gen)
        while not done:
            try:
                answer = await self.send(value)
            except HutchError as exc:
                done, value = step(gen, error=exc)
                continue
            done, value = step(gen, answer)
        return self.wrap(value)

    def drive_stream(self, gen: Op[Any], owner: Any) -> AsyncIterator[Any]:
        async def events() -> AsyncIterator[Any]:
            _, call = step(gen)
            try:
                async with self.http.stream(
                    call.method, call.path, **request_kwargs(call)
                ) as response:
                    if response.status_code >= 400:
                        check_answer(httpx.Response(response.status_code,
                                                    content=await response.aread()))
                    if call.raw:
                        async for piece in response.aiter_bytes():
                            yield piece
                        return
                    async for line in response.aiter_lines():
                        if line:
                            event = decode_event(json.loads(line))
                            note_exit(owner, event)
                            yield self.wrap(event)
            except httpx.TransportError as exc:
                raise unreachable(self.url, exc) from None

        return events()

    def open_pty(
        self, sandbox_id: str, start: dict[str, Any]
    ) -> AbstractAsyncContextManager[AsyncRemotePty]:
        from ._shell import open_async_pty

        return open_async_pty(self.url, self.http.headers, sandbox_id, start)

    async def close(self) -> None:
        await self.http.aclose()
        await self.pool.aclose()


class SyncTransport(_Transport):
    def __init__(self, url: str | None, token: str | None, factories: dict[str, Any]) -> None:
        super().__init__(url, factories)
        base, uds = http_target(self.url)
        self.pool = httpx.HTTPTransport(uds=uds, verify=tls_verify(base), limits=LIMITS)
        # One pool for plain and streamed calls alike (one connection, not
        # one each), except where the environment names a proxy: the client
        # honours it only with a transport of its own making.
        self.http = httpx.Client(
            base_url=base, headers=client_headers(token, self.url), verify=tls_verify(base),
            transport=self.pool if uds is not None or not env_proxies() else None,
            limits=LIMITS,
        )
        self.plain = PlainCalls(base, self.http.headers)

    def send(self, call: Call) -> Any:
        kwargs = request_kwargs(call)
        if call.content is not None and not isinstance(call.content, bytes):
            # Pieces, not the file: httpx would announce the file's whole
            # length, whatever its position.
            kwargs["content"] = iter(functools.partial(call.content.read, _SEND_PIECE), b"")
        try:
            if self.plain.direct:
                request = self.plain.request(call, kwargs.get("content"))
                response = self.pool.handle_request(request)
                response.request = request
                try:
                    response.read()
                finally:
                    response.close()
            else:
                response = self.http.request(call.method, call.path, **kwargs)
        except httpx.TransportError as exc:
            raise unreachable(self.url, exc) from None
        check_answer(response)
        return decode_answer(call, response)

    def drive(self, gen: Op[Any], owner: Any) -> Any:
        done, value = step(gen)
        while not done:
            try:
                answer = self.send(value)
            except HutchError as exc:
                done, value = step(gen, error=exc)
                continue
            done, value = step(gen, answer)
        return self.wrap(value)

    def open_pty(self, sandbox_id: str, start: dict[str, Any]) -> AbstractContextManager[RemotePty]:
        from ._shell import open_sync_pty

        return open_sync_pty(self.url, self.http.headers, sandbox_id, start)

    def drive_stream(self, gen: Op[Any], owner: Any) -> Iterator[Any]:
        def events() -> Iterator[Any]:
            _, call = step(gen)
            try:
                with self.http.stream(call.method, call.path, **request_kwargs(call)) as response:
                    if response.status_code >= 400:
                        check_answer(httpx.Response(response.status_code, content=response.read()))
                    if call.raw:
                        yield from response.iter_bytes()
                        return
                    for line in response.iter_lines():
                        if line:
                            event = decode_event(json.loads(line))
                            note_exit(owner, event)
                            yield self.wrap(event)
            except httpx.TransportError as exc:
                raise unreachable(self.url, exc) from None

        return events()

    def close(self) -> None:
        self.http.close()
        self.pool.close()
