"""The E2B wire's credentials.

``X-API-KEY`` (the control plane) carries a hutch token or a sandbox's ref.
E2B's own keys are ``e2b_`` and hex, and SDKs up to 2.45 refuse any other
shape before sending it (``^e2b_[0-9a-f]+$`` in their ``api/__init__.py``),
so any hutch credential can also be written that way: ``e2b_`` followed by
the hex of its UTF-8 bytes (:func:`hutch._e2bkey.e2b_key`, what
``hutch token --e2b`` prints). The server reads both forms.

The in-sandbox API carries no API key: the SDKs send the
``envdAccessToken`` that create and connect answered, as ``X-Access-Token``.
hutch's is an HMAC of the sandbox's id under the daemon's secret (so it
opens that one sandbox and no other, and needs no storage), or the ref the
connect was made with, when it was (so that revoking the ref closes it too).
"""

from __future__ import annotations

import hashlib
import hmac

from ..._e2bkey import E2B_KEY_PREFIX, credential_of, e2b_key

#: Marks an envd access token that is an HMAC (not a ref).
ACCESS_TOKEN_PREFIX = "hutch-envd-"


def envd_access_token(secret: bytes, sandbox_id: str) -> str:
    """The in-sandbox credential of one sandbox."""
    digest = hmac.new(secret, b"e2b-envd\0" + sandbox_id.encode(), hashlib.sha256)
    return ACCESS_TOKEN_PREFIX + digest.hexdigest()


def is_envd_access_token(secret: bytes, sandbox_id: str, given: str) -> bool:
    """Whether ``given`` is :func:`envd_access_token` of ``sandbox_id`` (in constant time)."""
    return hmac.compare_digest(given.encode(), envd_access_token(secret, sandbox_id).encode())


__all__ = ["ACCESS_TOKEN_PREFIX", "E2B_KEY_PREFIX", "credential_of", "e2b_key",
           "envd_access_token", "is_envd_access_token"]
