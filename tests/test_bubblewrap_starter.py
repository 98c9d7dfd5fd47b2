"""The bubblewrap starter: the one thread that starts every keeper of this
process. An ephemeral sandbox's keeper dies with the thread that started it
(``--die-with-parent`` is the *thread*'s death), so that thread must outlive
any error of its own: an error it meets (making a spare network namespace,
say) fails one start at most, never the sandboxes already running, and
never leaves a start waiting for an answer that cannot come."""

from __future__ import annotations

import contextlib
import time
from typing import Any

import anyio
import pytest

import hutch
from hutch._errors import ProviderError
from hutch.providers.bubblewrap import provisioning, starter
from tests.conftest import TEST_IMAGE

pytestmark = [pytest.mark.anyio, pytest.mark.docker]


async def _make(runtime: str) -> Any:
    return await hutch.create_sandbox(
        "bubblewrap", image=TEST_IMAGE, ephemeral=True, read_before_write=False,
        runtime=runtime,
    )


def _failing(error: BaseException) -> Any:
    def new_netns(host_net: int) -> int:
        raise error
    return new_netns


@pytest.mark.parametrize("error", [
    ProviderError("unshare(CLONE_NEWNET): No space left on device"),  # the kernel refuses
    RuntimeError("a bug of its own"),
], ids=["refused", "bug"])
@pytest.mark.parametrize("runtime", ["native", "agent"])
async def test_an_error_of_the_starter_ends_no_sandbox_and_hangs_no_start(
    monkeypatch: pytest.MonkeyPatch, runtime: str, error: BaseException
) -> None:
    # A starter of this test's own: one that gave up its spares before
    # (after an error) would never meet this one.
    monkeypatch.setattr(provisioning, "STARTER", starter.Starter())
    running = await _make(runtime)
    try:
        assert (await running.exec("echo before")).stdout == "before\n"
        # The starter makes its spare network namespaces while no start
        # waits: from now on, each making fails.
        real_new_netns = starter.new_netns
        monkeypatch.setattr(starter, "new_netns", _failing(error))
        started = time.monotonic()
        later: Any = None
        with anyio.fail_after(60):  # a start whose answer never came would hang here
            # Each start takes a spare, or fails with the error when none is
            # left; the refill after it fails.
            with contextlib.suppress(type(error)):
                later = await _make(runtime)
            await anyio.sleep(0.5)  # the refill's failure, after the start
            with contextlib.suppress(type(error)):
                await (await _make(runtime)).close()
        assert time.monotonic() - started < 60
        # The sandbox started before, and the one started beside the failure, live on.
        assert (await running.exec("echo after")).stdout == "after\n"
        if later is not None:
            assert (await later.exec("echo later")).stdout == "later\n"
            await later.close()
        monkeypatch.setattr(starter, "new_netns", real_new_netns)
        fresh = await _make(runtime)
        try:
            assert (await fresh.exec("echo fresh")).stdout == "fresh\n"
        finally:
            await fresh.close()
    finally:
        await running.close()
