"""Slow or idle clients cannot hold the daemon.

uvicorn closes an idle keep-alive connection, but it waits forever for a
connection that never finishes its request head, or a body that trickles in
a byte at a time, and takes as many connections as the process has file
descriptors. The protocol here, uvicorn's httptools protocol plus three
rules, closes:

- a connection whose request head (request line and headers) is not complete
  ``head_timeout`` seconds after its first byte (or after it was opened);
- a request whose body arrives slower, on average, than ``min_body_rate``
  bytes a second after a ``body_grace`` of seconds;
- past ``max_connections``, the connection that has waited longest without
  a request under way (so a flood of idle connections cannot lock out a
  well-behaved client), or the new one if every connection is busy.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import time
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

log = logging.getLogger("hutch.server")

#: Seconds a client has to send a complete request head.
HEAD_TIMEOUT = 5.0
#: Seconds any body may take before its average rate is held to MIN_BODY_RATE.
BODY_GRACE = 10.0
#: Bytes a second a body must average after the grace (a slow link passes).
MIN_BODY_RATE = 32 * 1024
#: Most connections open at once, unless the descriptor limit allows fewer.
DEFAULT_MAX_CONNECTIONS = 4096


def raise_descriptor_limit() -> int:
    """Raise this process's open-files limit to its hard limit; return the new soft one."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 65536)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return soft


def connection_cap(requested: int | None = None) -> int:
    """Connections the daemon takes at once: half its descriptors at most
    (the rest are for sandboxes, the store, the providers' own connections)."""
    cap = requested or DEFAULT_MAX_CONNECTIONS
    return max(1, min(cap, raise_descriptor_limit() // 2))


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    head_timeout: float = HEAD_TIMEOUT
    body_grace: float = BODY_GRACE
    min_body_rate: float = MIN_BODY_RATE
    max_connections: int = DEFAULT_MAX_CONNECTIONS

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        self._body_started = 0.0
        self._body_received = 0
        self._opened = 0.0

    # -- connection --------------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._opened = time.monotonic()
        if len(self.connections) > self.max_connections and sum(
            1 for c in self.connections if not c.transport.is_closing()
        ) > self.max_connections:
            # Make room by closing the connection that has waited longest
            # without a request under way; if every one is working, this one.
            # (Those already closing stay in the set until the loop tells them.)
            idle = [c for c in self.connections
                    if isinstance(c, GuardedHttpToolsProtocol) and c is not self and c.idle
                    and not c.transport.is_closing()]
            oldest = min(idle, key=lambda c: c._opened, default=None)
            if oldest is None:
                log.warning("%d connections, all busy: refusing a new one", len(self.connections))
                transport.abort()
                return
            oldest.transport.abort()
        self._arm_head_timer()

    @property
    def idle(self) -> bool:
        """Waiting for a request head (new, slow, or kept alive between requests)."""
        return self._head_timer is not None or self.timeout_keep_alive_task is not None

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        self._stop_body_watch()
        super().connection_lost(exc)

    def _close(self, why: str) -> None:
        if not self.transport.is_closing():
            log.info("closing a connection from %s: %s", self.client, why)
            self.transport.close()

    # -- the request head --------------------------------------------------------------
    def _arm_head_timer(self) -> None:
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(
                self.head_timeout, self._close,
                f"no complete request head in {self.head_timeout:g} s",
            )

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._arm_head_timer()  # a keep-alive connection's next request

    def on_headers_complete(self) -> None:
        self._cancel_head_timer()
        super().on_headers_complete()
        self._body_started = time.monotonic()
        self._body_received = 0
        self._schedule_body_check()

    # -- the body ----------------------------------------------------------------------
    def _schedule_body_check(self) -> None:
        self._body_timer = self.loop.call_later(1.0, self._check_body)

    def _check_body(self) -> None:
        if self.flow.read_paused:
            # The app has not read what came (uvicorn stops reading past its
            # buffer): the time is ours, not the client's.
            self._body_started += 1.0
        elapsed = time.monotonic() - self._body_started
        if elapsed > self.body_grace + self._body_received / self.min_body_rate:
            self._body_timer = None
            self._close(
                f"request body too slow ({self._body_received} bytes in {elapsed:.0f} s)"
            )
            return
        self._schedule_body_check()

    def _stop_body_watch(self) -> None:
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None

    def on_body(self, body: bytes) -> None:
        self._body_received += len(body)
        super().on_body(body)

    def on_message_complete(self) -> None:
        self._stop_body_watch()
        super().on_message_complete()


def guarded_protocol(
    max_connections: int, head_timeout: float = HEAD_TIMEOUT
) -> type[GuardedHttpToolsProtocol]:
    """The protocol class uvicorn is given, with this daemon's numbers."""
    return type(
        "HutchHttpProtocol", (GuardedHttpToolsProtocol,),
        {"max_connections": max_connections, "head_timeout": head_timeout},
    )
