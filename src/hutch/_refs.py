"""``hutch.attach(ref)``: a non-owning session on a sandbox someone else owns.

A ref from an in-process sandbox (:meth:`hutch.Sandbox.ref`) gives an attached
:class:`hutch.Sandbox` in this process; a ref from a daemon carries the
daemon's address and is itself the credential, so that it needs no other
configuration and gives a :class:`hutch.client.RemoteSandbox`.
"""

from __future__ import annotations

from typing import Any

from ._sandbox import LOCAL_REF_PREFIX, attach_local


def attach(ref: str) -> Any:
    """Attach to the sandbox ``ref`` names. Closing the session only detaches it."""
    if isinstance(ref, str) and ref.startswith(LOCAL_REF_PREFIX):
        return attach_local(ref)
    from .client import attach_remote

    return attach_remote(ref)
