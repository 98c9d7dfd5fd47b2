"""The sandbox state machine (SPEC §2) and its one transition check."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from .._errors import InvalidState
from ..providers.base import RuntimeState


class SandboxState(enum.StrEnum):
    CREATING = "creating"
    RUNNING = "running"
    PAUSED = "paused"
    SUSPENDED = "suspended"
    TERMINATED = "terminated"
    FAILED = "failed"


S = SandboxState
ALLOWED: dict[SandboxState, frozenset[SandboxState]] = {
    S.CREATING: frozenset({S.RUNNING, S.TERMINATED, S.FAILED}),
    S.RUNNING: frozenset({S.PAUSED, S.SUSPENDED, S.TERMINATED, S.FAILED}),
    S.PAUSED: frozenset({S.RUNNING, S.TERMINATED, S.FAILED}),
    S.SUSPENDED: frozenset({S.RUNNING, S.TERMINATED, S.FAILED}),
    S.TERMINATED: frozenset(),
    S.FAILED: frozenset(),
}

FINAL = frozenset({S.TERMINATED, S.FAILED})


def check_transition(sandbox_id: str, old: SandboxState, new: SandboxState) -> None:
    if new not in ALLOWED[old]:
        raise InvalidState(f"sandbox {sandbox_id} is {old.value}; it cannot become {new.value}")


@dataclass(frozen=True)
class SandboxStatus:
    """What a dashboard shows; reading it is not activity."""

    id: str
    state: SandboxState
    reason: str | None
    created_at_unix: float
    last_active_unix: float
    #: None once the sandbox has ended: nothing is idle any more.
    idle_seconds: float | None
    deadline_unix: float | None
    meter: dict[str, float]

    def as_dict(self) -> dict[str, object]:
        """Plain JSON-ready data (for the wire and ``hutch ls``)."""
        return {
            "id": self.id,
            "state": self.state.value,
            "reason": self.reason,
            "created_at_unix": self.created_at_unix,
            "last_active_unix": self.last_active_unix,
            "idle_seconds": self.idle_seconds,
            "deadline_unix": self.deadline_unix,
            "meter": dict(self.meter),
        }


def found_state(recorded: SandboxState, observed: RuntimeState) -> SandboxState | None:
    """The state a sandbox found again is in: its runtime's own, where the
    provider can tell it; the record's where it cannot tell running from
    paused (or up from suspended). None: nothing of it is left."""
    if observed is RuntimeState.GONE:
        return None
    if observed is RuntimeState.LIVE:
        return recorded if recorded is not SandboxState.CREATING else SandboxState.RUNNING
    return SandboxState(observed.value)
