"""The client's HTTP leaf: where the daemon is, how a client proves who it is,
how a request is built and an answer or error decoded.

Nothing here knows the SDK's operations or objects (``_core``) or its drivers
(``_transports``); those and the PTY (``_shell``) all build on this, so the
client's modules import one another in one direction only.
"""

from __future__ import annotations

import ipaddress
import json
import os
import uuid
from dataclasses import dataclass, field
from typing import IO, Any

import httpx

from .._errors import HutchError, SandboxUnavailable, error_from_wire
from .._paths import token_file_path
from .._refwire import UNIX_HOST, unix_socket_of

SESSION_HEADER = "X-Hutch-Session"
DEFAULT_URL = "http://127.0.0.1:8787"


@dataclass
class Call:
    method: str
    path: str
    params: dict[str, Any] | None = None
    json: Any = None
    #: The request body: bytes, or a binary file sent a piece at a time from
    #: its position on (never read whole).
    content: bytes | IO[bytes] | None = None
    #: Seconds to wait for the answer; None waits as long as it takes.
    timeout: float | None = 60.0
    #: The answer is NDJSON events, handed to the caller as they come.
    stream: bool = False
    #: The answer is raw bytes rather than JSON.
    raw: bool = False
    headers: dict[str, str] = field(default_factory=dict)


# -- where the daemon is, and the client's credentials ------------------------------------


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


def env_proxies() -> bool:
    """Whether the environment names a proxy (httpx's client honours it)."""
    return any(
        name.lower() in ("http_proxy", "https_proxy", "all_proxy") and value
        for name, value in os.environ.items()
    )


# -- requests ---------------------------------------------------------------------------


class PlainCalls:
    """A call answered whole (not streamed) goes straight to an httpx
    transport, with the request built here: httpx's client would merge the
    base URL, cookies, auth and event hooks into it first, a third of the
    SDK's own time per exec, for nothing this client uses. Where the
    environment names a proxy, the client (which honours it) sends them."""

    def __init__(self, base: str, headers: httpx.Headers) -> None:
        self.base = base
        self.headers = headers
        self.direct = not env_proxies()
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


def request_kwargs(call: Call) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"params": call.params, "timeout": call.timeout}
    if call.json is not None:
        kwargs["json"] = call.json
    if call.content is not None:
        kwargs["content"] = call.content
    return kwargs


# -- answers and errors -----------------------------------------------------------------


def raise_for_error(status: int, body: bytes) -> None:
    if status < 400:
        return
    try:
        error = json.loads(body)["error"]
        if not isinstance(error, dict) or "code" not in error or "message" not in error:
            raise TypeError("not an error body")
    except (ValueError, KeyError, TypeError):
        raise HutchError(f"daemon answered {status}: {body[:200]!r}") from None
    raise error_from_wire(error)


def unreachable(url: str, exc: Exception) -> SandboxUnavailable:
    path = unix_socket_of(url)
    if path is not None:
        # Only an in-process owner serves on a socket, and it stops with its owner.
        return SandboxUnavailable(
            f"the sandbox this ref names is no longer served at {path}: its owner's "
            f"cleanup ended it, or the owner's process is gone ({type(exc).__name__})"
        )
    return SandboxUnavailable(
        f"the hutch daemon at {url} is not reachable ({type(exc).__name__}); "
        "start it with `hutch serve`"
    )


def check_answer(response: httpx.Response) -> None:
    raise_for_error(response.status_code, response.content)


def decode_answer(call: Call, response: httpx.Response) -> Any:
    if call.raw:
        return response.content
    if response.status_code == 204 or not response.content:
        return None
    return response.json()
