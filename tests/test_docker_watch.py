"""Docker's event stream as hutch's watcher reads it: nothing that happens
between the watch's start and its stream's connection (or during a
reconnect) is lost, because the stream is asked to replay from then."""

from __future__ import annotations

import time
import uuid
from typing import Any

import anyio
import docker
import pytest

from hutch.providers import _docker_engine as docker_engine
from hutch.providers.base import RuntimeNotice
from hutch.providers.docker.labels import MANAGED_LABEL, SANDBOX_LABEL
from hutch.providers.docker.watch import watch_runtimes
from tests.conftest import TEST_IMAGE

pytestmark = [pytest.mark.anyio, pytest.mark.docker]


class SlowToConnect:
    """The real Engine, whose event stream opens ``delay`` seconds late (a
    loaded host): whatever dies meanwhile must still be told."""

    def __init__(self, real: Any, delay: float) -> None:
        self._real = real
        self._delay = delay

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def events(self, *args: Any, **kwargs: Any) -> Any:
        time.sleep(self._delay)
        return self._real.events(*args, **kwargs)


async def test_a_death_before_the_event_stream_opens_is_told(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    api = docker.APIClient()
    sandbox_id = f"sb-watch-{uuid.uuid4().hex[:8]}"
    container = api.create_container(
        TEST_IMAGE, ["sleep", "60"],
        labels={MANAGED_LABEL: "1", SANDBOX_LABEL: sandbox_id},
    )["Id"]
    api.start(container)
    told = anyio.Event()

    async def report(notice: RuntimeNotice) -> None:
        if notice.sandbox_id == sandbox_id:
            told.set()

    monkeypatch.setattr(docker_engine, "_api_client",
                        SlowToConnect(docker_engine.engine(), delay=2.0))
    try:
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(watch_runtimes, report)
            await anyio.sleep(0.5)  # the watch has begun; its stream is not open yet
            api.kill(container)
            with anyio.fail_after(20):
                await told.wait()
            tasks.cancel_scope.cancel()
    finally:
        api.remove_container(container, force=True)
