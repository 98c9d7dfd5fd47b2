"""The sandbox state machine (SPEC §2) and its one transition check."""

from __future__ import annotations

import enum

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


def found_state(recorded: SandboxState, observed: RuntimeState) -> SandboxState | None:
    """The state a sandbox found again is in: its runtime's own, where the
    provider can tell it; the record's where it cannot tell running from
    paused (or up from suspended). None: nothing of it is left."""
    if observed is RuntimeState.GONE:
        return None
    if observed is RuntimeState.LIVE:
        return recorded if recorded is not SandboxState.CREATING else SandboxState.RUNNING
    return SandboxState(observed.value)
