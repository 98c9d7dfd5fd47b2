"""Helpers shared by the benches: timing, medians, and the table they print."""

from __future__ import annotations

import asyncio
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from tests import snapshot_leaks
from tests.daemon_fixture import release_leftovers

from _turns import TURNS_ENV, Turns

TURNS = Turns(os.environ.pop(TURNS_ENV, None))
#: Call between two samples in a bench's own timing loop.
turn = TURNS.take

#: Every directory this bench made (:func:`scratch_dir`): :func:`run` removes them.
_SCRATCH: list[str] = []


def scratch_dir(prefix: str, directory: str | None = None) -> str:
    """A new temporary directory (``tempfile.mkdtemp``) that :func:`run`
    removes when the bench ends, passed or failed, with what is mounted
    under it unmounted first (an adopted working directory, say)."""
    path = tempfile.mkdtemp(prefix=prefix, dir=directory)
    _SCRATCH.append(path)
    return path


def run(main: Callable[[], Coroutine[Any, Any, None]]) -> None:
    """Run a bench's ``main`` on a hutch data directory of its own
    (``HUTCH_HOME``), and leave nothing behind, passed or failed: what it
    still holds there (containers and snapshot images labelled with it,
    mounts and loop devices under it, said on stderr: a bench that ends
    what it makes has none) is released, then it and every
    :func:`scratch_dir` are removed. Daemons a bench starts are its own to
    close (``DaemonProcess.close``: their data directories go too)."""
    home = scratch_dir("hutch-bench-home-")
    os.environ["HUTCH_HOME"] = home
    try:
        asyncio.run(main())
    finally:
        left = []
        for path in reversed(_SCRATCH):
            left += release_leftovers(path)
        images = snapshot_leaks.leftover_images([home])
        snapshot_leaks.free(images, [])
        left += [f"image {tags}" for _, tags in images]
        for path in reversed(_SCRATCH):
            # Never through a mount that would not go: that is another file system's.
            subprocess.run(["rm", "-rf", "--one-file-system", path], check=False)
            if os.path.exists(path):
                left.append(f"{path} (not removed)")
        if left:
            print(f"the bench left behind: {', '.join(left)}", file=sys.stderr)


#: Unrelated host processes beside a killed tree (:func:`kill_beside_others`).
UNRELATED = 2000


def _start_others(count: int) -> list[subprocess.Popen[bytes]]:
    return [subprocess.Popen(["sleep", "1000"]) for _ in range(count)]


async def kill_beside_others(sb: Any, runs: int = 15) -> None:
    """The row of a command tree's kill (8 sleeps under a shell, ended by
    closing its stream) with :data:`UNRELATED` other processes on the host,
    beside the same kill with none: a host-side kill's cost is the sandbox's."""
    async def kill_once() -> float:
        stream = sb.exec_stream("for i in 1 2 3 4 5 6 7 8; do sleep 1000 & done; echo up; wait")
        async for _event in stream:  # up: the tree is there
            break
        started = time.perf_counter()
        await stream.aclose()
        return time.perf_counter() - started

    async def kills() -> list[float]:
        samples = []
        for _ in range(runs):
            turn()
            samples.append(await kill_once())
        return samples

    await kill_once()
    floors = await kills()
    # Children of this process, reaped here, so none is left to an init that may not.
    others = _start_others(UNRELATED)
    try:
        samples = await kills()
    finally:
        for other in others:
            other.kill()
        for other in others:
            other.wait()
    row(f"kill a command's tree, {UNRELATED} other host procs", median_ms(samples),
        median_ms(floors), "floor: none; goal: <= 1.1x")


def median_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1000


def time_sync(fn: Callable[[], object], runs: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(runs):
        turn()
        t = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t)
    return median_ms(samples)


async def time_async(fn: Callable[[], Awaitable[object]], runs: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        await fn()
    samples = []
    for _ in range(runs):
        turn()
        t = time.perf_counter()
        await fn()
        samples.append(time.perf_counter() - t)
    return median_ms(samples)


def timed_command(
    argv: list[str], env: dict[str, str], cpu: bool = False
) -> Callable[[], float]:
    """A measure of one run of ``argv``: its wall time, or with ``cpu`` the
    CPU time it used (user and system): on a machine shared with other
    work, the steadier figure."""
    def once() -> float:
        turn()
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        started = time.perf_counter()
        done = subprocess.run(argv, env=env, capture_output=True, stdin=subprocess.DEVNULL,
                              check=False)
        took = time.perf_counter() - started
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        if done.returncode != 0:
            raise RuntimeError(f"{argv} failed: {done.stderr.decode()}")
        if cpu:
            return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        return took
    return once


def header(title: str) -> None:
    print(f"\n== {title}")
    print(f"{'measure':<44} {'hutch':>11} {'floor':>11} {'ratio':>7} {'+abs':>9}")


def row(name: str, hutch_ms: float, floor_ms: float, goal: str = "") -> None:
    turn()
    ratio = hutch_ms / floor_ms if floor_ms else float("inf")
    print(
        f"{name:<44} {hutch_ms:>9.3f}ms {floor_ms:>9.3f}ms {ratio:>6.2f}x "
        f"{hutch_ms - floor_ms:>+7.3f}ms  {goal}"
    )


async def paired(
    ours: Callable[[], Awaitable[object]],
    floor: Callable[[], object],
    runs: int,
    warmup: int = 3,
) -> tuple[float, float]:
    """Median ms of ``ours`` and of ``floor``, measured alternately, so that a
    machine that speeds up or slows down during the run moves both alike."""
    for _ in range(warmup):
        await ours()
        floor()
    ours_samples, floor_samples = [], []
    for _ in range(runs):
        turn()
        t = time.perf_counter()
        floor()
        floor_samples.append(time.perf_counter() - t)
        t = time.perf_counter()
        await ours()
        ours_samples.append(time.perf_counter() - t)
    return median_ms(ours_samples), median_ms(floor_samples)
