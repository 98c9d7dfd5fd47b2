"""A daemon ref as it travels: the daemon's address, the sandbox, the ref's id
and its secret, in one opaque string a client presents as a bearer token.

It is one string so that it can be handed over as it is (an argument, an
environment variable) and ``hutch.attach(ref)`` needs nothing else.
"""

from __future__ import annotations

import base64
import binascii
import json
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import quote, unquote

from ._errors import InvalidArgument

REF_PREFIX = "hutch-ref:"


@dataclass(frozen=True)
class DaemonRef:
    url: str
    sandbox_id: str
    ref_id: str
    secret: str

    def encode(self) -> str:
        body = json.dumps(
            {"url": self.url, "sandbox": self.sandbox_id, "id": self.ref_id, "secret": self.secret},
            separators=(",", ":"),
        ).encode()
        return REF_PREFIX + base64.urlsafe_b64encode(body).decode().rstrip("=")


def decode_ref(token: str) -> DaemonRef | None:
    """The ref ``token`` is, or None when it is not one (a plain daemon token)."""
    if not token.startswith(REF_PREFIX) or len(token) > 4096:
        return None
    body = token[len(REF_PREFIX):]
    try:
        data = json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))
        ref = DaemonRef(str(data["url"]), str(data["sandbox"]), str(data["id"]),
                        str(data["secret"]))
    except (binascii.Error, ValueError, KeyError, TypeError):
        return None
    return ref


#: The address of a server on a unix socket (an in-process owner serving its
#: sandbox, see hutch.server.owner): the socket's path, percent-encoded.
UNIX_SCHEME = "http+unix://"
#: The host name requests to a unix socket carry (any would do: the socket is the address).
UNIX_HOST = "hutch-owner"


def unix_url(path: str) -> str:
    return UNIX_SCHEME + quote(path, safe="")


def unix_socket_of(url: str) -> str | None:
    """The socket path a ``http+unix://`` address names; None for any other address."""
    if not url.startswith(UNIX_SCHEME):
        return None
    return unquote(url[len(UNIX_SCHEME):].rstrip("/"))


#: Longest a ref may live: a year, as every duration the API takes.
MAX_REF_SECONDS = 365 * 86400.0


def check_ref_lifetime(expires_in: float) -> None:
    if (
        isinstance(expires_in, bool)
        or not isinstance(expires_in, int | float)
        or not 0 < expires_in <= MAX_REF_SECONDS
    ):
        raise InvalidArgument(
            f"expires_in must be a number of seconds above 0 and at most {MAX_REF_SECONDS:g}, "
            f"got {expires_in!r}"
        )


class RefFields(Protocol):
    """What an attachment's listing needs of its ref (a store's ``RefRow``)."""

    @property
    def id(self) -> str: ...

    @property
    def expires_at_unix(self) -> float | None: ...


def attachment_json(
    session: str, ref: RefFields, attached_at_unix: float, last_used_unix: float | None
) -> dict[str, Any]:
    """One attached session as SandboxInfo lists it, in-process or through a server."""
    return {"session": session, "ref_id": ref.id, "attached_at_unix": attached_at_unix,
            "last_used_unix": last_used_unix, "expires_at_unix": ref.expires_at_unix}
