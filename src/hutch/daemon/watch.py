"""Runtimes that die or speak outside hutch, as each provider's watcher tells."""

from __future__ import annotations

import asyncio
import time

import anyio.to_thread

from .._errors import (
    StoreUnavailable,
)
from .._sandbox import live_of
from ..providers.base import RuntimeNotice, SandboxBackend
from .base import DaemonBase
from .common import (
    NOTICE_BURST_SECONDS,
    STORE_RETRY_SECONDS,
    log,
)


class Watching(DaemonBase):
    def _watch(self, provider: type[SandboxBackend]) -> None:
        """Start the provider's watcher for runtimes that die, once per provider."""
        if provider not in self._watchers:
            self._watchers[provider] = asyncio.get_running_loop().create_task(
                provider.watch_runtimes(self._runtime_notice)
            )

    async def _tell_once_a_burst(self, sandbox_id: str, message: str) -> None:
        """Note what a runtime said of a sandbox once for a burst of the same
        (the OOM killer ends a flood's processes by the dozen), with how many
        times it came: the events stay readable, and the store is written once.
        A burst ends after a quiet :data:`NOTICE_BURST_SECONDS` (or ten of them)."""
        key = (sandbox_id, message)
        burst = self._notice_bursts.get(key)
        if burst is not None:
            burst[0] += 1
            burst[1] = time.monotonic()
            return
        began = time.monotonic()
        burst = self._notice_bursts[key] = [1, began]
        try:
            while True:
                quiet = time.monotonic() - burst[1]
                if quiet >= NOTICE_BURST_SECONDS or time.monotonic() - began >= 10 * (
                    NOTICE_BURST_SECONDS
                ):
                    break
                await anyio.sleep(NOTICE_BURST_SECONDS - quiet)
        finally:
            del self._notice_bursts[key]
        count, took = int(burst[0]), burst[1] - began
        told = message if count == 1 else f"{message} ({count} times in {took:.0f} s)"
        if sandbox_id in self.sandboxes:
            await self._note(sandbox_id, "runtime", told)
        log.warning("sandbox %s: %s", sandbox_id, told)

    async def _runtime_notice(self, notice: RuntimeNotice) -> None:
        """A provider's watcher tells what happened to a sandbox outside hutch."""
        sandbox = self.sandboxes.get(notice.sandbox_id)
        if sandbox is None:
            return  # not ours, or already ended
        if not notice.may_have_died:
            await self._tell_once_a_burst(notice.sandbox_id, notice.message)
            return
        while True:
            try:
                failed = await self.engine.runtime_died(
                    live_of(sandbox), notice.message, of_suspended=notice.of_suspended
                )
            except StoreUnavailable as exc:
                # Not recorded, so not failed yet: tried again until the store
                # takes it (or the sandbox ends some other way meanwhile).
                log.warning("sandbox %s: its runtime died, but %s; trying again in %.0f s",
                            notice.sandbox_id, exc, STORE_RETRY_SECONDS)
                await anyio.sleep(STORE_RETRY_SECONDS)
                if self.sandboxes.get(notice.sandbox_id) is not sandbox:
                    return
                continue
            if failed:
                log.warning("sandbox %s failed: %s", notice.sandbox_id, notice.message)
            return
