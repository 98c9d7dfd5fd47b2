"""Bench: lifecycle operations beside the docker SDK, and the timers' idle cost.

Floors: pause+resume = docker pause + unpause; suspend+resume-to-first-exec =
commit + remove + create + start + exec. Timer cost: CPU per second with
100 000 idle sandboxes tracked, beside an event loop tracking none.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import sys
import time
from collections.abc import Awaitable, Callable

sys.path.insert(0, os.path.dirname(__file__))

import docker
import docker.errors

import hutch
from _common import header, paired, row, run, turn
from hutch._sandbox import backend_of
from hutch.lifecycle.engine import LifecycleEngine

IMAGE = os.environ.get("HUTCH_TEST_IMAGE", "hutch-test:bookworm")
TRACKED = 100_000


def is_pause_conflict(exc: Exception) -> bool:
    return "already paused" in str(exc) or "is not paused" in str(exc)


def raw_exec(api: docker.APIClient, container: str) -> None:
    created = api.exec_create(container, ["true"])
    api.exec_start(created["Id"])
    api.exec_inspect(created["Id"])


async def docker_part() -> None:
    api = docker.APIClient(version="auto")
    header("lifecycle on docker (floor: the docker SDK directly)")
    async with await hutch.create_sandbox("docker", image=IMAGE) as sb:
        container = str(getattr(backend_of(sb), "container_id", ""))

        # Docker 20.10 updates a container's Paused flag from containerd events
        # that can arrive late, so back-to-back pause/unpause now and then gets
        # "already paused" or "is not paused" (409 or 500) although the step
        # before succeeded. Both sides retry it alike, and the count is shown.
        conflicts = {"hutch": 0, "floor": 0}

        def raw_step(step: Callable[[str], object]) -> None:
            for _ in range(200):
                try:
                    step(container)
                    return
                except docker.errors.APIError as exc:
                    if not is_pause_conflict(exc):
                        raise
                    conflicts["floor"] += 1
                    time.sleep(0.005)
            raise RuntimeError("docker kept refusing to (un)pause")

        async def ours_step(step: Callable[[], Awaitable[None]]) -> None:
            for _ in range(200):
                try:
                    await step()
                    return
                except hutch.ProviderError as exc:
                    if not is_pause_conflict(exc):
                        raise
                    conflicts["hutch"] += 1
                    await asyncio.sleep(0.005)
            raise RuntimeError("docker kept refusing to (un)pause")

        def raw_pause() -> None:
            raw_step(api.pause)
            raw_step(api.unpause)

        async def ours_pause() -> None:
            await ours_step(sb.pause)
            await ours_step(sb.resume)

        # Alternated, not one after the other: docker's pause time drifts by
        # more than the gap being measured.
        ours_ms, floor_ms = await paired(ours_pause, raw_pause, 60)
        row("pause + resume", ours_ms, floor_ms,
            f"goal: <= 1.2x; docker pause conflicts retried: {conflicts}")
        await sb.exec("head -c 10485760 /dev/urandom > /root/ten-mb.bin")

        async def ours_suspend() -> None:
            await sb.suspend()
            await sb.resume()
            await sb.exec(["true"])

        raw = api.create_container(IMAGE, ["sleep", "infinity"], detach=True)
        api.start(raw["Id"])
        api.exec_start(api.exec_create(raw["Id"], ["sh", "-c",
                       "head -c 10485760 /dev/urandom > /root/ten-mb.bin"])["Id"])
        current = {"id": raw["Id"]}

        def raw_suspend() -> None:
            image = api.commit(current["id"], repository="hutch-bench", tag="raw")
            api.remove_container(current["id"], force=True)
            made = api.create_container(image["Id"], ["sleep", "infinity"], detach=True)
            api.start(made["Id"])
            raw_exec(api, made["Id"])
            current["id"] = made["Id"]

        try:
            ours, floor = await paired(ours_suspend, raw_suspend, 6, warmup=1)
        finally:
            api.remove_container(current["id"], force=True)
            api.remove_image("hutch-bench:raw", force=True)
    row("suspend + resume + first exec (10 MB change)", ours, floor, "floor: commit + run")


async def timer_part() -> None:
    header(f"timers with {TRACKED} idle sandboxes tracked (floor: an idle event loop)")
    window = 3.0

    async def idle_cpu() -> float:
        start_cpu, start = time.process_time(), time.perf_counter()
        await asyncio.sleep(window)
        return (time.process_time() - start_cpu) / (time.perf_counter() - start) * 1000

    floor = await idle_cpu()
    engine = LifecycleEngine()
    sandboxes = [
        await hutch.create_sandbox("virtual", engine=engine, idle_timeout=3600,
                                   idle_suspend_after=1800, max_lifetime=86400)
        for _ in range(TRACKED)
    ]
    assert engine.tracked() == TRACKED
    ours = await idle_cpu()
    print(f"{'CPU ms per second while nothing is due':<44} {ours:>9.3f}ms {floor:>9.3f}ms"
          f"   (heap entries: {len(engine.scheduler)})")
    await engine.close()
    del sandboxes


async def gate_part() -> None:
    header("the gate on the hot path (floor: the same sandbox with no engine)")
    from hutch.providers.virtual import VirtualConfig, VirtualSandbox

    engine = LifecycleEngine()
    gated = await hutch.create_sandbox(
        "virtual", engine=engine, idle_timeout=3600, idle_suspend_after=600
    )
    await gated.write_text("f", "x")
    backend = await VirtualSandbox.create(VirtualConfig(), "sb-bare")
    bare = hutch.Sandbox(backend)
    await bare.write_text("f", "x")

    async def many(sb: hutch.Sandbox) -> None:
        for _ in range(1000):
            await sb.read_bytes("f")

    # Alternated like paired(), whose floor is sync; both sides here are async.
    ours_samples: list[float] = []
    floor_samples: list[float] = []
    for _ in range(3):
        await many(gated)
        await many(bare)
    for _ in range(30):
        turn()
        started = time.perf_counter()
        await many(bare)
        floor_samples.append(time.perf_counter() - started)
        started = time.perf_counter()
        await many(gated)
        ours_samples.append(time.perf_counter() - started)
    per_read_ms = 1000 / 1000  # seconds per 1000 reads -> ms per read
    row("one read through the lifecycle gate",
        statistics.median(ours_samples) * per_read_ms,
        statistics.median(floor_samples) * per_read_ms)
    await gated.close()
    await engine.close()


async def main() -> None:
    await docker_part()
    await timer_part()
    await gate_part()


if __name__ == "__main__":
    run(main)
