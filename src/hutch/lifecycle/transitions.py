"""Transitions: a backend step (pause, suspend, resume, end) and the record
that makes it durable, taken as one: a record the store refuses undoes the
step, so that memory, store and backend agree."""

from __future__ import annotations

import inspect
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import anyio

from .._errors import HutchError
from .._faults import fault_point
from ..providers.base import RuntimeLost
from ..states import SandboxState, check_transition
from .records import LifecycleRecord
from .sharing import Sharing

if TYPE_CHECKING:
    from ..core.live import LiveSandbox

log = logging.getLogger("hutch.lifecycle")


class Transitions(Sharing):
    async def _transition(
        self, sandbox: LiveSandbox, new: SandboxState, reason: str | None,
        *, stored: SandboxState | None = None,
    ) -> None:
        """Move to ``new``, acknowledged once ``on_transition`` has written
        it; meanwhile the status says what the store still has: the old
        state, or ``stored`` where the store has another (an adopted
        sandbox, on record as it was found, tracked from creating)."""
        record = self._record(sandbox)
        old = record.state
        check_transition(record.sandbox_id, old, new)
        now = self.clock.monotonic()
        before = (record.reason, record.last_activity_mono, dict(record.meter.seconds),
                  record.meter.state, record.meter.since)
        record.state = new
        record.reason = reason
        record.meter.switch(new, now)
        if new in (SandboxState.RUNNING,):
            # Coming back (unpause, resume) is activity: the idle clock restarts.
            record.last_activity_mono = now
            if self.shared is not None:
                self._publish(sandbox, record)
        log.info(
            "sandbox %s: %s -> %s%s", record.sandbox_id, old.value, new.value,
            f" ({reason})" if reason else "",
        )
        if self.on_transition is not None:
            record.recording = (stored or old, before[0])
            try:
                result = self.on_transition(record.sandbox_id, old, new, reason)
                if inspect.isawaitable(result):
                    await result
            except BaseException as exc:
                # Not recorded, so not acknowledged: the record goes back to
                # what the store still says, and the caller undoes its step.
                record.state = old
                (record.reason, record.last_activity_mono, record.meter.seconds,
                 record.meter.state, record.meter.since) = before
                log.warning(
                    "sandbox %s: %s -> %s could not be recorded, so it did not happen: %s",
                    record.sandbox_id, old.value, new.value, exc,
                )
                raise
            finally:
                record.recording = None

    async def _step(
        self,
        sandbox: LiveSandbox,
        record: LifecycleRecord,
        step: Callable[[], Awaitable[None]],
        undo: Callable[[], Awaitable[None]],
        new: SandboxState,
        reason: str | None,
        *,
        fault: str,
    ) -> None:
        """Take a backend step and record its transition; if the record
        cannot be written, ``undo`` puts the backend back, so that memory,
        store and backend agree (the step is never left half done).
        ``fault``: the fault point between the step and its record.

        Shielded: a caller that gives up (a client gone, a timeout) is
        cancelled after the step is done and recorded, never between the
        backend's step and its record, where an undo could not run either."""
        with anyio.CancelScope(shield=True):
            await self._guarded(sandbox, record, step)
            fault_point(fault)
            try:
                await self._transition(sandbox, new, reason)
            except BaseException:
                record.transitioning = True
                try:
                    await undo()
                except Exception:
                    log.exception("sandbox %s: undoing an unrecorded %s failed",
                                  record.sandbox_id, new.value)
                finally:
                    record.transitioning = False
                raise

    async def _guarded(
        self, sandbox: LiveSandbox, record: LifecycleRecord, step: Callable[[], Awaitable[None]]
    ) -> None:
        record.transitioning = True
        try:
            await step()
        except RuntimeLost as exc:
            # Gone for good outside hutch (found by the step, not a watcher):
            # failed, with what the provider found, and said as such from now on.
            await self._fail_lost(sandbox, record, str(exc))
            raise self.expired_error(record) from None
        except HutchError:
            raise
        except Exception as exc:
            await self._transition(sandbox, SandboxState.FAILED, f"{type(exc).__name__}: {exc}")
            raise
        finally:
            record.transitioning = False

    async def _suspend_locked(
        self, sandbox: LiveSandbox, record: LifecycleRecord, reason: str | None
    ) -> None:
        self._check_live(record)
        check_transition(record.sandbox_id, record.state, SandboxState.SUSPENDED)
        # From here on, operations wait for the lock (and then resume the
        # sandbox) instead of slipping in while it goes down.
        record.transitioning = True
        try:
            if not sandbox.capabilities.suspend_keeps_processes:
                # They die with the suspend; end them rather than leave handles hanging.
                await sandbox.end_processes()
        finally:
            record.transitioning = False
        backend = sandbox.backend
        await self._step(sandbox, record, backend.suspend, backend.resume,
                         SandboxState.SUSPENDED, reason, fault="suspend.suspended")

    async def _resume_locked(self, sandbox: LiveSandbox, record: LifecycleRecord) -> None:
        self._check_live(record)
        check_transition(record.sandbox_id, record.state, SandboxState.RUNNING)
        backend = sandbox.backend
        if record.state is SandboxState.PAUSED:
            await self._step(sandbox, record, backend.unpause, backend.pause,
                             SandboxState.RUNNING, None, fault="resume.unpaused")
        else:
            await self._step(sandbox, record, backend.resume, backend.suspend,
                             SandboxState.RUNNING, None, fault="resume.resumed")

    async def _fail_lost(self, sandbox: LiveSandbox, record: LifecycleRecord, reason: str) -> None:
        """Under the lock: the runtime is gone outside hutch. What it held is
        freed first, its working directory's files kept (until the sandbox
        is closed), so that the failure's record says where they are now;
        then the sandbox is ``failed`` with ``reason``. A record the store
        refuses raises, the runtime already released: a retry (the daemon's)
        needs no second look at the backend, which no longer looks dead."""
        if record.sandbox_id not in self._released:
            try:
                await sandbox.release_runtime()
            except Exception:
                log.exception("sandbox %s: releasing its dead runtime failed",
                              record.sandbox_id)
            self._released.add(record.sandbox_id)
        await self._transition(sandbox, SandboxState.FAILED, reason)
        self._released.discard(record.sandbox_id)
        self.scheduler.cancel(record.sandbox_id)

    async def _terminate_locked(
        self, sandbox: LiveSandbox, record: LifecycleRecord, reason: str
    ) -> None:
        await self._transition(sandbox, SandboxState.TERMINATED, reason)
        log.warning("sandbox %s terminated: %s", record.sandbox_id, reason)
