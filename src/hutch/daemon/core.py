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

from ..states import FINAL
from .common import (
    CLEAN_STOP,
    log,
)
from .reconcile import Reconciling


class Daemon(Reconciling):
    # -- start-up and shut-down ------------------------------------------------------------
    async def start(self) -> None:
        # Whether the last run stopped cleanly; from now on, until our own
        # clean stop, it did not.
        clean = await self.astore.get_meta(CLEAN_STOP) is not None
        await self.astore.set_meta(CLEAN_STOP, None)
        default = await anyio.to_thread.run_sync(self.default_provider)
        log.info("requests that name no provider get %r", default)
        await self.reconcile(after_clean_stop=clean)
        await self._free_failed_to_be_pruned()
        self.prune_ended()
        self._pruner = asyncio.get_running_loop().create_task(self._prune_periodically())

    async def stop(self) -> None:
        """Stop the daemon, leaving every sandbox running for the next start to adopt.

        What the engine knows beyond the last transition (meter, last
        activity) is written first, in one transaction, and the stop is
        marked clean, so the next start goes on exactly from here.
        """
        for task in [self._pruner, *self._watchers.values()]:
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        self._watchers.clear()
        await self.engine.close()
        rows = []
        for sandbox_id, sandbox in list(self.sandboxes.items()):
            row = await self.astore.get_sandbox(sandbox_id)
            if row is None or row.state in FINAL:
                continue
            self._snapshot(row, sandbox)
            rows.append(row)
        try:
            await self.astore.put_sandboxes(rows)
            await self.astore.set_meta(CLEAN_STOP, str(time.time()))
        finally:
            await self.astore.close()
