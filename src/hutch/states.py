"""Every state hutch keeps, with the transitions allowed between them (SPEC §2).

One place for the sandbox states (the lifecycle engine checks each
transition against :data:`ALLOWED`), the ones that end a sandbox
(:data:`FINAL`), the ones that hold it without running it (:data:`HELD`),
and the statuses of workspaces and snapshots as the store records them.
A leaf: it imports nothing of hutch but the errors, so the client, the
store and the server read it without loading the lifecycle.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from ._errors import InvalidState


class SandboxState(enum.StrEnum):
    CREATING = "creating"
    RUNNING = "running"
    PAUSED = "paused"
    SUSPENDED = "suspended"
    TERMINATED = "terminated"
    FAILED = "failed"


S = SandboxState
#: The sandbox transitions the lifecycle engine allows, and no other.
ALLOWED: dict[SandboxState, frozenset[SandboxState]] = {
    S.CREATING: frozenset({S.RUNNING, S.TERMINATED, S.FAILED}),
    S.RUNNING: frozenset({S.PAUSED, S.SUSPENDED, S.TERMINATED, S.FAILED}),
    S.PAUSED: frozenset({S.RUNNING, S.TERMINATED, S.FAILED}),
    S.SUSPENDED: frozenset({S.RUNNING, S.TERMINATED, S.FAILED}),
    S.TERMINATED: frozenset(),
    S.FAILED: frozenset(),
}

#: The states a sandbox ends in: nothing leaves them.
FINAL = frozenset({S.TERMINATED, S.FAILED})
#: The same, as the strings the store records.
FINAL_VALUES: tuple[str, ...] = tuple(sorted(s.value for s in FINAL))
#: The states that hold a sandbox without running it: a resume brings it back.
HELD = frozenset({S.PAUSED, S.SUSPENDED})


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


class WorkspaceStatus(enum.StrEnum):
    """A workspace's status in the store. The ``-ing`` ones are written
    before their step begins, so a daemon killed during it finishes or undoes
    the step when it starts again."""

    CREATING = "creating"
    RUNNING = "running"
    SUSPENDING = "suspending"
    SUSPENDED = "suspended"
    RESUMING = "resuming"
    #: Its sandbox is gone and no suspend finished: it resumes from its last state.
    STALE = "stale"
    DELETING = "deleting"


W = WorkspaceStatus
#: The workspace transitions the daemon makes (a create cut short drops the
#: row; a delete, once finished, too).
WORKSPACE_TRANSITIONS: dict[WorkspaceStatus, frozenset[WorkspaceStatus]] = {
    W.CREATING: frozenset({W.RUNNING, W.DELETING}),
    W.RUNNING: frozenset({W.SUSPENDING, W.STALE, W.DELETING}),
    W.SUSPENDING: frozenset({W.SUSPENDED, W.RUNNING, W.STALE, W.DELETING}),
    W.SUSPENDED: frozenset({W.RESUMING, W.DELETING}),
    W.RESUMING: frozenset({W.RUNNING, W.STALE, W.DELETING}),
    W.STALE: frozenset({W.RESUMING, W.DELETING}),
    W.DELETING: frozenset(),
}
#: The workspace statuses a resume starts from.
RESUMABLE = frozenset({W.SUSPENDED, W.STALE})


class SnapshotStatus(enum.StrEnum):
    """A snapshot's status in the store: ``capturing`` from the moment the
    capture is intended until the provider has finished it (one still
    capturing after a restart was cut short: its storage is freed and the
    row dropped), then ``ready``; ``removing`` once its removal began."""

    CAPTURING = "capturing"
    READY = "ready"
    REMOVING = "removing"


#: The snapshot transitions (a capture cut short, and a removal finished, drop the row).
SNAPSHOT_TRANSITIONS: dict[SnapshotStatus, frozenset[SnapshotStatus]] = {
    SnapshotStatus.CAPTURING: frozenset({SnapshotStatus.READY, SnapshotStatus.REMOVING}),
    SnapshotStatus.READY: frozenset({SnapshotStatus.REMOVING}),
    SnapshotStatus.REMOVING: frozenset(),
}
