"""The lifecycle engine's state, which each of its parts works on: the
sandboxes it tracks, their timers' scheduler, the hooks that make its
transitions durable and, when other programs hold the same sandboxes, where
they share their activity.

The engine is built in one chain, each part a module on the one before:
this base → :mod:`.sharing` (with other programs) → :mod:`.transitions`
(backend steps and their records) → :mod:`.timers` (idleness and time
limits) → :mod:`.engine` (registration, the gate, the public operations).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from .._errors import HutchError, SandboxUnavailable
from ..states import FINAL
from .clock import Clock
from .records import DeadlineHook, LifecycleRecord, NoteHook, TransitionHook, expiry_error
from .scheduler import Scheduler
from .shared import SharedActivity

if TYPE_CHECKING:
    from ..core.live import LiveSandbox


class EngineBase:
    """What every part of the engine shares (made by ``LifecycleEngine()``)."""

    clock: Clock
    #: The longest set_timeout allowed, seconds.
    timeout_ceiling: float
    busy_poll: float
    retry_after: float
    #: Makes a transition durable (a daemon's store). If it raises, the
    #: transition did not happen: the record is put back as it was, the
    #: backend step undone, and the caller gets the error.
    on_transition: TransitionHook | None
    #: The same for a set_timeout deadline.
    on_deadline: DeadlineHook | None
    #: Records what a sandbox's operations found, as its events (a daemon's store).
    on_note: NoteHook | None
    #: Where other programs holding the same sandboxes share their
    #: activity and idle transitions (see :mod:`.shared`); None: this
    #: engine is the only one that times its sandboxes.
    shared: SharedActivity | None
    scheduler: Scheduler
    _publishers: set[asyncio.Task[None]]
    _sandboxes: dict[str, LiveSandbox]
    #: Sandboxes whose dead runtime is released and whose failure is not
    #: yet recorded (the store refused it; a retry follows).
    _released: set[str]

    def tracked(self) -> int:
        return len(self._sandboxes)

    @staticmethod
    def _record(sandbox: LiveSandbox) -> LifecycleRecord:
        record = sandbox.record
        if record is None:
            raise SandboxUnavailable(f"sandbox {sandbox.id} is not tracked by a lifecycle engine")
        return record

    def _check_live(self, record: LifecycleRecord) -> None:
        """A terminated sandbox answers every call with the error of its reason."""
        if record.state in FINAL:
            raise self.expired_error(record)

    def expired_error(self, record: LifecycleRecord) -> HutchError:
        return expiry_error(record.sandbox_id, record.state, record.reason)

    def _forget(self, record: LifecycleRecord) -> None:
        self.scheduler.cancel(record.sandbox_id)
        self._sandboxes.pop(record.sandbox_id, None)
