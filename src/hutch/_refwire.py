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
