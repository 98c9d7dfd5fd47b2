"""Captures: a working directory copied into a new snapshot's layer."""

from __future__ import annotations

import os

from ..._atomic import write_json
from . import flattening
from .freezing import _awake
from .records import _copy_tree, _creating, _size, _tree
from .stores import _in_hand, _upper_work


def capture(
    snapshot_id: str, sandbox_id: str, workdir: str, chain: list[str] | None, *, diff: bool
) -> int:
    """Capture ``workdir`` (sandbox ``sandbox_id``'s) as snapshot ``snapshot_id``;
    returns its size in bytes.

    ``chain``: the layers ``workdir`` is mounted on (a branch, or an adopted
    directory), or None (a plain directory). The chain file is written last: a
    capture cut short leaves a directory :func:`held` does not list and
    :func:`remove` frees.
    """
    with _awake(sandbox_id):
        return _capture(snapshot_id, sandbox_id, workdir, chain, diff=diff)


def _capture(
    snapshot_id: str, sandbox_id: str, workdir: str, chain: list[str] | None, *, diff: bool
) -> int:
    with _in_hand([], sandbox_id):  # its store (its upper directory) mounted
        pass
    with _creating(snapshot_id) as target:
        upper = _upper_work(sandbox_id)[0] if chain else None
        if (chain and not flattening.flattens(len(chain), asked=not diff)
                and upper and os.path.isdir(upper)):
            _copy_tree(upper, _tree(snapshot_id))
            layers = [snapshot_id, *chain]
        else:
            _copy_tree(workdir, _tree(snapshot_id))
            layers = [snapshot_id]
        size = _size(_tree(snapshot_id))
        write_json(os.path.join(target, "chain.json"), layers)
    return size
