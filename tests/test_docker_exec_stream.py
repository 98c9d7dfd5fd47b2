"""A docker exec (native runtime) never hangs and never lies about its output.

An exec's output comes back over the connection the Engine hijacks for it.
The HTTP client reads the response's headers through a buffered reader, which
may read the first frames of output with them when the command is fast and
the reading thread slow (under load: one fast exec in a hundred while pauses
ran answered exit 0 and no output): those bytes are the stream's start, not
lost. And once the command's process is gone, its output stream must end in
a bounded time: an exec whose stream the Engine never ends (seen under load:
its output all there, its process long gone, the Engine still saying it ran)
fails with a clear error instead of waiting forever.
"""

from __future__ import annotations

import http.client
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

import hutch
from hutch.providers import docker as docker_provider
from tests.conftest import TEST_IMAGE

pytestmark = [pytest.mark.anyio, pytest.mark.docker]


@pytest.fixture
async def sb() -> AsyncIterator[Any]:
    async with await hutch.create_sandbox(
        "docker", image=TEST_IMAGE, runtime="native"
    ) as sandbox:
        yield sandbox


class SlowToReadHeaders:
    """The real Engine, whose exec starts' answers are read late, as a loaded
    client reads them: by then the command has run and its output waits on
    the connection behind the response's headers."""

    def __init__(self, real: Any, late: threading.local) -> None:
        self._real = real
        self._late = late

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def exec_start(self, *args: Any, **kwargs: Any) -> Any:
        self._late.on = True
        try:
            return self._real.exec_start(*args, **kwargs)
        finally:
            self._late.on = False


async def test_output_read_with_the_headers_is_kept(
    sb: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    late = threading.local()
    read_headers = http.client.HTTPResponse.begin

    def begin_late(response: http.client.HTTPResponse) -> None:
        if getattr(late, "on", False):
            time.sleep(1.0)  # the command runs and writes meanwhile
        read_headers(response)

    monkeypatch.setattr(http.client.HTTPResponse, "begin", begin_late)
    monkeypatch.setattr(
        docker_provider, "_api_client", SlowToReadHeaders(docker_provider.engine(), late)
    )
    for n in range(3):
        result = await sb.exec(["sh", "-c", f"echo out-{n}; echo err-{n} >&2"])
        assert (result.exit_code, result.stdout, result.stderr) == (
            0, f"out-{n}\n", f"err-{n}\n"), result
    big = await sb.exec(["head", "-c", "300000", "/dev/zero"])  # more than the reader's buffer
    assert big.stdout_bytes == bytes(300000), len(big.stdout_bytes)
