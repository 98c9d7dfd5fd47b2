"""Slow or idle clients cannot hold the daemon (a real daemon, raw sockets on loopback)."""

from __future__ import annotations

import contextlib
import select
import socket
import time
import uuid
from collections.abc import Iterator

import httpx
import pytest

from hutch._limits import CLIENT_IDLE_SECONDS
from tests.daemon_fixture import DaemonProcess


@pytest.fixture
def daemon() -> Iterator[DaemonProcess]:
    d = DaemonProcess(token=f"tok-{uuid.uuid4().hex}").start()
    yield d
    d.stop()


def connect(d: DaemonProcess) -> socket.socket:
    return socket.create_connection(("127.0.0.1", d.port), timeout=10)


def closed_by_peer(sock: socket.socket) -> bool:
    """Whether the daemon has closed this connection (EOF or reset), without waiting."""
    readable, _, _ = select.select([sock], [], [], 0)
    if not readable:
        return False
    try:
        return sock.recv(4096) == b""
    except OSError:
        return True


def wait_closed(socks: list[socket.socket], within: float) -> list[socket.socket]:
    """The sockets still open after ``within`` seconds."""
    deadline = time.monotonic() + within
    open_ = list(socks)
    while open_ and time.monotonic() < deadline:
        open_ = [s for s in open_ if not closed_by_peer(s)]
        time.sleep(0.2)
    return open_


def healthz_seconds(d: DaemonProcess) -> float:
    started = time.monotonic()
    answer = httpx.get(f"{d.url}/healthz", timeout=30,
                       headers={"Authorization": f"Bearer {d.token}"})
    assert answer.status_code == 200
    return time.monotonic() - started


def test_connections_without_a_whole_request_are_closed(daemon: DaemonProcess) -> None:
    socks = []
    try:
        for i in range(500):
            sock = connect(daemon)
            if i % 2:  # half send part of a head, half nothing at all
                sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: ")
            socks.append(sock)
        assert healthz_seconds(daemon) < 5  # served while they hang
        still_open = wait_closed(socks, within=30)
        assert still_open == [], f"{len(still_open)} of 500 still open"
        assert healthz_seconds(daemon) < 5
    finally:
        for sock in socks:
            sock.close()


def test_a_trickling_body_is_cut(daemon: DaemonProcess) -> None:
    with connect(daemon) as sock:
        sock.sendall(
            b"POST /v1/sandboxes HTTP/1.1\r\nHost: x\r\n"
            + f"Authorization: Bearer {daemon.token}\r\n".encode()
            + b"Content-Type: application/json\r\nContent-Length: 100000\r\n\r\n{"
        )
        started = time.monotonic()
        cut = False
        while time.monotonic() - started < 60:
            try:
                sock.sendall(b" ")
            except OSError:
                cut = True
                break
            if closed_by_peer(sock):
                cut = True
                break
            time.sleep(0.5)
        assert cut, "a body sent a byte every half second was still being taken after 60 s"
    assert healthz_seconds(daemon) < 5


def test_a_flood_of_idle_connections_is_capped_and_a_client_still_served() -> None:
    d = DaemonProcess(token=f"tok-{uuid.uuid4().hex}", extra_args=["--max-connections", "50"])
    d.start()
    socks = []
    try:
        socks = [connect(d) for _ in range(200)]
        # Well before the 5 s head timeout: the cap, not the timer, closed them.
        still_open = wait_closed(socks, within=2)
        assert len(still_open) <= 50, f"{len(still_open)} idle connections open past a cap of 50"
        assert healthz_seconds(d) < 5
    finally:
        for sock in socks:
            with contextlib.suppress(OSError):
                sock.close()
        d.stop()


def test_a_connection_kept_alive_outlasts_the_client_s_idle_keep(
    daemon: DaemonProcess,
) -> None:
    """A client keeps an idle connection for its next call up to its own idle
    expiry (httpx: 5 s), then drops it. The daemon keeps it open for longer:
    were both 5 s (uvicorn's own default), the daemon would close it at the
    moment a client sends its next call on it, and the call would fail as
    "not reachable" (a POST cannot be sent again: it may have been done)."""
    request = (b"GET /healthz HTTP/1.1\r\nHost: x\r\n"
               + f"Authorization: Bearer {daemon.token}\r\n\r\n".encode())
    with connect(daemon) as sock:
        sock.sendall(request)
        assert sock.recv(4096).startswith(b"HTTP/1.1 200")
        idle = CLIENT_IDLE_SECONDS + 1.5
        assert wait_closed([sock], within=idle) == [sock], (
            f"the daemon closed a connection idle for less than {idle} s")
        sock.sendall(request)
        assert sock.recv(4096).startswith(b"HTTP/1.1 200")

