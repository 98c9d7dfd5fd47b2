"""The lifecycle engine: states, pause/suspend/resume, work-aware idleness and
time limits, for every sandbox of one event loop.

Each sandbox has a :class:`~.records.LifecycleRecord`. Operations pass through
:meth:`LifecycleEngine.enter` (the gate): on a running sandbox that is one
attribute check and a timestamp; a suspended one is resumed first (or
refused in strict mode); an expired one fails with the typed error of its
reason. Timers live in one :class:`~.scheduler.Scheduler`: each record has one
entry, at the earliest moment something could be due for it, and is
re-evaluated then (:mod:`.timers`).

Idleness is work-aware: an open operation, a running background command, or
any process in the sandbox other than its keeper makes it busy, and a busy
sandbox's idle clock restarts. A paused sandbox's idle clock is stopped.

The engine's parts are modules in one chain (see :mod:`.base`); this one
holds what callers use: registration, the gate, pause, suspend, resume,
ending, set_timeout and the status.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import os
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

import anyio

from .._errors import HutchError, InvalidArgument, SandboxUnavailable, TimeoutTooLarge
from .._inflight import CallMark
from ..providers.base import RuntimeState
from ..states import FINAL, SandboxState, SandboxStatus, check_transition
from .clock import Clock, RealClock, VirtualClock
from .records import (
    DeadlineHook,
    LifecycleOptions,
    LifecycleRecord,
    Meter,
    NoteHook,
    TransitionHook,
)
from .scheduler import Scheduler
from .shared import SharedActivity
from .timers import Timers

if TYPE_CHECKING:
    from ..core.live import LiveSandbox

log = logging.getLogger("hutch.lifecycle")

DEFAULT_TIMEOUT_CEILING = 86400.0
#: How often a busy sandbox is looked at again once an idle window is due.
BUSY_POLL_SECONDS = 1.0
#: How long after a failed lifecycle step (a suspend the backend refused) it is tried again.
RETRY_AFTER_SECONDS = 10.0


class LifecycleEngine(Timers):
    """Lifecycle of every sandbox on one event loop (see the module docstring)."""

    def __init__(
        self,
        *,
        clock: Clock | None = None,
        timeout_ceiling: float = DEFAULT_TIMEOUT_CEILING,
        busy_poll: float = BUSY_POLL_SECONDS,
        retry_after: float = RETRY_AFTER_SECONDS,
        on_transition: TransitionHook | None = None,
        on_deadline: DeadlineHook | None = None,
        shared: SharedActivity | None = None,
        on_note: NoteHook | None = None,
    ) -> None:
        # What each attribute is for: :class:`~.base.EngineBase`.
        self.clock = clock or RealClock()
        self.timeout_ceiling = timeout_ceiling
        self.busy_poll = busy_poll
        self.retry_after = retry_after
        self.on_transition = on_transition
        self.on_deadline = on_deadline
        self.on_note = on_note
        self.shared = shared
        self._publishers = set()
        # A virtual clock is driven by advance(), never by a sleeping task.
        self.scheduler = Scheduler(
            self.clock, self._evaluate, drive=not isinstance(self.clock, VirtualClock)
        )
        self._sandboxes = {}
        self._released = set()

    # -- registration --------------------------------------------------------------
    async def attach(
        self,
        sandbox: LiveSandbox,
        options: LifecycleOptions,
        *,
        state: SandboxState = SandboxState.RUNNING,
        created_unix: float | None = None,
        deadline_unix: float | None = None,
        last_active_unix: float | None = None,
        meter: Mapping[str, float] | None = None,
        recorded: bool = False,
    ) -> LifecycleRecord:
        """Track a sandbox whose backend has just been created.

        A daemon adopting a sandbox after a restart passes what it persisted,
        so that no bound is forgotten or reset: the ``state`` it is in, when
        it was made (``created_unix``: max_lifetime counts from there), its
        set_timeout deadline (``deadline_unix``; one that passed while the
        daemon was down reaps it at once), when it was last active (its idle
        clock goes on from there) and its ``meter`` (as ``SandboxStatus.meter``).
        ``recorded``: ``state`` is on record already (an adoption); while a
        running one is written again, its status says so, not creating.
        """
        now = self.clock.monotonic()
        wall = self.clock.time()
        age = max(0.0, wall - created_unix) if created_unix is not None else 0.0
        idle = max(0.0, wall - last_active_unix) if last_active_unix is not None else 0.0
        record = LifecycleRecord(
            sandbox_id=sandbox.id,
            options=options,
            state=SandboxState.CREATING,
            created_mono=now - age,
            created_unix=created_unix if created_unix is not None else wall,
            last_activity_mono=now - idle,
            meter=Meter(since=now),
            can_suspend=sandbox.capabilities.suspend,
            live_deadline_mono=None if deadline_unix is None else now + (deadline_unix - wall),
        )
        if meter is not None:
            for key, value in meter.items():
                try:
                    counted = SandboxState(key.removesuffix("_s"))
                except ValueError:
                    continue  # a key from a newer daemon: not ours to count
                record.meter.seconds[counted] = float(value)
        sandbox.track(self, record)
        self._sandboxes[sandbox.id] = sandbox
        if state is SandboxState.RUNNING:
            try:
                await self._transition(sandbox, SandboxState.RUNNING, None,
                                       stored=SandboxState.RUNNING if recorded else None)
            except BaseException:
                self._sandboxes.pop(sandbox.id, None)  # not recorded: not tracked
                raise
            # Coming up is activity, but an adopted sandbox's idle clock goes on.
            record.last_activity_mono = now - idle
        else:
            # Adopted as it was: no transition happened, nothing to persist.
            record.state = state
            record.meter.switch(state, now)
        self._reschedule(sandbox)
        return record

    # -- the gate (hot path) -----------------------------------------------------------
    async def enter(self, sandbox: LiveSandbox, op: str, *, activity: bool) -> None:
        record = self._record(sandbox)
        shared = self.shared
        if shared is None:
            if record.state is not SandboxState.RUNNING or record.transitioning:
                await self._enter_slow(sandbox, record, op)
            if activity:
                self._active(sandbox, record)
            return
        # Shared with other programs: the call is marked in flight first, so
        # that none of them takes the sandbox down under it (their suspend
        # waits for it), then it looks whether one of them moved it since.
        followed = False
        while True:
            mark = shared.begin_call(record.sandbox_id)
            if mark is not CallMark.REFUSED:
                try:
                    go = _ready(record) and (
                        # Just brought up to date under the claim; or riding on
                        # this program's calls in flight, which no other program's
                        # suspend passes (and which may be waiting on this one:
                        # a call made inside another must not wait for a claim).
                        followed or mark is CallMark.JOINED
                        # Another program may have suspended or ended it since:
                        # the slow way follows the record first. (The look may
                        # wait for the store: the state is asked again after it.)
                        or (not await shared.moved(record.sandbox_id) and _ready(record))
                    )
                except BaseException:
                    # The look cut short (cancelled, the store failing): the
                    # call never started, and its mark holds no suspend back.
                    shared.end_call(record.sandbox_id)
                    raise
                if go:
                    break
                shared.end_call(record.sandbox_id)
            # Never waited for with the mark held: a suspend under way in
            # another program waits for marked calls, under the claim this waits for.
            await self._enter_slow(sandbox, record, op)
            followed = True
        if activity:
            self._active(sandbox, record)

    async def _enter_slow(self, sandbox: LiveSandbox, record: LifecycleRecord, op: str) -> None:
        # The lock waits out a transition under way; the claim, one another program takes.
        async with record.lock, self._claimed(sandbox, record):
            state = record.state
            if state is SandboxState.RUNNING:
                return
            if state in FINAL:
                raise self.expired_error(record)
            if state is SandboxState.PAUSED:
                raise SandboxUnavailable(
                    f"sandbox {record.sandbox_id} is paused; resume it before {op}"
                )
            if state is SandboxState.SUSPENDED:
                if not record.options.auto_resume:
                    raise SandboxUnavailable(
                        f"sandbox {record.sandbox_id} is suspended and auto_resume is off; "
                        f"resume it before {op}"
                    )
                await self._resume_locked(sandbox, record)
                self._reschedule(sandbox)
                return
            raise SandboxUnavailable(f"sandbox {record.sandbox_id} is {state.value}")

    def leave(self, sandbox: LiveSandbox, op: str, *, activity: bool) -> None:
        if self.shared is not None:
            self.shared.end_call(sandbox.id)
        if activity:
            self.touch(sandbox)

    def touch(self, sandbox: LiveSandbox) -> None:
        record = sandbox.record
        if record is not None:
            self._active(sandbox, record)

    # -- transitions asked for --------------------------------------------------------
    @asynccontextmanager
    async def held(self, sandbox: LiveSandbox) -> AsyncIterator[SandboxState]:
        """Hold the sandbox in its present state (running, paused or
        suspended) while the caller works on it as a whole (a snapshot):
        no transition runs meanwhile and operations wait. Yields the state."""
        record = self._record(sandbox)
        async with record.lock:
            self._check_live(record)
            record.transitioning = True
            try:
                yield record.state
            finally:
                record.transitioning = False

    async def pause(self, sandbox: LiveSandbox) -> None:
        record = self._record(sandbox)
        async with record.lock, self._claimed(sandbox, record):
            self._check_live(record)
            check_transition(record.sandbox_id, record.state, SandboxState.PAUSED)
            backend = sandbox.backend
            await self._step(sandbox, record, backend.pause, backend.unpause,
                             SandboxState.PAUSED, None, fault="pause.paused")
        self._reschedule(sandbox)

    async def suspend(self, sandbox: LiveSandbox, reason: str | None = None) -> None:
        record = self._record(sandbox)
        async with record.lock, self._claimed(sandbox, record), self._calls_held_off(record):
            await self._suspend_locked(sandbox, record, reason)
        self._reschedule(sandbox)

    async def resume(self, sandbox: LiveSandbox) -> None:
        record = self._record(sandbox)
        async with record.lock, self._claimed(sandbox, record) as followed:
            if not (followed and record.state is SandboxState.RUNNING):
                await self._resume_locked(sandbox, record)
        self._reschedule(sandbox)

    async def terminate(self, sandbox: LiveSandbox, reason: str) -> None:
        """End a sandbox with ``reason``; later calls fail with its typed error."""
        record = self._record(sandbox)
        async with record.lock:
            if record.state in FINAL:
                return
            await self._terminate_locked(sandbox, record, reason)
        self._forget(record)
        await sandbox.reap()

    async def runtime_died(
        self, sandbox: LiveSandbox, reason: str, *, of_suspended: bool = False
    ) -> bool:
        """The provider says the sandbox's runtime died outside hutch: if it
        did (the backend confirms it is gone) and the sandbox was meant to be
        up (``of_suspended``: suspended, and what it keeps is gone), it
        becomes ``failed`` with ``reason``, its timers stop and what its
        runtime held is released, its working directory kept until the
        sandbox is closed (deleted). True if it failed; a stale or wrong report changes
        nothing (a suspend or a close that removed the runtime on purpose)."""
        record = self._record(sandbox)
        async with record.lock:  # waits out a transition under way
            meant = (SandboxState.SUSPENDED,) if of_suspended else (
                SandboxState.RUNNING, SandboxState.PAUSED)
            if record.state not in meant:
                return False
            if record.sandbox_id not in self._released:
                backend = sandbox.backend
                try:
                    kept = await (backend.is_suspended() if of_suspended
                                  else backend.is_alive())
                except Exception as exc:  # cannot tell: never fail a sandbox on a guess
                    log.info("sandbox %s: could not confirm that its runtime died: %s",
                             record.sandbox_id, exc)
                    return False
                if kept:
                    return False
            await self._fail_lost(sandbox, record, reason)
        self._forget(record)
        return True

    async def lost(self, sandbox: LiveSandbox, found: str) -> HutchError | None:
        """An operation found the sandbox unavailable (``found``: what the
        provider said): if the provider sees its runtime gone for good, the
        sandbox fails with that as its reason, as a watch would have it fail
        (in process no watch runs; in a daemon the call may come first), and
        the error of its failure is returned, which every later call gets
        too. None where the runtime is there, or cannot be told: the call's
        own error stands and nothing changes."""
        record = sandbox.record
        if record is None or record.state is not SandboxState.RUNNING:
            return None
        try:
            if await sandbox.backend.observed_state() is not RuntimeState.GONE:
                return None
            failed = await self.runtime_died(sandbox, f"its runtime ended outside hutch: {found}")
        except Exception as exc:  # cannot tell, or cannot record: never fail on a guess
            log.info("sandbox %s: could not tell whether its runtime is gone: %s",
                     record.sandbox_id, exc)
            return None
        return self.expired_error(record) if failed else None

    async def note(self, sandbox: LiveSandbox, kind: str, message: str) -> None:
        """Record what an operation found in ``sandbox`` as an event of it
        (``on_note``; nothing where none records events)."""
        if self.on_note is not None:
            await self.on_note(sandbox.id, kind, message)

    def forget(self, sandbox: LiveSandbox) -> None:
        """Stop tracking ``sandbox`` without touching it: its timers stop and
        nothing is recorded. For a handle another program has since taken
        over (it suspended or resumed the sandbox): acting on it here would
        undo that program's work."""
        record = sandbox.record
        if record is not None and self._sandboxes.get(sandbox.id) is sandbox:
            self._forget(record)

    async def closed(self, sandbox: LiveSandbox) -> None:
        """The owner closed the sandbox: forget its timers."""
        record = sandbox.record
        if record is None:
            return
        async with record.lock:
            if record.state not in FINAL:
                # Raises, with the sandbox still live and timed, if it cannot be recorded.
                await self._transition(sandbox, SandboxState.TERMINATED, "closed")
        self.scheduler.cancel(record.sandbox_id)
        self._sandboxes.pop(record.sandbox_id, None)

    # -- time limits ------------------------------------------------------------------------
    async def set_timeout(self, sandbox: LiveSandbox, seconds: float) -> float:
        """Make the deadline now + ``seconds``; return it as Unix time.

        A deadline in the past reaps the sandbox; one above the ceiling is
        refused, never clamped. With ``on_deadline`` set, the deadline takes
        effect only once it is recorded.
        """
        record = self._record(sandbox)
        if record.state in FINAL:
            raise self.expired_error(record)
        # bool is an int to Python, never a timeout to a caller; NaN and -inf
        # would make a deadline no clock can compare or JSON can carry.
        if (
            isinstance(seconds, bool)
            or not isinstance(seconds, int | float)
            or seconds != seconds
            or seconds == -math.inf
        ):
            raise InvalidArgument(f"timeout_seconds must be a number, got {seconds!r}")
        if seconds > self.timeout_ceiling:
            raise TimeoutTooLarge(
                f"timeout of {seconds:g} s for sandbox {record.sandbox_id} is above the "
                f"ceiling of {self.timeout_ceiling:g} s"
            )
        if self.shared is None:
            return await self._set_deadline(sandbox, record, seconds)
        # Under the claim: ordered with the other programs' timers, so that a
        # deadline recorded here is never lost to an expiry acting on the old one.
        async with record.lock, self._claimed(sandbox, record):
            self._check_live(record)  # another program may have ended it
            return await self._set_deadline(sandbox, record, seconds)

    async def _set_deadline(self, sandbox: LiveSandbox, record: LifecycleRecord,
                            seconds: float) -> float:
        deadline_unix = self.clock.time() + seconds
        if self.shared is not None:
            with anyio.CancelScope(shield=True):
                await self.shared.record_deadline(record.sandbox_id, deadline_unix)
        if self.on_deadline is not None:
            # Recorded and applied as one, whether or not the caller waits.
            with anyio.CancelScope(shield=True):
                result = self.on_deadline(record.sandbox_id, deadline_unix)
                if inspect.isawaitable(result):
                    await result
            if record.state in FINAL:  # it ended while the deadline was written
                raise self.expired_error(record)
        record.live_deadline_mono = self.clock.monotonic() + seconds
        self._reschedule(sandbox)
        if seconds <= 0:
            # Due now: the scheduler reaps it on its next turn.
            self.scheduler.schedule(record.sandbox_id, self.clock.monotonic())
        return deadline_unix

    # -- the status -------------------------------------------------------------------------
    def state(self, sandbox: LiveSandbox) -> SandboxStatus:
        """State, reason, deadline, timestamps and meter (the daemon's view)."""
        return self.status(sandbox)

    async def look_at_limits(self, sandbox: LiveSandbox) -> None:
        """Take the time limits another program may have recorded since this
        one's timer last looked, reading them off the event loop: async code
        about to read the status calls this first, so that the status has
        nothing left to read on the loop."""
        record = self._record(sandbox)
        if self.shared is not None and record.state not in FINAL:
            limits = await self.shared.limits(record.sandbox_id)
            if limits is not None:
                self._take_limits(record, limits)
                self._reschedule(sandbox)

    def status(self, sandbox: LiveSandbox) -> SandboxStatus:
        """What :meth:`state` returns. Reading it is not activity."""
        record = self._record(sandbox)
        if self.shared is not None and record.state not in FINAL:
            # Another program may have moved its deadline since this one last
            # looked: the status says the recorded one (cheap when none did),
            # and the timer goes by it from now.
            limits = self.shared.limits_now(record.sandbox_id)
            if limits is not None:
                self._take_limits(record, limits)
                self._reschedule(sandbox)
        now = self.clock.monotonic()
        wall = self.clock.time()
        deadlines = [d for d in self._hard_deadlines(record) if d is not None]
        deadline_unix = wall + (min(deadlines) - now) if deadlines else None
        state, reason = record.recording or (record.state, record.reason)
        return SandboxStatus(
            id=record.sandbox_id,
            state=state,
            reason=reason,
            created_at_unix=record.created_unix,
            last_active_unix=wall - (now - record.last_activity_mono),
            idle_seconds=(
                None if record.state in FINAL
                else 0.0 if sandbox.open_operations else now - record.last_activity_mono
            ),
            deadline_unix=deadline_unix,
            meter=record.meter.as_dict(now),
        )

    async def close(self) -> None:
        await self.scheduler.close()
        for task in list(self._publishers):
            task.cancel()
        self._sandboxes.clear()


def _ready(record: LifecycleRecord) -> bool:
    """A call may go straight on: running, and no transition under way."""
    return record.state is SandboxState.RUNNING and not record.transitioning


_ENGINE_ATTRIBUTE = "_hutch_lifecycle_engine"


def default_engine() -> LifecycleEngine:
    """The engine of the running event loop (one per loop, made on first use).

    Its set_timeout ceiling is ``HUTCH_TIMEOUT_CEILING`` seconds if set, else
    86400; a daemon makes its own engine with the ceiling of its config.

    It hangs off the loop itself, so it goes when the loop goes (a mapping
    keyed by loop would keep every loop alive through its engine's task).
    """
    loop = asyncio.get_running_loop()
    engine: LifecycleEngine | None = getattr(loop, _ENGINE_ATTRIBUTE, None)
    if engine is None:
        ceiling = os.environ.get("HUTCH_TIMEOUT_CEILING")
        engine = LifecycleEngine(
            timeout_ceiling=float(ceiling) if ceiling else DEFAULT_TIMEOUT_CEILING
        )
        setattr(loop, _ENGINE_ATTRIBUTE, engine)
    return engine
