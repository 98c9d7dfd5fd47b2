"""Helpers shared by the benches: timing, medians, and the table they print."""

from __future__ import annotations

import statistics
import time
from collections.abc import Awaitable, Callable


def median_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1000


def time_sync(fn: Callable[[], object], runs: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t)
    return median_ms(samples)


async def time_async(fn: Callable[[], Awaitable[object]], runs: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        await fn()
    samples = []
    for _ in range(runs):
        t = time.perf_counter()
        await fn()
        samples.append(time.perf_counter() - t)
    return median_ms(samples)


def header(title: str) -> None:
    print(f"\n== {title}")
    print(f"{'measure':<44} {'hutch':>11} {'floor':>11} {'ratio':>7} {'+abs':>9}")


def row(name: str, hutch_ms: float, floor_ms: float, goal: str = "") -> None:
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
        t = time.perf_counter()
        floor()
        floor_samples.append(time.perf_counter() - t)
        t = time.perf_counter()
        await ours()
        ours_samples.append(time.perf_counter() - t)
    return median_ms(ours_samples), median_ms(floor_samples)
