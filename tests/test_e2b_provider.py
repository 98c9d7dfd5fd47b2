"""The ``e2b`` provider through a daemon: hutch's own lifecycle over E2B's
sandboxes, with a second ``hutch serve`` standing in for E2B's service (its
conformance run is in tests/conformance)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

import hutch
from hutch._e2bkey import e2b_key
from tests.conftest import TEST_IMAGE

from .daemon_fixture import DaemonProcess

pytestmark = [pytest.mark.docker, pytest.mark.slow]


@pytest.fixture(scope="module")
def e2b_service() -> Iterator[DaemonProcess]:
    standin = DaemonProcess(provider="docker").start()
    try:
        yield standin
    finally:
        standin.close()


def test_a_suspended_e2b_sandbox_stays_suspended_across_a_restart(
    e2b_service: DaemonProcess,
) -> None:
    env = {"E2B_API_URL": e2b_service.url, "E2B_SANDBOX_URL": e2b_service.url,
           "E2B_API_KEY": e2b_key(e2b_service.token)}
    daemon = DaemonProcess(provider="e2b", extra_env=env).start()
    try:
        with hutch.Client(daemon.url, token=daemon.token) as client:
            sb = client.create_sandbox("e2b", template=TEST_IMAGE, read_before_write=False)
            sb.write_text("kept.txt", "across a restart")
            sb.suspend()
            assert sb.status().state.value == "suspended"
        # E2B's side: paused, not gone.
        with hutch.Client(e2b_service.url, token=e2b_service.token) as standin:
            assert [s["state"] for s in standin.list_sandboxes()] == ["paused"]
        daemon.restart()
        with hutch.Client(daemon.url, token=daemon.token) as client:
            again = client.get_sandbox(sb.id)
            # Found again as it was: its reconnection did not resume it.
            assert again.status().state.value == "suspended"
            assert again.read_text("kept.txt") == "across a restart"  # resumed by the call
            assert again.status().state.value == "running"
            assert again.exec("cat kept.txt").stdout == "across a restart"
            again.close()
        with hutch.Client(e2b_service.url, token=e2b_service.token) as standin:
            assert standin.list_sandboxes() == []
    finally:
        daemon.close()
