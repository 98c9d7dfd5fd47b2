"""What the lifecycle engine keeps of each sandbox: its record (state,
clocks, deadline, meter), the options it times it by, and the typed error
a sandbox that ended answers with."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol

from .._errors import (
    HutchError,
    IdleTimeoutExpired,
    MaxLifetimeExceeded,
    SandboxExpired,
    SandboxUnavailable,
    TimeoutExpired,
)
from ..core.live import closed_message
from ..states import SandboxState


class LifecycleOptions(Protocol):
    """What the engine reads of a sandbox's options (``hutch.SandboxOptions``
    has them): its idle rules and time limits. Unset means none."""

    @property
    def idle_suspend_after(self) -> float | None: ...

    @property
    def auto_resume(self) -> bool: ...

    @property
    def idle_timeout(self) -> float | None: ...

    @property
    def max_lifetime(self) -> float | None: ...

    @property
    def on_timeout(self) -> str: ...


#: Makes a transition durable (sandbox id, old state, new state, reason).
TransitionHook = Callable[[str, SandboxState, SandboxState, str | None], Awaitable[None] | None]
#: Records a set_timeout deadline (sandbox id, Unix time) before it takes effect.
DeadlineHook = Callable[[str, float], Awaitable[None] | None]
#: Records what happened in a sandbox, as an event of it (sandbox id, kind,
#: message): best effort, it never raises (a kill that left processes).
NoteHook = Callable[[str, str, str], Awaitable[None]]

#: The reasons a time limit ends a sandbox with: the typed error of each, and what to do.
EXPIRY_ERRORS: dict[str, tuple[type[SandboxExpired], str]] = {
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
    if reason in EXPIRY_ERRORS:
        cls, advice = EXPIRY_ERRORS[reason]
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
    options: LifecycleOptions
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
