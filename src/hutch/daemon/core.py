"""The daemon's core, free of HTTP: sandboxes and workspaces that outlive the
process, written through the store before they are acknowledged.

Start-up reconciles the store with what really runs: sandboxes whose runtime
is alive are adopted, running workspaces whose sandbox is gone become
``stale``, half-made records (a create cut short) are dropped with whatever
they made, snapshots are made to agree with what each provider holds, and
each provider frees what it made for sandboxes no record names. Nothing here
knows a provider: state capture, workspaces and reconciliation go through the
provider seam (``hutch.providers.base``).
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import anyio.to_thread

from .._errors import StoreUnavailable
from ..definitions.holders import lease_holder
from ..states import FINAL
from .common import (
    CLEAN_STOP,
    SERVING_LEASE,
    SERVING_LEASE_SECONDS,
    log,
)
from .fleet import Fleet, daemon_id_of


class Daemon(Fleet):
    # -- start-up and shut-down ------------------------------------------------------------
    async def start(self) -> None:
        self.daemon_id = await anyio.to_thread.run_sync(daemon_id_of, self.data_dir)
        if self.store.shared:
            # A fleet: any number of daemons, each serving the rows it owns.
            await self._join_fleet()
            self._store_holder = self.daemon_id
            self._store_hold = asyncio.get_running_loop().create_task(self._keep_in_fleet())
            try:
                await self._start_serving()
            except BaseException:
                self._store_hold.cancel()
                self._store_holder = None
                raise
            return
        holder = lease_holder()
        if not await self.astore.take_lease(SERVING_LEASE, holder, SERVING_LEASE_SECONDS):
            other = await self.astore.lease_holder(SERVING_LEASE)
            raise StoreUnavailable(
                f"another daemon ({other}) serves this store; one daemon serves a store "
                "at a time: stop that one, or give this one a data directory (or "
                "database) of its own"
            )
        self._store_holder = holder
        self._store_hold = asyncio.get_running_loop().create_task(self._keep_serving(holder))
        try:
            await self._join_fleet()
            await self._start_serving()
        except BaseException:
            self._store_hold.cancel()
            self._store_holder = None
            with anyio.CancelScope(shield=True):
                await self.astore.release_lease(SERVING_LEASE, holder)
            raise

    async def _start_serving(self) -> None:
        # Whether the last run stopped cleanly; from now on, until our own
        # clean stop, it did not.
        clean = await self.astore.get_meta(self._clean_stop_key()) is not None
        await self.astore.set_meta(self._clean_stop_key(), None)
        default = await anyio.to_thread.run_sync(self.default_provider)
        log.info("requests that name no provider get %r", default)
        await self.reconcile(after_clean_stop=clean)
        await self._free_failed_to_be_pruned()
        await self.prune_ended()
        self._pruner = asyncio.get_running_loop().create_task(self._prune_periodically())
        self.meters.start(lambda: [s for i, s in self.sandboxes.items() if i not in self._hosted])

    def _clean_stop_key(self) -> str:
        # A fleet's daemons start and stop on their own: whether the last
        # run stopped cleanly is each one's, not the store's.
        return f"{CLEAN_STOP}:{self.daemon_id}" if self.store.shared else CLEAN_STOP

    async def _keep_serving(self, holder: str) -> None:
        """The embedded store's one daemon: its hold renewed, with its heartbeat."""
        heartbeat = asyncio.get_running_loop().create_task(self._keep_in_fleet())
        try:
            await self._renew_serving(holder)
        finally:
            heartbeat.cancel()

    async def _renew_serving(self, holder: str) -> None:
        while True:
            await anyio.sleep(SERVING_LEASE_SECONDS / 3)
            try:
                kept = await self.astore.take_lease(SERVING_LEASE, holder,
                                                    SERVING_LEASE_SECONDS)
            except Exception:
                log.exception("renewing this daemon's hold of its store failed; tried again")
                continue
            if not kept:
                log.error("another daemon took this daemon's store over (this one stalled "
                          "past its lease); its writes may now conflict: stop this daemon")

    async def stop(self) -> None:
        """Stop the daemon, leaving every sandbox running for the next start to adopt.

        What the engine knows beyond the last transition (meter, last
        activity) is written first, in one transaction, and the stop is
        marked clean, so the next start goes on exactly from here.
        """
        if self._store_holder is not None:
            await self.drain_pools()  # before the store lets go: their rows go too
        for task in [self._pruner, self._store_hold, *self._watchers.values()]:
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        self._watchers.clear()
        await self.meters.stop()
        await self.engine.close()
        if self._store_holder is None:
            # It never served (refused, or its start failed): the store is
            # not its own to write.
            await self.astore.close()
            return
        rows = []
        for sandbox_id, sandbox in list(self.sandboxes.items()):
            row = await self.astore.get_sandbox(sandbox_id)
            if row is None or row.state in FINAL:
                continue
            self._snapshot(row, sandbox)
            rows.append(row)
        try:
            await self.astore.put_sandboxes(rows)
            await self.astore.set_meta(self._clean_stop_key(), str(time.time()))
            if self._store_holder is not None and not self.store.shared:
                await self.astore.release_lease(SERVING_LEASE, self._store_holder)
        finally:
            await self.astore.close()
