"""The lifecycle engine: states, pause/suspend/resume, work-aware idleness and
time limits, for every sandbox of one event loop.

Each sandbox has a :class:`LifecycleRecord`. Operations pass through
:meth:`LifecycleEngine.enter` (the gate): on a running sandbox that is one
attribute check and a timestamp; a suspended one is resumed first (or
refused in strict mode); an expired one fails with the typed error of its
reason. Timers live in one :class:`Scheduler`: each record has one entry, at
the earliest moment something could be due for it, and is re-evaluated then.

Idleness is work-aware: an open operation, a running background command, or
any process in the sandbox other than its keeper makes it busy, and a busy
sandbox's idle clock restarts. A paused sandbox's idle clock is stopped.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import anyio

from .._errors import (
    HutchError,
    IdleTimeoutExpired,
    InvalidArgument,
    MaxLifetimeExceeded,
    SandboxExpired,
    SandboxUnavailable,
    TimeoutExpired,
    TimeoutTooLarge,
)
from .._faults import fault_point
from .._inflight import CallMark
from ..core.live import closed_message
from ..providers.base import RuntimeLost
from ..states import FINAL, SandboxState, SandboxStatus, check_transition
from .clock import Clock, RealClock, VirtualClock
from .scheduler import Scheduler
from .shared import (
    CLAIM_RETRY_SECONDS,
    CLAIM_WAIT_SECONDS,
    LIMITS_POLL_SECONDS,
    MIN_PUBLISH_SECONDS,
    PUBLISH_SHARE,
    SharedActivity,
    SharedLimits,
    SharedView,
)

if TYPE_CHECKING:
    from ..config import SandboxOptions
    from ..core.live import LiveSandbox

log = logging.getLogger("hutch.lifecycle")

DEFAULT_TIMEOUT_CEILING = 86400.0
#: How often a busy sandbox is looked at again once an idle window is due.
BUSY_POLL_SECONDS = 1.0
#: How long after a failed lifecycle step (a suspend the backend refused) it is tried again.
RETRY_AFTER_SECONDS = 10.0

#: What an idle timer's evaluation makes of a sandbox: its timers go on
#: (``keep``), it ended here and its backend is freed (``release``), or
#: another program sharing it ended it and this engine only stops timing it
#: (``drop``: its backend is not this program's to free).
_Verdict = Literal["keep", "release", "drop"]

TransitionHook = Callable[[str, SandboxState, SandboxState, str | None], Awaitable[None] | None]
#: Records a set_timeout deadline (sandbox id, Unix time) before it takes effect.
DeadlineHook = Callable[[str, float], Awaitable[None] | None]

_EXPIRY: dict[str, tuple[type[SandboxExpired], str]] = {
    "max_lifetime_exceeded": (
        MaxLifetimeExceeded,
        "it reached its max_lifetime; make a new sandbox (and give it a longer max_lifetime "
        "if it needs one)",
    ),
    "idle_timeout": (
        IdleTimeoutExpired,
        "it was idle longer than its idle_timeout; make a new sandbox, and keep it busy or "
        "call set_timeout before it goes idle",
    ),
    "timeout_expired": (
        TimeoutExpired,
        "its set_timeout deadline passed; make a new sandbox, and call set_timeout earlier "
        "to extend it",
    ),
}


def expiry_error(sandbox_id: str, state: SandboxState, reason: str | None) -> HutchError:
    """The typed error every call on a terminated or failed sandbox gets.

    Also for a daemon answering about a sandbox it only knows from its store.
    """
    reason = reason or "terminated"
    if reason in _EXPIRY:
        cls, advice = _EXPIRY[reason]
        return cls(f"sandbox {sandbox_id} was terminated: {advice}")
    if reason == "closed":
        return SandboxUnavailable(closed_message(sandbox_id))
    return SandboxUnavailable(f"sandbox {sandbox_id} is {state.value} ({reason})")


@dataclass
class Meter:
    """Seconds spent in each state, the current stretch included."""

    seconds: dict[SandboxState, float] = field(default_factory=dict)
    state: SandboxState = SandboxState.CREATING
    since: float = 0.0

    def switch(self, state: SandboxState, now: float) -> None:
        self.seconds[self.state] = self.seconds.get(self.state, 0.0) + (now - self.since)
        self.state, self.since = state, now

    def total(self, state: SandboxState, now: float) -> float:
        current = now - self.since if state == self.state else 0.0
        return self.seconds.get(state, 0.0) + current

    def as_dict(self, now: float) -> dict[str, float]:
        return {
            "running_s": round(self.total(SandboxState.RUNNING, now), 3),
            "paused_s": round(self.total(SandboxState.PAUSED, now), 3),
            "suspended_s": round(self.total(SandboxState.SUSPENDED, now), 3),
        }


@dataclass
class LifecycleRecord:
    sandbox_id: str
    options: SandboxOptions
    state: SandboxState
    created_mono: float
    created_unix: float
    last_activity_mono: float
    meter: Meter
    reason: str | None = None
    live_deadline_mono: float | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    #: A transition is under way: operations wait for it instead of racing it.
    transitioning: bool = False
    can_suspend: bool = False
    #: The activity last written for other programs (monotonic), and when it was.
    published_activity_mono: float = -math.inf
    published_at_mono: float = -math.inf
    #: A write of the activity is under way or waiting its turn.
    publishing: bool = False
    #: The state and reason last recorded, while a transition's record is
    #: being written: the status says these until the store has the new
    #: ones (the write may yet be refused, and the transition undone).
    recording: tuple[SandboxState, str | None] | None = None


class LifecycleEngine:
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
    ) -> None:
        self.clock: Clock = clock or RealClock()
        self.timeout_ceiling = timeout_ceiling
        self.busy_poll = busy_poll
        self.retry_after = retry_after
        #: Makes a transition durable (a daemon's store). If it raises, the
        #: transition did not happen: the record is put back as it was, the
        #: backend step undone, and the caller gets the error.
        self.on_transition = on_transition
        #: The same for a set_timeout deadline.
        self.on_deadline = on_deadline
        #: Where other programs holding the same sandboxes share their
        #: activity and idle transitions (see :mod:`.shared`); None: this
        #: engine is the only one that times its sandboxes.
        self.shared = shared
        self._publishers: set[asyncio.Task[None]] = set()
        # A virtual clock is driven by advance(), never by a sleeping task.
        self.scheduler = Scheduler(
            self.clock, self._evaluate, drive=not isinstance(self.clock, VirtualClock)
        )
        self._sandboxes: dict[str, LiveSandbox] = {}
        #: Sandboxes whose dead runtime is released and whose failure is not
        #: yet recorded (the store refused it; a retry follows).
        self._released: set[str] = set()

    # -- registration --------------------------------------------------------------
    async def attach(
        self,
        sandbox: LiveSandbox,
        options: SandboxOptions,
        *,
        state: SandboxState = SandboxState.RUNNING,
        created_unix: float | None = None,
        deadline_unix: float | None = None,
        last_active_unix: float | None = None,
        meter: Mapping[str, float] | None = None,
    ) -> LifecycleRecord:
        """Track a sandbox whose backend has just been created.

        A daemon adopting a sandbox after a restart passes what it persisted,
        so that no bound is forgotten or reset: the ``state`` it is in, when
        it was made (``created_unix``: max_lifetime counts from there), its
        set_timeout deadline (``deadline_unix``; one that passed while the
        daemon was down reaps it at once), when it was last active (its idle
        clock goes on from there) and its ``meter`` (as ``SandboxStatus.meter``).
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
                await self._transition(sandbox, SandboxState.RUNNING, None)
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

    def tracked(self) -> int:
        return len(self._sandboxes)

    @staticmethod
    def _record(sandbox: LiveSandbox) -> LifecycleRecord:
        record = sandbox.record
        if record is None:
            raise SandboxUnavailable(f"sandbox {sandbox.id} is not tracked by a lifecycle engine")
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
                if record.state is SandboxState.RUNNING and not record.transitioning and (
                    # Just brought up to date under the claim; or riding on
                    # this program's calls in flight, which no other program's
                    # suspend passes (and which may be waiting on this one:
                    # a call made inside another must not wait for a claim).
                    followed or mark is CallMark.JOINED
                    # Another program may have suspended or ended it since:
                    # the slow way follows the record first.
                    or not shared.moved(record.sandbox_id)
                ):
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

    def _active(self, sandbox: LiveSandbox, record: LifecycleRecord) -> None:
        """Activity now: the idle clock restarts, here and for every program
        that shares the sandbox."""
        record.last_activity_mono = self.clock.monotonic()
        if self.shared is not None:
            self._publish(sandbox, record)

    # -- activity shared with other programs -------------------------------------------
    @asynccontextmanager
    async def _claimed(self, sandbox: LiveSandbox, record: LifecycleRecord) -> AsyncIterator[bool]:
        """With other programs sharing the sandbox: hold the claim while a
        transition is taken and recorded, after bringing a handle another
        program has moved since up to date (its state becomes the recorded
        one, so that this program never resumes over that one's resume).
        Yields whether it was brought up to date. Waits while another
        program holds the claim, and gives up (typed) after a long while."""
        if self.shared is None or record.state in FINAL:
            yield False
            return
        waited_since = self.clock.monotonic()
        delay = 0.02
        while True:
            async with self.shared.claim(record.sandbox_id) as view:
                if view is not None:
                    if not view.current:
                        await self._follow(sandbox, record, view)
                    yield not view.current
                    return
            if self.clock.monotonic() - waited_since > CLAIM_WAIT_SECONDS:
                raise SandboxUnavailable(
                    f"sandbox {record.sandbox_id}: another program holding it has been "
                    f"changing its state for over {CLAIM_WAIT_SECONDS:g} s; try again"
                )
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.5)

    async def _follow(
        self, sandbox: LiveSandbox, record: LifecycleRecord, view: SharedView
    ) -> None:
        """Another program moved the sandbox: take its record as this
        handle's state (nothing is written: that program wrote it). One it
        ended on a time limit ends here with the same reason, so that its
        typed error is the same whichever program's timer acted."""
        assert self.shared is not None
        state = await self.shared.refresh(sandbox)
        if state is None or state in FINAL:
            expired = state is not None and view.reason in _EXPIRY
            record.state = SandboxState.TERMINATED
            record.reason = view.reason if expired else "ended by another program"
        else:
            record.state, record.reason = state, None
        record.meter.switch(record.state, self.clock.monotonic())
        log.info("sandbox %s: another program made it %s; this handle follows",
                 record.sandbox_id, record.state.value)
        if record.state in FINAL:
            self._forget(record)  # its timers stop; its backend is not this program's to free

    def _publish_interval(self, record: LifecycleRecord) -> float | None:
        """How often this record's activity is written: a share of its
        shortest idle window; None without one (no idle rule reads it)."""
        windows = [w for w in (record.options.idle_suspend_after, record.options.idle_timeout)
                   if w is not None]
        if not windows:
            return None
        return max(MIN_PUBLISH_SECONDS, min(windows) * PUBLISH_SHARE)

    def _publish(self, sandbox: LiveSandbox, record: LifecycleRecord) -> None:
        """Have the activity written: at once if none was written for an
        interval, else once the interval is over (the latest by then), and
        again each interval while an operation stays open here."""
        if record.publishing or record.state in FINAL:
            return
        if self._publish_interval(record) is None:
            return
        record.publishing = True
        task = asyncio.get_running_loop().create_task(self._publishing(sandbox, record))
        self._publishers.add(task)
        task.add_done_callback(self._publishers.discard)

    async def _publishing(self, sandbox: LiveSandbox, record: LifecycleRecord) -> None:
        shared = self.shared
        try:
            while shared is not None:
                interval = self._publish_interval(record)
                if interval is None:
                    return
                wait = record.published_at_mono + interval - self.clock.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                if sandbox.open_operations and record.state is SandboxState.RUNNING:
                    # An operation open here (a long upload) is invisible to
                    # the other programs' idle rules but through its activity.
                    record.last_activity_mono = self.clock.monotonic()
                seen = record.last_activity_mono
                if seen <= record.published_activity_mono or record.state in FINAL:
                    return
                at_unix = self.clock.time() - (self.clock.monotonic() - seen)
                await shared.publish(record.sandbox_id, at_unix)
                record.published_activity_mono = seen
                record.published_at_mono = self.clock.monotonic()
        except Exception as exc:  # the next activity tries again; a timer here still reads it
            log.warning("sandbox %s: its activity was not shared: %s", record.sandbox_id, exc)
        finally:
            record.publishing = False

    def _check_live(self, record: LifecycleRecord) -> None:
        """A terminated sandbox answers every call with the error of its reason."""
        if record.state in FINAL:
            raise self.expired_error(record)

    def expired_error(self, record: LifecycleRecord) -> HutchError:
        return expiry_error(record.sandbox_id, record.state, record.reason)

    # -- transitions ----------------------------------------------------------------------
    async def _transition(
        self, sandbox: LiveSandbox, new: SandboxState, reason: str | None
    ) -> None:
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
            record.recording = (old, before[0])
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

    @asynccontextmanager
    async def _calls_held_off(self, record: LifecycleRecord) -> AsyncIterator[None]:
        """Under the claim: wait until no other program sharing the sandbox
        has a call in flight, and hold off their new ones (they wait for the
        claim, then follow) while the block takes the sandbox down: a
        suspend never kills another program's command, nor does one meet
        the container going down. Gives up (typed) after a long while."""
        if self.shared is None or record.state in FINAL:
            yield
            return
        waited_since = self.clock.monotonic()
        delay = 0.005
        while True:
            with self.shared.calls_held_off(record.sandbox_id) as held:
                if held:
                    yield
                    return
            if self.clock.monotonic() - waited_since > CLAIM_WAIT_SECONDS:
                raise SandboxUnavailable(
                    f"sandbox {record.sandbox_id}: another program holding it has had a call "
                    f"running for over {CLAIM_WAIT_SECONDS:g} s; it is not taken down under "
                    "that call: try again once it ends"
                )
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.1)

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

    async def resume(self, sandbox: LiveSandbox) -> None:
        record = self._record(sandbox)
        async with record.lock, self._claimed(sandbox, record) as followed:
            if not (followed and record.state is SandboxState.RUNNING):
                await self._resume_locked(sandbox, record)
        self._reschedule(sandbox)

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

    def _forget(self, record: LifecycleRecord) -> None:
        self.scheduler.cancel(record.sandbox_id)
        self._sandboxes.pop(record.sandbox_id, None)

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

    def state(self, sandbox: LiveSandbox) -> SandboxStatus:
        """State, reason, deadline, timestamps and meter (the daemon's view)."""
        return self.status(sandbox)

    def status(self, sandbox: LiveSandbox) -> SandboxStatus:
        """What :meth:`state` returns. Reading it is not activity."""
        record = self._record(sandbox)
        if self.shared is not None and record.state not in FINAL:
            # Another program may have moved its deadline since this one's
            # timer last looked: the status says the recorded one (cheap
            # when none did), and the timer goes by it from now.
            limits = self.shared.limits(record.sandbox_id)
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

    # -- the timers ------------------------------------------------------------------------
    @staticmethod
    def _hard_deadlines(record: LifecycleRecord) -> tuple[float | None, float | None]:
        lifetime = record.options.max_lifetime
        return (
            record.created_mono + lifetime if lifetime is not None else None,
            record.live_deadline_mono,
        )

    def _idle_windows(self, record: LifecycleRecord, now: float) -> list[tuple[float, str]]:
        """(window, action) pairs that apply in the record's current state."""
        opts = record.options
        live_future = record.live_deadline_mono is not None and record.live_deadline_mono > now
        windows: list[tuple[float, str]] = []
        # A provider that cannot suspend ignores idle_suspend_after.
        if (
            record.state is SandboxState.RUNNING
            and opts.idle_suspend_after is not None
            and record.can_suspend
        ):
            windows.append((opts.idle_suspend_after, "suspend"))
        # The live deadline, while in the future, has authority over the idle clock.
        if opts.idle_timeout is not None and not live_future and record.state in (
            SandboxState.RUNNING, SandboxState.SUSPENDED
        ):
            windows.append((opts.idle_timeout, "terminate"))
        return windows

    def _reschedule(self, sandbox: LiveSandbox) -> None:
        record = sandbox.record
        if record is None or record.state in FINAL:
            return
        now = self.clock.monotonic()
        candidates = [d for d in self._hard_deadlines(record) if d is not None]
        candidates += [record.last_activity_mono + w for w, _ in self._idle_windows(record, now)]
        if self.shared is not None:
            # Another program may set or move its deadline (and be gone by then).
            candidates.append(now + LIMITS_POLL_SECONDS)
        if candidates:
            self.scheduler.schedule(record.sandbox_id, min(candidates))
        else:
            self.scheduler.cancel(record.sandbox_id)

    async def _is_busy(self, sandbox: LiveSandbox) -> bool:
        if sandbox.open_operations:
            return True
        if sandbox.capabilities.processes:
            try:
                return await sandbox.backend.runtime.count_busy_processes() > 0
            except Exception:  # an unreachable backend is not proof of idleness
                log.exception("sandbox %s: could not count its processes", sandbox.id)
                return True
        return False

    async def _evaluate(self, sandbox_id: str) -> None:
        """A timer fired: decide, under the record's lock, what is due."""
        sandbox = self._sandboxes.get(sandbox_id)
        if sandbox is None:
            return
        record = self._record(sandbox)
        verdict: _Verdict = "keep"
        next_due: float | None = None
        try:
            # The lock waits out a transition under way (a pause, a resume by
            # an operation) instead of racing it or polling until it is over.
            async with record.lock:
                verdict, next_due = await self._decide(sandbox, record)
        except Exception:
            # A failed step (a backend that could not suspend) is retried
            # later; the sandbox is never silently dropped from the timers.
            log.exception("sandbox %s: lifecycle step failed", sandbox_id)
            next_due = self.clock.monotonic() + self.retry_after
        if next_due is not None and self.shared is not None:
            next_due = min(next_due, self.clock.monotonic() + LIMITS_POLL_SECONDS)
        if verdict == "drop":
            # Another program sharing the sandbox ended it: nothing here acts on it.
            self._forget(record)
            return
        # A sandbox terminated here is released even if a step after its
        # transition failed: reaped means its backend is freed.
        if verdict == "release" or record.state is SandboxState.TERMINATED:
            self._forget(record)
            try:
                await sandbox.reap()
            except Exception:
                log.exception("sandbox %s: releasing it after %s failed", sandbox_id, record.reason)
            return
        if record.state in FINAL:
            self._forget(record)
            return
        if next_due is None:
            self._reschedule(sandbox)
        else:
            self.scheduler.schedule(record.sandbox_id, next_due)

    def _due(self, record: LifecycleRecord) -> list[str]:
        """The idle actions due now (``suspend``, ``terminate``)."""
        now = self.clock.monotonic()
        idle_for = now - record.last_activity_mono
        return [action for window, action in self._idle_windows(record, now)
                if idle_for >= window]

    async def _decide(
        self, sandbox: LiveSandbox, record: LifecycleRecord
    ) -> tuple[_Verdict, float | None]:
        """(what becomes of the sandbox's timers and backend, when to look
        again or None for the usual time)."""
        if record.state in FINAL:
            return "keep", None
        if self.shared is not None:
            limits = self.shared.limits(record.sandbox_id)
            if limits is not None:  # another program wrote since: its deadline too
                self._take_limits(record, limits)
        expiry = self._expiry(record)
        if expiry is not None:
            if self.shared is not None:
                return await self._expire_shared(sandbox, record)
            await self._terminate_locked(sandbox, record, expiry)
            return "release", None
        if not self._due(record):
            return "keep", None
        if record.state is not SandboxState.RUNNING and sandbox.open_operations:
            # An operation still open on a suspended sandbox (one that arrived
            # as it went down, and waits to resume it) is not idleness.
            return "keep", self._busy_recheck(record)
        if self.shared is None:
            busy = await self._still_working(sandbox, record)
            if busy is not None:
                return busy
            return await self._idle_step(sandbox, record)
        counted = False
        if not self.shared.moved(record.sandbox_id):
            # Working here is told without the claim (no store write while a
            # long command runs); a handle moved elsewhere is followed first,
            # for its processes may not be where it thinks.
            busy = await self._still_working(sandbox, record)
            if busy is not None:
                return busy
            counted = True
        # Idle here; whether the record is still this program's, and whether
        # the others holding it are idle too, is read under the claim, and
        # the step taken (and recorded) within it.
        async with self.shared.claim(record.sandbox_id) as view:
            if view is None:  # another program is acting on it now
                return "keep", self._busy_recheck(record)
            if not view.current:
                # Moved elsewhere (its processes cannot be counted here as
                # this handle knew it): this handle takes the recorded state.
                await self._follow(sandbox, record, view)
                return ("drop" if record.state in FINAL else "keep"), None
            self._take_limits(record, view.limits)
            expiry = self._expiry(record)
            if expiry is not None:  # another program's deadline, crossed
                await self._terminate_locked(sandbox, record, expiry)
                return "release", None
            if view.last_active_unix is not None:
                theirs = self.clock.monotonic() - (self.clock.time() - view.last_active_unix)
                record.last_activity_mono = max(record.last_activity_mono, theirs)
            if not self._due(record):
                return "keep", None  # used elsewhere: timed again from that use
            busy = None if counted else await self._still_working(sandbox, record)
            if busy is not None:
                return busy
            return await self._idle_step(sandbox, record)

    def _expiry(self, record: LifecycleRecord) -> str | None:
        """The time limit the sandbox has crossed (its expiry reason), if any."""
        now = self.clock.monotonic()
        lifetime, live = self._hard_deadlines(record)
        if lifetime is not None and now >= lifetime:
            return "max_lifetime_exceeded"
        if live is not None and now >= live:
            return "timeout_expired"
        return None

    def _take_limits(self, record: LifecycleRecord, limits: SharedLimits) -> None:
        """The sandbox's time limits as the store records them (the truth:
        another program may have made or found it, or moved its deadline)."""
        now, wall = self.clock.monotonic(), self.clock.time()
        if limits.created_unix is not None:
            record.created_unix = limits.created_unix
            record.created_mono = now - max(0.0, wall - limits.created_unix)
        if limits.deadline_unix is not None:
            record.live_deadline_mono = now + (limits.deadline_unix - wall)

    async def _expire_shared(
        self, sandbox: LiveSandbox, record: LifecycleRecord
    ) -> tuple[_Verdict, float | None]:
        """A time limit is due by this program's timer: act only if the
        store says so too, under the claim (compare and set: two programs'
        timers never both end it, and the reason is the one recorded)."""
        assert self.shared is not None
        async with self.shared.claim(record.sandbox_id) as view:
            if view is None:  # another program is acting on it now: look again soon
                return "keep", self.clock.monotonic() + CLAIM_RETRY_SECONDS
            if not view.current:  # moved or ended elsewhere: this handle follows
                await self._follow(sandbox, record, view)
                return ("drop" if record.state in FINAL else "keep"), None
            self._take_limits(record, view.limits)
            expiry = self._expiry(record)
            if expiry is None:
                return "keep", None  # another program moved the deadline: timed from it
            await self._terminate_locked(sandbox, record, expiry)
            return "release", None

    async def _still_working(
        self, sandbox: LiveSandbox, record: LifecycleRecord
    ) -> tuple[_Verdict, float | None] | None:
        """When an idle window is due: None if the sandbox is idle indeed,
        else when to look again (it is working, or an operation came in)."""
        if record.state is not SandboxState.RUNNING:
            return None
        seen = record.last_activity_mono
        if await self._is_busy(sandbox):
            # Working, not idle: the idle clock starts again from now, and
            # the sandbox is looked at again soon, not a whole window later.
            self._active(sandbox, record)
            return "keep", self._busy_recheck(record)
        if sandbox.open_operations or record.last_activity_mono != seen:
            return "keep", None  # an operation came in while we were looking
        return None

    async def _idle_step(
        self, sandbox: LiveSandbox, record: LifecycleRecord
    ) -> tuple[_Verdict, float | None]:
        """Take the idle action due, unless another program sharing the
        sandbox has a call in flight (its activity not written yet): then
        it is busy, and looked at again soon."""
        if self.shared is None:
            return await self._idle_action(sandbox, record), None
        with self.shared.calls_held_off(record.sandbox_id) as held:
            if not held:
                return "keep", self._busy_recheck(record)
            return await self._idle_action(sandbox, record), None

    async def _idle_action(self, sandbox: LiveSandbox, record: LifecycleRecord) -> _Verdict:
        """Reap (idle_timeout) or suspend."""
        if "terminate" in self._due(record):
            await self._terminate_locked(sandbox, record, "idle_timeout")
            return "release"
        if record.state is SandboxState.RUNNING:
            await self._suspend_locked(sandbox, record, "idle")
        return "keep"

    def _busy_recheck(self, record: LifecycleRecord) -> float:
        """When to look at a busy sandbox again: within a second for short
        windows, within 5 % of the window for long ones (a process count
        every second for a 1-hour window would cost more than it tells)."""
        now = self.clock.monotonic()
        windows = [w for w, _ in self._idle_windows(record, now)]
        interval = self.busy_poll
        if windows:
            window = min(windows)
            interval = min(window, max(self.busy_poll, window / 20))
        candidates = [d for d in self._hard_deadlines(record) if d is not None]
        return min([now + interval, *candidates])

    async def advance(self, seconds: float) -> None:
        """Virtual clock only: move time forward, running every timer due on the way."""
        if not isinstance(self.clock, VirtualClock):
            raise InvalidArgument("advance() needs an engine with a VirtualClock")
        target = self.clock.monotonic() + seconds
        while True:
            due = self.scheduler.next_due()
            if due is None or due > target:
                break
            self.clock.step(max(0.0, due - self.clock.monotonic()))
            tasks = self.scheduler.run_due()
            if tasks:
                await asyncio.gather(*tasks)
        self.clock.step(target - self.clock.monotonic())
        tasks = self.scheduler.run_due()
        if tasks:
            await asyncio.gather(*tasks)

    async def close(self) -> None:
        await self.scheduler.close()
        for task in list(self._publishers):
            task.cancel()
        self._sandboxes.clear()


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

