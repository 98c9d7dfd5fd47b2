"""The E2B wire: ``hutch serve`` answers the unmodified E2B SDKs (docs/e2b.md).

:func:`mount` puts it in front of hutch's own API on the same port;
:mod:`.dispatch` says which requests are E2B's and checks their credentials,
:mod:`.control` is the control plane, :mod:`.envd` the in-sandbox API,
:mod:`.preview` the sandboxes' ports, :mod:`.keys` the credentials and
:mod:`.errors` every error body.
"""

from __future__ import annotations

from collections.abc import Callable

from fastapi import FastAPI

from ...daemon import Daemon
from ..asgi import ASGIApp
from ..middleware import BodyLimit, CancelOnDisconnect
from .control import control_app
from .dispatch import E2BWire
from .envd import envd_app
from .preview import preview_app


def mount(
    app: FastAPI, *, daemon: Callable[[], Daemon | None], token: str | None, max_body_bytes: int,
) -> None:
    """Answer the E2B wire on ``app``'s port: call it after the app's other
    middleware, so that it comes first (E2B requests carry E2B's
    credentials, not hutch's bearer token)."""
    control = control_app()

    def guarded(inner: ASGIApp) -> ASGIApp:
        return CancelOnDisconnect(BodyLimit(inner, max_bytes=max_body_bytes))

    app.add_middleware(
        E2BWire, daemon=daemon, token=token, control=guarded(control),
        envd=guarded(envd_app()), preview=CancelOnDisconnect(preview_app()),
    )


__all__ = ["mount"]
