"""Start-up reconciliation of the store with what really runs, and the
pruning of ended sandboxes."""

from __future__ import annotations

import contextlib
import json
import time

import anyio

from .._errors import (
    HutchError,
)
from .._sandbox import live_of
from .._snapshots import new_snapshot_id
from .._types import ProviderSnapshot
from ..config import SandboxSpec
from ..definitions.holders import (
    HELD_BY_DAEMON,
    program_alive,
    this_program,
)
from ..lifecycle.state import found_state
from ..providers.base import RuntimeState, SandboxBackend
from ..providers.registry import available_providers, get_provider
from ..states import SandboxState, SnapshotStatus, WorkspaceStatus
from ..store import (
    SandboxRow,
    SnapshotRow,
    WorkspaceRow,
)
from .common import (
    HOST_GONE,
    PRUNING_LEASE,
    SETTING_UP,
    log,
)
from .workspaces import Workspaces, _state_label


def _dead_daemon_holds_nothing(_holder: str) -> bool:
    return False


class Reconciling(Workspaces):
    async def _free_failed_to_be_pruned(self) -> None:
        """The failed sandboxes the next prune forgets free what they kept first."""
        cutoff = time.time() - self.retention_seconds
        for row in await self.astore.list_sandboxes(include_final=True):
            if row.state == SandboxState.FAILED.value and row.updated_at_unix < cutoff \
                    and self._own(row.owner):
                await self._free_failed(row)

    async def prune_ended(self) -> None:
        """Forget sandboxes that ended longer ago than the retention period
        (one daemon of a fleet at a time: the holder of its pruning lease)."""
        if self.daemon_id is not None and not await self.astore.take_lease(
                PRUNING_LEASE, self.daemon_id, max(60.0, self._prune_interval() * 3)):
            return
        pruned = await self.astore.prune_ended(time.time() - self.retention_seconds)
        if pruned:
            log.info("pruned %d sandboxes that ended over %.0f s ago",
                     len(pruned), self.retention_seconds)

    def _prune_interval(self) -> float:
        # Often enough that nothing outlives its retention by more than ~10 %.
        return min(600.0, max(0.5, self.retention_seconds / 10))

    async def _prune_periodically(self) -> None:
        interval = self._prune_interval()
        while True:
            await anyio.sleep(interval)
            try:
                await self._free_failed_to_be_pruned()
                await self.prune_ended()
            except Exception:
                log.exception("pruning ended sandboxes failed; tried again in %.0f s", interval)

    async def reconcile(self, *, after_clean_stop: bool = False) -> None:
        for row in await self.astore.list_sandboxes():
            if self._own(row.owner):
                await self._reconcile_sandbox(row, after_clean_stop=after_clean_stop)
        await self._drop_cut_setups()
        await self._reconcile_snapshots()
        for ws in await self.astore.list_workspaces():
            if self._own(ws.owner):
                await self._reconcile_workspace(ws)
        every_row = await self.astore.list_sandboxes(include_final=True)
        await self._end_runtimes_of_host_gone(every_row)
        await self._reap_orphans(every_row)

    async def _end_runtimes_of_host_gone(self, rows: list[SandboxRow]) -> None:
        """Sandboxes the fleet recorded failed while this host was gone (their
        daemon's lease lapsed, and no other host could reach them) whose
        runtimes ran on here all along: failed says ended, so what each
        runtime holds goes, as for any failed sandbox (its files stay on the
        host until it is deleted). The row is its new owner's: not written."""
        for row in rows:
            if row.state != SandboxState.FAILED.value or row.reason != HOST_GONE:
                continue
            try:
                backend_cls = get_provider(row.provider)
                if not backend_cls.runtime_outlives_its_daemon:
                    continue
                backend = await backend_cls.reconnect(row.id, row.description)
                if await backend.observed_state() in (RuntimeState.GONE,
                                                      RuntimeState.SUSPENDED):
                    continue  # nothing of it runs here (or this is not its host)
                await backend.release_runtime()
            except (HutchError, KeyError, ValueError) as exc:
                log.info("sandbox %s: cannot reach what its lost host ran (%s)", row.id, exc)
                continue
            await self.astore.log_event(row.id, "sandbox",
                                        f"ended what it ran on this host: {HOST_GONE} was "
                                        "recorded while this host's daemon was down")
            log.warning("sandbox %s: ended what it ran here (recorded failed: %s)",
                        row.id, HOST_GONE)

    async def setting_up(self, sandbox_id: str, *, made: bool) -> None:
        """Record that a definition's ensure is making ``sandbox_id`` (until
        it is its thread's, or gone: ``made``)."""
        ids = set(json.loads(await self.astore.get_meta(SETTING_UP) or "[]"))
        ids = ids - {sandbox_id} if made else ids | {sandbox_id}
        await self.astore.set_meta(SETTING_UP, json.dumps(sorted(ids)) if ids else None)

    async def _drop_cut_setups(self) -> None:
        """Remove the sandboxes an ensure cut short by the restart was making:
        half set up, and no thread's (one it recorded as its thread's stays)."""
        for sandbox_id in json.loads(await self.astore.get_meta(SETTING_UP) or "[]"):
            if (sandbox_id in self.sandboxes
                    and await self.astore.instance_of_sandbox(sandbox_id) is None):
                log.warning("sandbox %s: a definition's setup was cut short; removing it",
                            sandbox_id)
                with contextlib.suppress(HutchError):
                    await self.delete_sandbox(sandbox_id)
                await self._note(sandbox_id, "setup", "removed: the ensure making it was cut short")
            await self.setting_up(sandbox_id, made=True)

    def _providers_in_use(self) -> list[type[SandboxBackend]]:
        """Every provider that can be loaded here, each asked about what it holds."""
        found = []
        for name in available_providers():
            try:
                found.append(get_provider(name))
            except HutchError:
                continue  # not installed here: it holds nothing of ours
        return found

    async def _reconcile_snapshots(self) -> None:
        """Make the store and the providers agree on snapshots: a capture or a
        removal cut short is finished (its storage freed, its row dropped), a
        row whose storage is gone is dropped, storage no row names is freed."""
        every = await self.astore.list_snapshots()
        # Another daemon's captures and removals are its own to finish; its
        # rows still name storage (no orphan of ours), never dropped here.
        others = {r.id for r in every if not self._own(r.owner)}
        rows = {r.id: r for r in every if r.id not in others}
        for row in list(rows.values()):
            if row.status in (SnapshotStatus.CAPTURING, SnapshotStatus.REMOVING):
                log.warning("snapshot %s: its %s was cut short; freeing what it left",
                            row.id,
                            "capture" if row.status == SnapshotStatus.CAPTURING else "removal")
                with contextlib.suppress(HutchError):
                    await self._free_snapshot_storage(row)
                await self.astore.delete_snapshot(row.id)
                del rows[row.id]
        for provider in self._providers_in_use():
            try:
                held = set(await provider.held_snapshots())
            except HutchError as exc:
                log.info("cannot ask %s what snapshots it holds (%s)", provider.provider, exc)
                continue
            for snapshot_id in sorted(held - set(rows) - others):
                log.warning("freeing %s snapshot %s: no record names it",
                            provider.provider, snapshot_id)
                with contextlib.suppress(HutchError):
                    await provider.remove_snapshot(
                        ProviderSnapshot(snapshot_id, provider.provider, 0)
                    )
            for row in rows.values():
                if row.provider == provider.provider and row.id not in held:
                    log.warning("snapshot %s is gone from %s; dropping its record",
                                row.id, row.provider)
                    await self.astore.delete_snapshot(row.id)
                    await self.astore.log_event(row.id, "snapshot", "lost: its storage is gone")

    async def _reap_orphans(self, rows: list[SandboxRow]) -> None:
        """Ask every provider to free what it made for sandboxes no row names
        (nor an instance: a program on this store holds it in-process, or
        left it for the next ``ensure`` of its thread). A row that says
        terminated names nothing to keep: a close records the end before it
        releases the runtime, and a daemon killed between the two left a
        runtime no call would ever free (a failed one keeps its files until
        it is deleted, so it still names them). ``rows``: every sandbox's, ended
        ones too, read once the rest of the reconciliation is done."""
        known = {r.id for r in rows if r.state != SandboxState.TERMINATED.value}
        known |= await self.astore.instance_sandbox_ids()
        for provider in self._providers_in_use():
            try:
                removed = await provider.reap_orphans(known)
            except HutchError as exc:
                log.info("cannot reconcile with %s (%s)", provider.provider, exc)
                continue
            for what in removed:
                await self.astore.log_event(what, "orphan",
                                            f"removed an orphan {provider.provider} resource")
                log.warning("removed orphan %s resource %s", provider.provider, what)

    async def _reconcile_sandbox(self, row: SandboxRow, *, after_clean_stop: bool,
                                 taken_over: bool = False) -> None:
        """Adopt the sandbox of ``row`` (after a restart; ``taken_over``: from
        a daemon whose lease lapsed, whose hold of its instance is void)."""
        instance = await self.astore.instance_of_sandbox(row.id)
        if instance is not None and not await self.astore.claim_instance(
            instance.key, row.id, this_program(), was={"held_by": HELD_BY_DAEMON},
            alive=_dead_daemon_holds_nothing if taken_over else program_alive,
        ):
            # A program took the thread's sandbox over in-process while the
            # daemon was down (it found the earlier daemon dead): its now,
            # not this daemon's to adopt, nor to free.
            await self.astore.delete_sandbox(row.id)
            log.info("sandbox %s: a program on this store holds it now; not adopted", row.id)
            return
        if row.state == SandboxState.CREATING.value:
            with contextlib.suppress(HutchError):
                await get_provider(row.provider).discard(row.id)
            await self.astore.delete_sandbox(row.id)
            log.warning("dropped sandbox %s: its create was cut short", row.id)
            return
        try:
            backend_cls = get_provider(row.provider)
            backend = await backend_cls.reconnect(row.id, row.description)
            spec = SandboxSpec.model_validate(row.spec)
        except (HutchError, KeyError, ValueError) as exc:
            await self._mark_lost(row, f"lost: cannot reconnect after a restart ({exc})")
            return
        recorded = SandboxState(row.state)
        unreached: HutchError | None = None
        try:
            state = found_state(recorded, await backend.observed_state())
        except HutchError as exc:
            # Cannot tell is not gone (a Docker Engine restarting, an ssh host
            # down): the record stands, as the lifecycle never fails a
            # sandbox on a guess; the first call, or the provider's watch,
            # finds out what is left of it.
            unreached, state = exc, recorded
        if state is None:
            # As a death seen while the daemon runs: what the runtime held
            # goes, its working directory stays (a workspace's becomes its
            # state) until the sandbox is deleted (``_free_failed``).
            with contextlib.suppress(HutchError):
                await backend.release_runtime()
            row.description = backend.describe()
            await self._mark_lost(row, "lost: its runtime died while the daemon was down")
            if row.workspace is not None:
                await self._salvage_workspace(row, backend)
            return
        if state is not recorded:
            # A step cut short between the provider and the store (a suspend
            # killed while the container was frozen, a resume killed before
            # its record): the runtime's own state is the truth, recorded now.
            row.state, row.reason, row.description = state.value, None, backend.describe()
            told = (f"found {state.value} though recorded {recorded.value}: a step was cut "
                    "short by the restart")
            await self.astore.put_sandbox(row, ("adopted", told))
            log.warning("sandbox %s %s", row.id, told)
        sandbox = self._wrap(backend, spec)
        sandbox.base_snapshot_id = row.base_snapshot_id
        sandbox.origin_snapshot_id = row.origin_snapshot_id
        self.sandboxes[row.id] = sandbox
        if row.workspace is not None:
            self.workspace_of[row.id] = row.workspace
        # The meter was written with the row; the time since went to the state
        # the row names (every transition is written before it is acknowledged).
        meter = dict(row.meter)
        if row.updated_at_unix:
            key = f"{state.value}_s"
            meter[key] = meter.get(key, 0.0) + max(0.0, time.time() - row.updated_at_unix)
        await self.engine.attach(
            live_of(sandbox), spec.options, state=state, created_unix=row.created_at_unix,
            deadline_unix=row.deadline_unix, meter=meter,
            # After a crash the last activity on record may be long out of
            # date (activity is not written per call): the idle clock starts
            # again rather than reaping work that may have gone on until the end.
            last_active_unix=row.last_active_unix if after_clean_stop else None,
            recorded=True,
        )
        if unreached is None:
            await self._note(row.id, "adopted", f"adopted after restart as {state.value}")
            log.info("adopted sandbox %s (%s)", row.id, state.value)
        else:
            told = (f"adopted after restart as {state.value}, as recorded: its runtime could "
                    f"not be reached to confirm it ({unreached}); calls say so until it can")
            await self._note(row.id, "adopted", told)
            log.warning("sandbox %s %s", row.id, told)
        self._watch(type(backend))
        if sandbox.capabilities.processes:
            if state is SandboxState.RUNNING and unreached is None:
                await self._end_leftover_commands(sandbox)
            elif state is SandboxState.PAUSED:
                # Frozen now: ended when it is resumed, before anything new runs.
                self._leftovers.add(row.id)

    async def _salvage_workspace(self, row: SandboxRow, backend: SandboxBackend) -> None:
        """A workspace's sandbox died with the daemon down: what of its state
        survives (a working directory on the host) becomes the workspace's
        state, where the provider can capture it; otherwise the last state stays."""
        name = row.workspace
        ws = await self.astore.get_workspace(name) if name else None
        if ws is None or not backend.capabilities.snapshot:
            return
        snap = SnapshotRow(
            id=new_snapshot_id(), provider=row.provider, status=SnapshotStatus.CAPTURING,
            label=f"workspace {ws.name} state (salvaged)", sandbox_id=row.id,
            parent_id=row.base_snapshot_id, created_at_unix=time.time(), spec=row.spec,
        )
        await self.astore.put_snapshot(snap)
        try:
            handle = await backend.capture(snap.id, diff=True)
        except Exception as exc:
            log.warning("workspace %s: nothing of its lost sandbox could be kept (%s)",
                        ws.name, exc)
            await self._free_snapshot_storage(snap)
            await self.astore.delete_snapshot(snap.id)
            return
        snap.status, snap.size_bytes, snap.handle = (
            SnapshotStatus.READY, handle.size_bytes, handle.as_dict())
        await self.astore.put_snapshot(snap)
        previous, ws.state_snapshot_id = ws.state_snapshot_id, snap.id
        await self.astore.put_workspace(ws)
        await self._release_snapshot(previous)
        await self.astore.log_event(ws.name, "workspace",
                             f"kept what survived of its lost sandbox {row.id} as {snap.id}")

    async def _mark_lost(self, row: SandboxRow, reason: str) -> None:
        row.state, row.reason = SandboxState.FAILED.value, reason
        await self.astore.put_sandbox(row)
        await self.astore.log_event(row.id, "lost", reason)
        log.warning("sandbox %s %s", row.id, reason)

    async def _reconcile_workspace(self, ws: WorkspaceRow) -> None:
        live = ws.live_sandbox_id in self.sandboxes
        if ws.status == WorkspaceStatus.DELETING:
            log.warning("finishing the delete of workspace %s, cut short", ws.name)
            await self._finish_delete(ws)
            return
        if ws.status == WorkspaceStatus.CREATING:
            if ws.live_sandbox_id and ws.live_sandbox_id in self.sandboxes:
                # The create finished; only its last write did not.
                ws.status = WorkspaceStatus.RUNNING
                await self.astore.put_workspace(ws)
            else:
                await self.astore.delete_workspace(ws.name)
                log.warning("dropped workspace %s: its create was cut short", ws.name)
            return
        if ws.status == WorkspaceStatus.SUSPENDING:
            await self._settle_cut_suspend(ws, live=live)
        if not live and ws.status in (
            WorkspaceStatus.RUNNING, WorkspaceStatus.SUSPENDING, WorkspaceStatus.RESUMING
        ):
            # A suspend whose state snapshot was written is a suspend; one cut
            # short left the last state (or none), from which resume starts.
            ws.status = WorkspaceStatus.STALE
            ws.live_sandbox_id = None
            await self.astore.put_workspace(ws)
            log.warning("workspace %s is %s: its sandbox is gone", ws.name, ws.status)
        elif ws.status in (WorkspaceStatus.SUSPENDING, WorkspaceStatus.RESUMING) and live:
            ws.status = WorkspaceStatus.RUNNING
            await self.astore.put_workspace(ws)
        if ws.state_snapshot_id and await self.astore.get_snapshot(ws.state_snapshot_id) is None:
            log.warning("workspace %s: its state snapshot %s is gone", ws.name,
                        ws.state_snapshot_id)
            ws.state_snapshot_id = None
            await self.astore.put_workspace(ws)

    async def _settle_cut_suspend(self, ws: WorkspaceRow, *, live: bool) -> None:
        """A suspend cut short after it recorded the new state snapshot and
        before the workspace named it: with its sandbox alive, that snapshot
        goes (the sandbox has all of it, and goes on); with the sandbox gone,
        it is the latest state there is, and becomes the workspace's."""
        cut = [s for s in await self.astore.list_snapshots()
               if s.status == SnapshotStatus.READY and s.sandbox_id == ws.live_sandbox_id
               and s.label == _state_label(ws.name)
               and s.id not in (ws.state_snapshot_id, ws.source_snapshot_id)]
        if not cut:
            return
        newest = max(cut, key=lambda s: s.created_at_unix)
        if not live:
            previous, ws.state_snapshot_id = ws.state_snapshot_id, newest.id
            await self.astore.put_workspace(ws)
            log.warning("workspace %s: its suspend was cut short; its state is %s",
                        ws.name, newest.id)
            await self._release_snapshot(previous)
            cut.remove(newest)
        for row in cut:
            log.warning("workspace %s: dropping %s, the state of a suspend cut short",
                        ws.name, row.id)
            await self._release_snapshot(row.id)
