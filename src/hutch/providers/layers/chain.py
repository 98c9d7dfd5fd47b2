"""Snapshots as chains of layers: their chain, the ones held, removal."""

from __future__ import annotations

import contextlib
import os

from ..._errors import SandboxUnavailable
from .archive import _materialize
from .garbage import collect_garbage
from .records import _lock, _read_chain, root, snapshot_dir


def chain_of(snapshot_id: str) -> list[str]:
    """The layers snapshot ``snapshot_id`` stacks, top first, each ready to
    stack (an archived one unpacked)."""
    with _lock:
        return _chain_of(snapshot_id)


def _chain_of(snapshot_id: str) -> list[str]:
    chain = _read_chain(os.path.join(snapshot_dir(snapshot_id), "chain.json"))
    if chain is None:
        raise SandboxUnavailable(f"snapshot {snapshot_id} is not held under {root()}")
    for layer in chain:
        _materialize(layer)
    return chain


def held() -> list[str]:
    """The snapshots with storage here (a chain file: captured and not removed)."""
    base = os.path.join(root(), "snapshots")
    try:
        names = os.listdir(base)
    except FileNotFoundError:
        return []
    return sorted(n for n in names if os.path.exists(os.path.join(base, n, "chain.json")))


def remove(snapshot_id: str) -> None:
    """Remove a snapshot: its chain file at once, its layer once nothing stacks it."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(snapshot_dir(snapshot_id), "chain.json"))
    collect_garbage()
