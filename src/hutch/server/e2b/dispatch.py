"""Which of hutch's faces a request is for, and whether its credential opens it.

One port serves hutch's own API and the E2B wire (docs/e2b.md):

- a request carrying ``E2b-Sandbox-Id`` is for a sandbox: the in-sandbox API
  (envd, port 49983, :mod:`.envd`) or, for any other ``E2b-Sandbox-Port``, a
  server listening in the sandbox (:mod:`.preview`). Its credential is the
  ``X-Access-Token`` create or connect answered (:mod:`.keys`);
- a request whose ``Host`` is ``{port}-{sandbox id}.{domain}`` (what the SDKs'
  ``get_host`` builds) goes to that port in that sandbox (:mod:`.preview`);
- a request to the E2B control plane's paths (``/sandboxes``,
  ``/v2/sandboxes``, ``/snapshots``, ``/templates``) goes to :mod:`.control`,
  with ``X-API-KEY`` holding a hutch token or a ref (either as it is or in
  E2B's ``e2b_<hex>`` form);
- anything else is hutch's own API, untouched.

In a fleet, a request for a sandbox (or template) another daemon serves is
sent to it once its credential has been checked here (:mod:`..forward`):
the E2B SDKs may talk to any daemon of the fleet.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
from collections.abc import Callable
from dataclasses import dataclass

from ..._errors import HutchError
from ..._refwire import REF_PREFIX
from ...daemon import Daemon
from ...store import RefRow
from ..asgi import ASGIApp, Receive, Scope, Send, header
from ..forward import Forwarder
from .errors import send_connect_error, send_control_error
from .keys import credential_of, is_envd_access_token
from .versions import ENVD_PORT

#: Where a request's E2B context is kept in its ASGI scope.
CALLER_SCOPE_KEY = "hutch.e2b.caller"

#: The first path segment of every control-plane route the SDKs call.
CONTROL_ROOTS = frozenset({"sandboxes", "v2", "snapshots", "templates"})

#: ``{port}-{sandbox id}.{domain}[:port]``, as ``get_host`` builds it.
_PREVIEW_HOST = re.compile(r"\A(\d{1,5})-([A-Za-z0-9][A-Za-z0-9-]*)\.")


@dataclass(frozen=True)
class Caller:
    """Who a request on the E2B wire speaks for.

    ``ref`` is None for the daemon's token (the owner of every sandbox);
    otherwise the ref that opened it, which works in its one sandbox only.
    ``sandbox_id`` is the sandbox an in-sandbox request is for.
    """

    daemon: Daemon
    secret: bytes
    ref: RefRow | None = None
    credential: str | None = None
    sandbox_id: str | None = None


def caller_of(scope: Scope) -> Caller:
    """The :class:`Caller` the dispatch found for a request."""
    caller: Caller = scope[CALLER_SCOPE_KEY]
    return caller


def secret_of(token: str | None) -> bytes:
    """The key the daemon's envd access tokens are made with: from its token
    (so that they outlive a restart), else random (they end with the process)."""
    if token:
        return hashlib.sha256(b"hutch e2b envd\0" + token.encode()).digest()
    return os.urandom(32)


class E2BWire:
    """Pure ASGI middleware, outermost: sends E2B requests to their app
    (see the module's doc) and everything else on to hutch's own."""

    def __init__(
        self, app: ASGIApp, *, daemon: Callable[[], Daemon | None], token: str | None,
        forwarder: Forwarder, control: ASGIApp, envd: ASGIApp, preview: ASGIApp,
    ) -> None:
        self.app = app
        self.daemon = daemon
        self.forwarder = forwarder
        self.expected = token.encode() if token else None
        self.secret = secret_of(token)
        self.control = control
        self.envd = envd
        self.preview = preview

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        sandbox_id = header(scope, b"e2b-sandbox-id")
        if sandbox_id is not None:
            await self._in_sandbox(sandbox_id, scope, receive, send)
            return
        host = header(scope, b"host") or ""
        match = _PREVIEW_HOST.match(host)
        if match is not None and await self.forwarder.forwarded(
                "sandbox", match.group(2), scope, receive, send):
            return
        if match is not None and await self._knows(match.group(2)):
            scope["hutch.e2b.port"] = int(match.group(1))
            await self._to(self.preview, match.group(2), None, scope, receive, send)
            return
        path: str = scope["path"]
        if scope["type"] == "http" and path.split("/", 2)[1] in CONTROL_ROOTS:
            await self._control(scope, receive, send)
            return
        await self.app(scope, receive, send)

    async def _knows(self, sandbox_id: str) -> bool:
        daemon = self.daemon()
        if daemon is None:
            return False
        try:
            await daemon.get(sandbox_id)
        except HutchError:
            return False
        return True

    async def _to(
        self, app: ASGIApp, sandbox_id: str, ref: RefRow | None,
        scope: Scope, receive: Receive, send: Send,
    ) -> None:
        daemon = self.daemon()
        if daemon is None:
            await send_control_error(send, 503, "the daemon is starting")
            return
        scope[CALLER_SCOPE_KEY] = Caller(daemon, self.secret, ref, None, sandbox_id)
        await app(scope, receive, send)

    async def _in_sandbox(self, sandbox_id: str, scope: Scope, receive: Receive,
                          send: Send) -> None:
        daemon = self.daemon()
        if daemon is None:
            await send_connect_error(send, "unavailable", "the daemon is starting")
            return
        given = header(scope, b"x-access-token")
        ref: RefRow | None = None
        if given is None:
            await send_connect_error(
                send, "unauthenticated",
                "missing X-Access-Token: use the envdAccessToken that create or connect "
                "answered (the E2B SDKs send it on their own)")
            return
        if given.startswith(REF_PREFIX):
            try:
                ref = await daemon.check_ref(given)
                target = await daemon.ref_target(ref, sandbox_id)
            except HutchError as exc:
                await send_connect_error(send, "unauthenticated", exc.message)
                return
            if target is None:
                await send_connect_error(
                    send, "permission_denied", f"ref {ref.id} does not open sandbox {sandbox_id}")
                return
            sandbox_id = target
        elif not is_envd_access_token(self.secret, sandbox_id, given):
            await send_connect_error(
                send, "unauthenticated", f"wrong X-Access-Token for sandbox {sandbox_id}")
            return
        port = header(scope, b"e2b-sandbox-port")
        if port is not None and port.isdigit() and int(port) != ENVD_PORT:
            scope["hutch.e2b.port"] = int(port)
            app = self.preview
        else:
            app = self.envd
        if await self.forwarder.forwarded("sandbox", sandbox_id, scope, receive, send):
            return
        scope[CALLER_SCOPE_KEY] = Caller(daemon, self.secret, ref, given, sandbox_id)
        await app(scope, receive, send)

    async def _control(self, scope: Scope, receive: Receive, send: Send) -> None:
        daemon = self.daemon()
        if daemon is None:
            await send_control_error(send, 503, "the daemon is starting")
            return
        api_key = header(scope, b"x-api-key")
        if api_key is None:
            bearer = header(scope, b"authorization") or ""
            scheme, _, value = bearer.partition(" ")
            api_key = value.strip() if scheme.lower() == "bearer" else None
        if api_key is None:
            await send_control_error(
                send, 401, "missing X-API-KEY: set E2B_API_KEY to the daemon's token or a "
                "sandbox's ref (`hutch token --e2b` prints it in E2B's key format)")
            return
        for credential in credential_of(api_key):
            if credential.startswith(REF_PREFIX):
                try:
                    ref = await daemon.check_ref(credential)
                except HutchError:
                    continue
                scope[CALLER_SCOPE_KEY] = Caller(daemon, self.secret, ref, credential)
                await self._control_here_or_forwarded(scope, receive, send)
                return
            if self.expected is not None and hmac.compare_digest(
                credential.encode(), self.expected
            ):
                scope[CALLER_SCOPE_KEY] = Caller(daemon, self.secret, None, credential)
                await self._control_here_or_forwarded(scope, receive, send)
                return
        await send_control_error(
            send, 401, "wrong X-API-KEY: set E2B_API_KEY to the daemon's token or a "
            "sandbox's ref (`hutch token --e2b` prints it in E2B's key format)")

    async def _control_here_or_forwarded(
        self, scope: Scope, receive: Receive, send: Send
    ) -> None:
        """A control-plane call, forwarded where another daemon serves what
        it is for: one sandbox (``/sandboxes/{id}/...``, ``/v2/sandboxes/{id}/...``),
        a template (``DELETE /templates/{id}``; a template is a snapshot), or
        the snapshot a create names as its ``templateID``."""
        method, path = scope["method"], scope["path"]
        if method == "POST" and path in ("/sandboxes", "/v2/sandboxes"):
            await self.forwarder.forwarded_by_body(
                "snapshot", ("templateID",), scope, receive, send, self.control)
            return
        named = control_target(method, path)
        if named is not None and await self.forwarder.forwarded(*named, scope, receive, send):
            return
        await self.control(scope, receive, send)


def control_target(method: str, path: str) -> tuple[str, str] | None:
    """What one control-plane call is for: ("sandbox", id) or ("snapshot",
    id) (a template is a snapshot); None for the calls that make or list."""
    parts = path.split("/")[1:]
    if parts[:1] == ["v2"]:
        parts = parts[1:]
    if len(parts) >= 2 and parts[1]:
        if parts[0] == "sandboxes":
            return "sandbox", parts[1]
        if parts[0] == "templates" and method == "DELETE":
            return "snapshot", parts[1]
    return None
