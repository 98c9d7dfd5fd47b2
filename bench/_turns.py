"""Lockstep between two benches of one script run on two commits' code
(``compare.py``): the turns they take."""

from __future__ import annotations

import os
import time

#: Set by ``compare.py`` when it runs an old and a new bench side by side:
#: "GO_FD,DONE_FD", the ends of the two pipes this process takes turns by.
TURNS_ENV = "HUTCH_BENCH_TURNS"
#: A turn's least length: its first sample after a switch finds caches cold,
#: so a turn holds many of the short ones; a machine whose speed drifts moves
#: both sides alike at this grain.
TURN_S = 0.05


class Turns:
    """Lockstep with a twin bench (the same script on the other commit's
    code): only one of the two runs at any time, and they switch at a
    sample's end (:meth:`take`) once a turn has lasted :data:`TURN_S`, so the
    old and new samples of a row are taken in the same stretches of the
    machine's time, not minutes apart. Without ``HUTCH_BENCH_TURNS`` (a
    bench run alone) it does nothing."""

    def __init__(self, spec: str | None) -> None:
        self._fds: tuple[int, int] | None = None
        if spec:
            go, done = (int(fd) for fd in spec.split(","))
            for fd in (go, done):
                os.set_inheritable(fd, False)  # never to a daemon or command this starts
            self._fds = (go, done)
            self._wait()  # the first turn is the driver's to give
        self._began = time.perf_counter()

    def _wait(self) -> None:
        assert self._fds is not None
        if os.read(self._fds[0], 1) != b".":
            self._fds = None  # the driver is gone: run on alone

    def take(self) -> None:
        """Between two samples: hand the machine to the twin if this turn
        has lasted long enough, and go on when it hands it back."""
        if self._fds is None or time.perf_counter() - self._began < TURN_S:
            return
        try:
            os.write(self._fds[1], b".")
        except BrokenPipeError:
            self._fds = None  # the driver is gone: run on alone
            return
        self._wait()
        self._began = time.perf_counter()
