"""A Docker Engine client whose exec starts' answers are read late, as a
loaded machine's thread reads them: by then the command has run and its
first output waits on the connection behind the response's headers, where
docker-py's buffered reader takes it with them (the docker provider's
``read_ahead`` and the kubernetes stand-in's exec must serve it)."""

from __future__ import annotations

import http.client
import threading
import time
from typing import Any

import pytest


class SlowToReadHeaders:
    """``real`` (a docker-py APIClient), its ``exec_start`` answers read late."""

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


def exec_headers_read_late(
    monkeypatch: pytest.MonkeyPatch, api: Any, seconds: float
) -> SlowToReadHeaders:
    """``api`` whose exec starts' response headers are read ``seconds`` late
    (for the test's duration); put it where the code under test finds its client."""
    late = threading.local()
    read_headers = http.client.HTTPResponse.begin

    def begin_late(response: http.client.HTTPResponse) -> None:
        if getattr(late, "on", False):
            time.sleep(seconds)  # the command runs and writes meanwhile
        read_headers(response)

    monkeypatch.setattr(http.client.HTTPResponse, "begin", begin_late)
    return SlowToReadHeaders(api, late)
