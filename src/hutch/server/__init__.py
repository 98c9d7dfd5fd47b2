"""``hutch serve``: the control plane over HTTP (see docs/wire.md)."""

from __future__ import annotations

import ipaddress
import logging
import math
import os

from .._errors import InvalidArgument
from .app import ServerSettings, create_app

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8787


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def serve(
    host: str = DEFAULT_HOST,
    port: int = DEFAULT_PORT,
    token: str | None = None,
    data_dir: str | None = None,
    retention_seconds: float | None = None,
) -> None:
    """Run the daemon until interrupted. Refuses a non-loopback bind without a token."""
    import uvicorn

    token = token or os.environ.get("HUTCH_TOKEN") or None
    if not is_loopback(host) and not token:
        raise InvalidArgument(
            f"refusing to listen on {host} without a token: anyone who reaches it could run "
            "commands; pass --token (or HUTCH_TOKEN), or bind to 127.0.0.1"
        )
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if retention_seconds is not None and not 0 < retention_seconds < math.inf:
        raise InvalidArgument(
            f"retention must be a positive number of seconds, got {retention_seconds!r}"
        )
    settings = ServerSettings(data_dir=data_dir, token=token)
    if retention_seconds is not None:
        settings.retention_seconds = retention_seconds
    app = create_app(settings)
    # The asyncio loop, not uvloop: uvloop notices a child's exit ~4 ms late,
    # which would be most of an exec's cost.
    uvicorn.run(
        app, host=host, port=port, http="httptools", loop="asyncio", log_level="warning",
        access_log=False, timeout_graceful_shutdown=5,
    )


__all__ = ["DEFAULT_HOST", "DEFAULT_PORT", "ServerSettings", "create_app", "is_loopback", "serve"]
