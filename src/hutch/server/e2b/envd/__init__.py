"""The in-sandbox API of E2B (envd) over hutch's sandboxes: the Connect
protocol's process and filesystem services, ``/files`` and ``/health``.

The dispatch (:mod:`..dispatch`) has checked the request's ``X-Access-Token``
before it comes here; :func:`..dispatch.caller_of` says which daemon and
sandbox it is for. What the SDKs may use of it is said by ``envdVersion``
(:data:`..versions.ENVD_VERSION`).
"""

from __future__ import annotations

from ...asgi import ASGIApp, Scope
from ..dispatch import caller_of
from .app import EnvdApp


def envd_app() -> ASGIApp:
    """The ASGI application answering the in-sandbox API."""

    def sandbox_id(scope: Scope) -> str | None:
        return caller_of(scope).sandbox_id

    return EnvdApp(lambda scope: caller_of(scope).daemon, sandbox_id)


__all__ = ["EnvdApp", "envd_app"]
