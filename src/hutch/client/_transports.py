"""The two drivers of the core's operations: over httpx, async and sync."""

from __future__ import annotations

import functools
import ipaddress
import json
import os
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import IO, Any

import anyio.to_thread
import httpx

from .._errors import HutchError
from .._paths import token_file_path
from .._refwire import UNIX_HOST, unix_socket_of
from ._core import (
    DEFAULT_URL,
    SESSION_HEADER,
    BranchRef,
    Call,
    EnsuredRef,
    ForkRef,
    Op,
    ProcessRef,
    RemoteEnsured,
    SandboxRef,
    check_answer,
    decode_answer,
    decode_event,
    note_exit,
    request_kwargs,
    step,
    unreachable,
)


def client_headers(token: str | None, url: str) -> dict[str, str]:
    """A client's headers for the daemon at ``url``: its token is ``token``,
    else ``HUTCH_TOKEN``, else (for a daemon on this host) the one the daemon
    made in its data directory, if this user can read it (:func:`local_token`)."""
    headers = {SESSION_HEADER: uuid.uuid4().hex}
    if token is None:
        token = os.environ.get("HUTCH_TOKEN") or local_token(url)
    if token:
        headers["Authorization"] = f"Bearer {token}"
    return headers


def local_token(url: str) -> str | None:
    """The token a daemon of this host made for itself, found where the daemon
    keeps it (``$HUTCH_HOME``, else ``~/.local/share/hutch``: its default data
    directory), for a loopback ``url`` only: a remote daemon is never sent a
    local one's token. None if there is none this user may read."""
    host = httpx.URL(url).host if "://" in url else ""
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        return None
    try:
        with open(token_file_path(), encoding="utf-8") as fh:
            return fh.read().strip() or None
    except (OSError, UnicodeDecodeError):
        return None


def client_url(url: str | None) -> str:
    return (url or os.environ.get("HUTCH_URL") or DEFAULT_URL).rstrip("/")


def http_target(url: str) -> tuple[str, str | None]:
    """The base URL requests go to, and the unix socket that carries them
    (for an in-process owner's address, ``http+unix://``), else None."""
    path = unix_socket_of(url)
    return (url, None) if path is None else (f"http://{UNIX_HOST}", path)


def tls_verify(base: str) -> bool:
    """Check certificates for an https daemon. A plain-http one has none to
    check, and loading the CA bundle costs each command (twice) more than
    its request."""
    return base.lower().startswith("https:")


def _env_proxies() -> bool:
    """Whether the environment names a proxy (httpx's client honours it)."""
    return any(
        name.lower() in ("http_proxy", "https_proxy", "all_proxy") and value
        for name, value in os.environ.items()
    )


class _PlainCalls:
    """A call answered whole (not streamed) goes straight to an httpx
    transport, with the request built here: httpx's client would merge the
    base URL, cookies, auth and event hooks into it first, a third of the
    SDK's own time per exec, for nothing this client uses. Where the
    environment names a proxy, the client (which honours it) sends them."""

    def __init__(self, base: str, headers: httpx.Headers) -> None:
        self.base = base
        self.headers = headers
        self.direct = not _env_proxies()
        self._urls: dict[str, httpx.URL] = {}

    def request(self, call: Call, content: Any) -> httpx.Request:
        url = self._urls.get(call.path)
        if url is None:
            url = httpx.URL(self.base + call.path)
            if len(self._urls) < 256:
                self._urls[call.path] = url
        if call.params:
            url = url.copy_merge_params(call.params)
        return httpx.Request(
            call.method, url, headers=self.headers, json=call.json, content=content,
            extensions={"timeout": httpx.Timeout(call.timeout).as_dict()},
        )


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
        if isinstance(value, list) and value and isinstance(value[0], SandboxRef | ProcessRef):
            return [self.wrap(v) for v in value]
        return value


#: What one piece of a file sent as a request body holds.
_SEND_PIECE = 1024 * 1024


async def _pieces_of(source: IO[bytes]) -> AsyncIterator[bytes]:
    """A binary file, from its position on, in pieces read off the event loop."""
    while piece := await anyio.to_thread.run_sync(source.read, _SEND_PIECE):
        yield piece


class AsyncTransport(_Transport):
    def __init__(self, url: str | None, token: str | None, factories: dict[str, Any]) -> None:
        super().__init__(url, factories)
        base, uds = http_target(self.url)
        self.pool = httpx.AsyncHTTPTransport(uds=uds, verify=tls_verify(base))
        self.http = httpx.AsyncClient(
            base_url=base, headers=client_headers(token, self.url), verify=tls_verify(base),
            transport=None if uds is None else self.pool,
        )
        self.plain = _PlainCalls(base, self.http.headers)

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

    async def drive(self, gen: Op, owner: Any) -> Any:
        done, value = step(gen)
        while not done:
            try:
                answer = await self.send(value)
            except HutchError as exc:
                done, value = step(gen, error=exc)
                continue
            done, value = step(gen, answer)
        return self.wrap(value)

    def drive_stream(self, gen: Op, owner: Any) -> AsyncIterator[Any]:
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

    def open_pty(self, sandbox_id: str, start: dict[str, Any]) -> Any:
        from ._shell import open_async_pty

        return open_async_pty(self.url, self.http.headers, sandbox_id, start)

    async def close(self) -> None:
        await self.http.aclose()
        await self.pool.aclose()


class SyncTransport(_Transport):
    def __init__(self, url: str | None, token: str | None, factories: dict[str, Any]) -> None:
        super().__init__(url, factories)
        base, uds = http_target(self.url)
        self.pool = httpx.HTTPTransport(uds=uds, verify=tls_verify(base))
        self.http = httpx.Client(
            base_url=base, headers=client_headers(token, self.url), verify=tls_verify(base),
            transport=None if uds is None else self.pool,
        )
        self.plain = _PlainCalls(base, self.http.headers)

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

    def drive(self, gen: Op, owner: Any) -> Any:
        done, value = step(gen)
        while not done:
            try:
                answer = self.send(value)
            except HutchError as exc:
                done, value = step(gen, error=exc)
                continue
            done, value = step(gen, answer)
        return self.wrap(value)

    def open_pty(self, sandbox_id: str, start: dict[str, Any]) -> Any:
        from ._shell import open_sync_pty

        return open_sync_pty(self.url, self.http.headers, sandbox_id, start)

    def drive_stream(self, gen: Op, owner: Any) -> Iterator[Any]:
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
