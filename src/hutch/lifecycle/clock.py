"""Time, behind a seam: the real clocks, and a virtual one tests step by hand."""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def monotonic(self) -> float:
        """Seconds on a clock that never jumps (for every deadline)."""

    def time(self) -> float:
        """Unix time (for what callers are shown)."""


class RealClock:
    def monotonic(self) -> float:
        return time.monotonic()

    def time(self) -> float:
        return time.time()


class VirtualClock:
    """A clock that moves only when told to (``LifecycleEngine.advance``)."""

    def __init__(self, start_unix: float = 1_700_000_000.0) -> None:
        self._now = 0.0
        self._start_unix = start_unix

    def monotonic(self) -> float:
        return self._now

    def time(self) -> float:
        return self._start_unix + self._now

    def step(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError("a clock does not go back")
        self._now += seconds
