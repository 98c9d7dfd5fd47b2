"""What an envd call knows of its caller: the sandbox it names, the user it
runs as, its deadline and how often it wants a keepalive."""

from __future__ import annotations

import base64
import binascii
import time
from dataclasses import dataclass

from ...._sandbox import Sandbox
from ...asgi import Scope, header
from .connect import ConnectError

#: The header naming the sandbox of an in-sandbox call.
SANDBOX_HEADER = b"e2b-sandbox-id"
#: The header asking for keepalive events on a stream, every so many seconds.
KEEPALIVE_HEADER = b"keepalive-ping-interval"
#: The header of a call's deadline, in milliseconds.
TIMEOUT_HEADER = b"connect-timeout-ms"


def sandbox_id_of(scope: Scope) -> str | None:
    return header(scope, SANDBOX_HEADER)


def user_of(scope: Scope) -> str | None:
    """The user an SDK asks to run as: ``Authorization: Basic base64("user:")``
    (the SDKs send it only when a call names a user). None: the default."""
    value = header(scope, b"authorization")
    if value is None:
        return None
    scheme, _, credential = value.strip().partition(" ")
    if scheme.lower() != "basic":
        return None
    try:
        decoded = base64.b64decode(credential.strip(), validate=True).decode()
    except (binascii.Error, UnicodeDecodeError):
        raise ConnectError("invalid_argument", "the Basic authorization is not base64") from None
    user = decoded.partition(":")[0]
    return user or None


def timeout_of(scope: Scope) -> float | None:
    """The call's deadline in seconds from now (None: no deadline)."""
    value = header(scope, TIMEOUT_HEADER)
    if not value:
        return None
    if len(value) > 10 or not value.isdigit():
        raise ConnectError(
            "invalid_argument", f"Connect-Timeout-Ms must be 1 to 10 digits, got {value!r}")
    milliseconds = int(value)
    return None if milliseconds == 0 else milliseconds / 1000


def keepalive_of(scope: Scope) -> float | None:
    value = header(scope, KEEPALIVE_HEADER)
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        return None
    return seconds if 0 < seconds < 86400 else None


@dataclass
class Call:
    """One call into a sandbox's envd."""

    sandbox: Sandbox
    #: None: the sandbox's default user.
    user: str | None
    #: time.monotonic() past which the call has failed (None: never).
    deadline: float | None
    #: Seconds between keepalive events on a quiet stream (None: none asked).
    keepalive: float | None

    @classmethod
    def of(cls, scope: Scope, sandbox: Sandbox) -> Call:
        timeout = timeout_of(scope)
        return cls(
            sandbox=sandbox, user=user_of(scope),
            deadline=None if timeout is None else time.monotonic() + timeout,
            keepalive=keepalive_of(scope),
        )

    @property
    def timeout(self) -> float | None:
        """Seconds left until the deadline (None: no deadline)."""
        return None if self.deadline is None else max(0.0, self.deadline - time.monotonic())
