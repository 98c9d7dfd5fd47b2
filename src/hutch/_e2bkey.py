"""hutch's credentials in E2B's API key format.

E2B's keys are ``e2b_`` and hex, and its Python SDK up to 2.45 refuses any
other shape before sending it (``^e2b_[0-9a-f]+$``), so any hutch token or
ref can also be written that way: ``e2b_`` followed by the hex of its UTF-8
bytes. ``hutch token --e2b`` prints it; the daemon reads both forms
(hutch.server.e2b).
"""

from __future__ import annotations

import binascii
import re

E2B_KEY_PREFIX = "e2b_"
_E2B_KEY = re.compile(r"\Ae2b_((?:[0-9a-f]{2})+)\Z")


def e2b_key(credential: str) -> str:
    """``credential`` (a hutch token or ref) in E2B's key format."""
    return E2B_KEY_PREFIX + credential.encode().hex()


def credential_of(api_key: str) -> list[str]:
    """The hutch credentials an E2B API key may stand for, the likeliest
    first: an ``e2b_<hex>`` key decoded, then the key as it came."""
    match = _E2B_KEY.match(api_key)
    if match is None:
        return [api_key]
    try:
        decoded = binascii.unhexlify(match.group(1)).decode()
    except (binascii.Error, UnicodeDecodeError):
        return [api_key]
    return [decoded, api_key]
