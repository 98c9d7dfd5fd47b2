"""Snapshots and forks, provider-neutral: what ``Sandbox.snapshot`` and
``Sandbox.fork`` return, in-process and through the daemon alike.

A :class:`Snapshot` is hutch's record of one captured state: its id, label,
the sandbox it came from, its parent in the lineage tree (the snapshot that
sandbox was started from or last captured), its size and time, plus the
provider's own handle (:class:`~hutch.providers.base.ProviderSnapshot`) and
the settings of the sandbox it came from, which an attach starts from. The
record is plain data in the leaf :mod:`hutch._types` (the client reads it
too); it is named here as well. Nothing here knows a provider: the capture
and the attach are the provider seam's (``SandboxBackend.capture`` /
``create_from_snapshot``).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

from ._types import ProviderSnapshot, Snapshot

if TYPE_CHECKING:
    from ._sandbox import Sandbox


def new_snapshot_id() -> str:
    return "snap-" + uuid.uuid4().hex[:12]


def snapshot_record(
    handle: ProviderSnapshot,
    *,
    label: str | None,
    sandbox_id: str | None,
    parent_id: str | None,
    spec: Mapping[str, Any],
) -> Snapshot:
    return Snapshot(
        id=handle.snapshot_id, label=label, sandbox_id=sandbox_id, parent_id=parent_id,
        size_bytes=handle.size_bytes, created_at_unix=time.time(), provider=handle.provider,
        handle=handle, spec=dict(spec),
    )


class SandboxFactory(Protocol):
    """What starts a fork's branches and frees its snapshot: handed to a
    :class:`Fork` by whoever made the sandbox it forks (``hutch._api``
    in-process), so that forks need not know how sandboxes are made."""

    async def from_snapshot(
        self, snapshot: Snapshot, options: Mapping[str, Any] | None
    ) -> Sandbox:
        """A new sandbox started from ``snapshot``, with ``options`` (sandbox
        options) replacing its origin's."""

    async def remove_snapshot(self, snapshot: Snapshot) -> None:
        """Free the snapshot's storage. Idempotent."""


class Fork:
    """A snapshot and the means to start branches from it.

    Each :meth:`attach` gives a new, independent sandbox started from the
    snapshot: writes in one branch are seen by no other branch, nor by the
    sandbox the snapshot came from.
    """

    def __init__(self, snapshot: Snapshot, factory: SandboxFactory) -> None:
        self.snapshot = snapshot
        self._factory = factory
        self.branches: list[Sandbox] = []

    async def attach(self, **options: Any) -> Sandbox:
        """A new sandbox from the snapshot; ``options`` are sandbox options
        (``idle_timeout``, ``max_lifetime``...) that replace the origin's."""
        sandbox = await self._factory.from_snapshot(self.snapshot, options or None)
        self.branches.append(sandbox)
        return sandbox

    async def close(self) -> None:
        """End every branch this handle started, then remove its snapshot and
        free its storage. Idempotent."""
        while self.branches:
            await self.branches.pop().close()
        await self._factory.remove_snapshot(self.snapshot)

    def __repr__(self) -> str:
        return f"<Fork of {self.snapshot.id} ({len(self.branches)} branches)>"
