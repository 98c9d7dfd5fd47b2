"""The dashboard's session: the token, given once to its login form, kept as
a cookie the server checks as it checks the bearer token.

The cookie holds no token: it holds when the session ends and an HMAC of
that time keyed by the token, so the server keeps no session table (a
daemon restarted, or another daemon of the fleet sharing the token, takes
it), a session ends on its own, and a new token ends every session made
with the old one. The cookie is ``HttpOnly`` (no script reads it) and
``SameSite=Strict`` (no other site's page sends it); and it counts only on a
request that also carries :data:`UI_HEADER`, which a form or a link of
another site cannot set: a request a page of another origin forges with the
cookie is refused like one without a credential.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from http.cookies import CookieError, SimpleCookie

from .asgi import Scope, header

#: The cookie's name.
COOKIE_NAME = "hutch_ui"
#: The header that must come with the cookie (the dashboard's scripts send it).
UI_HEADER = b"x-hutch-ui"
#: How long a session lasts from its login.
SESSION_SECONDS = 12 * 3600
#: What the HMAC signs besides the end time: a cookie is good for nothing else.
_PURPOSE = b"hutch-ui-session:"


def _signature(token: bytes, ends: int) -> str:
    return hmac.new(token, _PURPOSE + str(ends).encode(), hashlib.sha256).hexdigest()


def new_session(token: bytes, now: float | None = None) -> str:
    """A session's cookie value, good for :data:`SESSION_SECONDS` from ``now``."""
    ends = int(now if now is not None else time.time()) + SESSION_SECONDS
    return f"{ends}.{_signature(token, ends)}"


def session_is_valid(token: bytes, value: str, now: float | None = None) -> bool:
    """Whether ``value`` is a session made with ``token`` that has not ended."""
    ends_text, _, signature = value.partition(".")
    if not ends_text.isdigit() or len(ends_text) > 12:
        return False
    ends = int(ends_text)
    # Constant time: how much of a forged signature matched must not show.
    if not hmac.compare_digest(signature.encode(), _signature(token, ends).encode()):
        return False
    return ends > (now if now is not None else time.time())


def session_cookie(scope: Scope) -> str | None:
    """The session cookie a request carries, if it carries one."""
    raw = header(scope, b"cookie")
    if raw is None:
        return None
    jar: SimpleCookie = SimpleCookie()
    try:
        jar.load(raw)
    except CookieError:
        return None
    morsel = jar.get(COOKIE_NAME)
    return None if morsel is None else morsel.value


def session_authorizes(scope: Scope, token: bytes) -> bool:
    """Whether a request speaks with a dashboard session of ``token``: the
    cookie, valid, and the dashboard's header beside it."""
    if header(scope, UI_HEADER) is None:
        return False
    value = session_cookie(scope)
    return value is not None and session_is_valid(token, value)


def set_cookie_header(value: str, *, secure: bool) -> str:
    """The ``Set-Cookie`` of a new session (``secure``: the request came over TLS)."""
    return (f"{COOKIE_NAME}={value}; Path=/; Max-Age={SESSION_SECONDS}; HttpOnly; "
            f"SameSite=Strict" + ("; Secure" if secure else ""))


def clear_cookie_header(*, secure: bool) -> str:
    """The ``Set-Cookie`` that ends the browser's session."""
    return (f"{COOKIE_NAME}=; Path=/; Max-Age=0; HttpOnly; SameSite=Strict"
            + ("; Secure" if secure else ""))
