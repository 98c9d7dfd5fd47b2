"""How a sandbox found again is read from its runtime (SPEC §2): the
states and their transitions are :mod:`hutch.states`'s."""

from __future__ import annotations

from ..providers.base import RuntimeState
from ..states import SandboxState


def found_state(recorded: SandboxState, observed: RuntimeState) -> SandboxState | None:
    """The state a sandbox found again is in: its runtime's own, where the
    provider can tell it; the record's where it cannot tell running from
    paused (or up from suspended). None: nothing of it is left."""
    if observed is RuntimeState.GONE:
        return None
    if observed is RuntimeState.LIVE:
        return recorded if recorded is not SandboxState.CREATING else SandboxState.RUNNING
    return SandboxState(observed.value)
