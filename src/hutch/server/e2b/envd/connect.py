"""The Connect protocol with its JSON codec, as envd speaks it to the e2b SDKs.

Unary calls: a JSON body in (``application/json``), a JSON body out with 200,
or an error as ``{"code", "message"}`` with the HTTP status of its code.
Streams (``application/connect+json``): each message is an envelope, one flag
byte, a 4-byte big-endian length and the JSON; a server stream ends with an
envelope flagged :data:`END_STREAM` holding ``{}`` or ``{"error": {...}}``.
The rules of proto3's JSON mapping the messages follow are here too: int64 as
a decimal string, bytes as base64, times as RFC 3339.
"""

from __future__ import annotations

import base64
import binascii
import datetime
import json
import struct
from collections.abc import Iterator
from typing import Any

from ...._errors import (
    CapabilityUnsupported,
    ExecTimeout,
    HutchError,
    NotFound,
    OutputLimitExceeded,
    ResourceExhausted,
    SandboxExpired,
    SandboxFileExists,
    SandboxFileNotFound,
    SandboxIsADirectory,
    SandboxNotADirectory,
    SandboxPermissionDenied,
    SandboxUnavailable,
    StdinClosed,
    Unauthorized,
)

#: The media type of a unary call's body, and of every error.
UNARY_JSON = "application/json"
#: The media type of a streaming call's envelopes, exactly as the SDKs check it.
STREAM_JSON = "application/connect+json"

#: Flag bits of an envelope.
COMPRESSED = 0x01
END_STREAM = 0x02

_PREFIX = struct.Struct(">BI")

#: The most one request envelope may hold (an SDK's messages are small; stdin
#: comes in pieces).
MAX_MESSAGE_BYTES = 16 * 1024 * 1024

#: Connect's codes and the HTTP status a unary error carries for each.
HTTP_STATUS = {
    "canceled": 499, "unknown": 500, "invalid_argument": 400, "deadline_exceeded": 504,
    "not_found": 404, "already_exists": 409, "permission_denied": 403,
    "resource_exhausted": 429, "failed_precondition": 400, "aborted": 409,
    "out_of_range": 400, "unimplemented": 501, "internal": 500, "unavailable": 503,
    "data_loss": 500, "unauthenticated": 401,
}


class ConnectError(Exception):
    """An RPC's failure as the Connect protocol names it."""

    def __init__(self, code: str, message: str) -> None:
        if code not in HTTP_STATUS:
            raise ValueError(f"not a Connect code: {code!r}")
        super().__init__(message)
        self.code = code
        self.message = message

    @property
    def http_status(self) -> int:
        return HTTP_STATUS[self.code]

    def wire(self) -> dict[str, str]:
        return {"code": self.code, "message": self.message}


#: hutch's errors by the Connect code the SDKs turn into the matching exception
#: (most specific first: ``isinstance`` picks the first that holds).
_CODES: list[tuple[type[HutchError], str]] = [
    (SandboxFileNotFound, "not_found"),
    (NotFound, "not_found"),
    (SandboxIsADirectory, "invalid_argument"),
    (SandboxFileExists, "already_exists"),
    (SandboxNotADirectory, "invalid_argument"),
    (StdinClosed, "failed_precondition"),
    (SandboxPermissionDenied, "permission_denied"),
    (ExecTimeout, "deadline_exceeded"),
    (OutputLimitExceeded, "resource_exhausted"),
    (ResourceExhausted, "resource_exhausted"),
    (SandboxExpired, "unavailable"),
    (SandboxUnavailable, "unavailable"),
    (Unauthorized, "unauthenticated"),
    (CapabilityUnsupported, "unimplemented"),
]


def connect_error(exc: BaseException) -> ConnectError:
    """The Connect error a failure of an RPC answers with."""
    if isinstance(exc, ConnectError):
        return exc
    if isinstance(exc, HutchError):
        for kind, code in _CODES:
            if isinstance(exc, kind):
                return ConnectError(code, exc.message)
        if exc.http_status == 400:
            return ConnectError("invalid_argument", exc.message)
        if exc.http_status == 409:
            return ConnectError("failed_precondition", exc.message)
        return ConnectError("unavailable" if exc.http_status == 502 else "internal", exc.message)
    return ConnectError("internal", f"{type(exc).__name__}: {exc}")


# -- messages ------------------------------------------------------------------------------------


def encode(message: dict[str, Any]) -> bytes:
    """A message's JSON, compact (as protojson writes it)."""
    return json.dumps(message, ensure_ascii=False, separators=(",", ":")).encode()


def decode(body: bytes) -> dict[str, Any]:
    """A request message: a JSON object (an empty body is the empty message)."""
    if not body.strip():
        return {}
    try:
        message = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConnectError("invalid_argument", f"the request is not JSON: {exc}") from None
    if not isinstance(message, dict):
        raise ConnectError("invalid_argument", "the request message is not a JSON object")
    return message


# -- envelopes -----------------------------------------------------------------------------------


def envelope(message: dict[str, Any]) -> bytes:
    """One message of a stream, enveloped."""
    data = encode(message)
    return _PREFIX.pack(0, len(data)) + data


def end_stream(error: ConnectError | None = None) -> bytes:
    """The envelope that ends a server stream, with its error if it failed."""
    data = encode({} if error is None else {"error": error.wire()})
    return _PREFIX.pack(END_STREAM, len(data)) + data


class EnvelopeReader:
    """Envelopes out of a request body that arrives in pieces (a client
    stream's, or a server stream's one request)."""

    def __init__(self, max_bytes: int = MAX_MESSAGE_BYTES) -> None:
        self._buffer = bytearray()
        self._max = max_bytes

    def feed(self, data: bytes) -> Iterator[tuple[int, bytes]]:
        """The whole envelopes ``data`` completes: (flags, payload) each."""
        self._buffer.extend(data)
        while len(self._buffer) >= _PREFIX.size:
            flags, length = _PREFIX.unpack_from(self._buffer)
            if length > self._max:
                raise ConnectError(
                    "resource_exhausted",
                    f"a message of {length} bytes is over the limit of {self._max}",
                )
            if flags & COMPRESSED:
                raise ConnectError("internal", "compressed messages are not accepted")
            if len(self._buffer) < _PREFIX.size + length:
                return
            payload = bytes(self._buffer[_PREFIX.size:_PREFIX.size + length])
            del self._buffer[:_PREFIX.size + length]
            yield flags, payload

    def finish(self) -> None:
        """The body has ended: a piece of an envelope left over is an error."""
        if self._buffer:
            raise ConnectError(
                "invalid_argument", f"the request ended inside an envelope ({len(self._buffer)} "
                "bytes left over)",
            )


# -- proto3's JSON mapping -----------------------------------------------------------------------


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def unb64(text: Any, field: str) -> bytes:
    """A bytes field: standard or URL-safe base64, padded or not."""
    if not isinstance(text, str):
        raise ConnectError("invalid_argument", f"{field} must be base64 text")
    text = text.replace("-", "+").replace("_", "/")
    try:
        return base64.b64decode(text + "=" * (-len(text) % 4), validate=True)
    except (binascii.Error, ValueError):
        raise ConnectError("invalid_argument", f"{field} is not base64") from None


def int64(value: int) -> str:
    """An int64 or uint64 field: a decimal string."""
    return str(value)


def timestamp(unix: float) -> str:
    """A ``google.protobuf.Timestamp``: RFC 3339 in UTC with a ``Z``, nanoseconds at most."""
    whole = int(unix // 1)
    nanos = round((unix - whole) * 1e9)
    if nanos >= 1_000_000_000:
        whole, nanos = whole + 1, nanos - 1_000_000_000
    moment = datetime.datetime.fromtimestamp(whole, datetime.UTC)
    text = moment.strftime("%Y-%m-%dT%H:%M:%S")
    if nanos:
        fraction = f"{nanos:09d}"
        # protojson writes 0, 3, 6 or 9 digits
        for digits in (3, 6):
            if fraction[digits:] == "0" * (9 - digits):
                fraction = fraction[:digits]
                break
        text += "." + fraction
    return text + "Z"


def member(message: dict[str, Any], name: str) -> Any:
    """A field by its JSON name (lowerCamelCase) or its proto name (snake_case),
    both of which proto3's JSON parsers accept."""
    if name in message:
        return message[name]
    snake = "".join(f"_{c.lower()}" if c.isupper() else c for c in name)
    return message.get(snake)


def uint(message: dict[str, Any], name: str, *, default: int = 0) -> int:
    """An integer field: a JSON number or a decimal string."""
    value = member(message, name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | str | float):
        raise ConnectError("invalid_argument", f"{name} must be an integer")
    try:
        number = int(value) if not isinstance(value, float) or value.is_integer() else None
    except ValueError:
        number = None
    if number is None or number < 0 or number > 0xFFFFFFFF:
        raise ConnectError("invalid_argument", f"{name} must be an unsigned 32-bit integer")
    return number


def text(message: dict[str, Any], name: str, *, required: bool = False) -> str:
    value = member(message, name)
    if value is None or value == "":
        if required:
            raise ConnectError("invalid_argument", f"{name} is required")
        return ""
    if not isinstance(value, str):
        raise ConnectError("invalid_argument", f"{name} must be a string")
    return value


def flag(message: dict[str, Any], name: str) -> bool:
    value = member(message, name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ConnectError("invalid_argument", f"{name} must be true or false")
    return value


def submessage(message: dict[str, Any], name: str) -> dict[str, Any] | None:
    value = member(message, name)
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ConnectError("invalid_argument", f"{name} must be an object")
    return value
