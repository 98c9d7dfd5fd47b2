"""Bench: the generated sync face beside the async one it wraps, in-process.

The floor is the same call awaited on the async face (``await sb.exec(["true"])``
on a sandbox of the same provider); the sync figure is ``sb.exec(["true"])`` on
``hutch.create_sandbox_sync``'s sandbox, called from a plain thread. The two
are measured in alternating blocks, so that a machine that speeds up or slows
down moves both alike. Goal (issue 21): the sync face adds 0.3 ms at most.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(__file__))

import hutch
from _common import header, median_ms, row, run, scratch_dir
from hutch._sync import LoopThread
from hutch.providers.bubblewrap.rootfs import resolve_rootfs

IMAGE = os.environ.get("HUTCH_TEST_IMAGE", "hutch-test:bookworm")
ROUNDS = 20
BLOCK = 10


def settings(provider: str) -> dict[str, Any]:
    if provider == "docker":
        return {"image": IMAGE}
    if provider == "bubblewrap":
        return {"rootfs": resolve_rootfs(None, IMAGE)}
    return {"workdir": scratch_dir("hutch-bench-sync-", "/dev/shm")}


async def exec_sync_beside_async(provider: str) -> None:
    kwargs = {**settings(provider), "read_before_write": False}
    async with await hutch.create_sandbox(provider, **kwargs) as async_sb:
        sync_sb = await asyncio.to_thread(hutch.create_sandbox_sync, provider, **kwargs)
        try:
            def sync_block() -> list[float]:
                samples = []
                for _ in range(BLOCK):
                    start = time.perf_counter()
                    sync_sb.exec(["true"])
                    samples.append(time.perf_counter() - start)
                return samples

            async def async_block() -> list[float]:
                samples = []
                for _ in range(BLOCK):
                    start = time.perf_counter()
                    await async_sb.exec(["true"])
                    samples.append(time.perf_counter() - start)
                return samples

            await async_block()
            await asyncio.to_thread(sync_block)
            sync_samples: list[float] = []
            async_samples: list[float] = []
            for _ in range(ROUNDS):
                async_samples += await async_block()
                sync_samples += await asyncio.to_thread(sync_block)
        finally:
            await asyncio.to_thread(sync_sb.close)
    row(f"{provider}: sync exec(true) vs async", median_ms(sync_samples),
        median_ms(async_samples), "goal: +0.3 ms at most")


async def handoff_alone() -> None:
    """What a sync call adds, without a sandbox: a coroutine that returns at
    once, handed to a face's loop thread, beside the same coroutine awaited."""

    async def nothing() -> None:
        return None

    loop = LoopThread()
    try:
        def sync_block() -> list[float]:
            samples = []
            for _ in range(BLOCK * 10):
                start = time.perf_counter()
                loop.call(nothing())
                samples.append(time.perf_counter() - start)
            return samples

        async def async_block() -> list[float]:
            samples = []
            for _ in range(BLOCK * 10):
                start = time.perf_counter()
                await nothing()
                samples.append(time.perf_counter() - start)
            return samples

        sync_samples: list[float] = []
        async_samples: list[float] = []
        for _ in range(ROUNDS):
            async_samples += await async_block()
            sync_samples += await asyncio.to_thread(sync_block)
    finally:
        loop.stop()
    row("the handoff alone (a coroutine that returns)", median_ms(sync_samples),
        median_ms(async_samples))


async def main() -> None:
    header("the sync face (floor: the same call on the async face, in-process)")
    await handoff_alone()
    wanted = sys.argv[1:] or ["local", "bubblewrap", "docker"]
    for provider in wanted:
        await exec_sync_beside_async(provider)


if __name__ == "__main__":
    run(main)
