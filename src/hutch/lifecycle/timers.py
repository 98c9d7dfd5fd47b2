"""The timers: idleness (work-aware) and time limits. Each record has one
entry in the scheduler, at the earliest moment something could be due for
it; when it fires, what is due is decided under the record's lock."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Literal

from .._errors import HutchError, InvalidArgument
from ..states import FINAL, SandboxState
from .clock import VirtualClock
from .records import LifecycleRecord
from .shared import CLAIM_RETRY_SECONDS, LIMITS_POLL_SECONDS, SharedLimits
from .transitions import Transitions

if TYPE_CHECKING:
    from ..core.live import LiveSandbox

log = logging.getLogger("hutch.lifecycle")


def _told(exc: Exception, message: str, *args: object) -> None:
    """Log a failed timer step: a typed refusal (a runtime gone outside
    hutch, which its provider's watcher tells) is a known state, said in one
    line with its reason; anything else is a fault, logged with its trace."""
    if isinstance(exc, HutchError):
        log.warning(message + ": %s", *args, exc)
    else:
        log.exception(message, *args)


#: What an idle timer's evaluation makes of a sandbox: its timers go on
#: (``keep``), it ended here and its backend is freed (``release``), or
#: another program sharing it ended it and this engine only stops timing it
#: (``drop``: its backend is not this program's to free).
_Verdict = Literal["keep", "release", "drop"]


class Timers(Transitions):
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
            # An unreachable backend is not proof of idleness: kept either way.
            try:
                return await sandbox.backend.runtime.count_busy_processes() > 0
            except Exception as exc:
                _told(exc, "sandbox %s: could not count its processes", sandbox.id)
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
        except Exception as exc:
            # A failed step (a backend that could not suspend) is retried
            # later; the sandbox is never silently dropped from the timers.
            _told(exc, "sandbox %s: lifecycle step failed", sandbox_id)
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
            except Exception as exc:
                _told(exc, "sandbox %s: releasing it after %s failed", sandbox_id, record.reason)
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
            limits = await self.shared.limits(record.sandbox_id)
            if limits is not None:  # another program wrote since: its deadline too
                self._take_limits(record, limits)
        expiry = self._expiry(record)
        if (expiry == "timeout_expired" and record.options.on_timeout == "suspend"
                and record.can_suspend):
            return await self._suspend_at_deadline(sandbox, record)
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
        if not await self.shared.moved(record.sandbox_id):
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

    async def _suspend_at_deadline(
        self, sandbox: LiveSandbox, record: LifecycleRecord
    ) -> tuple[_Verdict, float | None]:
        """The deadline of a sandbox whose options say ``on_timeout =
        "suspend"``: it is spent, and the sandbox suspended until a resume
        (one already held, paused or suspended, stays as it is)."""
        record.live_deadline_mono = None
        if record.state is SandboxState.RUNNING:
            await self._suspend_locked(sandbox, record, "timeout")
        return "keep", None

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
