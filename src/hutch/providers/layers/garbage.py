"""Garbage collection of removed snapshots' layers and of stores."""

from __future__ import annotations

import os
import shutil

from .records import _being_created, _listdir, _lock, _read_chain, _resting, _tree, root
from .stores import _free_stores, _mount_store, _sandbox_of, _store_of, _stores_lock


def collect_garbage() -> None:
    """Free every removed snapshot's layer that no chain still stacks, and
    every store no layer still held is in; unmount the stores no mounted
    working directory stacks (idle: mounted again on demand)."""
    if not os.path.isdir(root()):
        return
    with _lock, _stores_lock():
        in_use: set[str] = set()
        stacked: set[str] = set()
        removed: list[str] = []
        snapshots = os.path.join(root(), "snapshots")
        mounts = os.path.join(root(), "mounts")
        for name in _listdir(snapshots):
            chain = _read_chain(os.path.join(snapshots, name, "chain.json"))
            if chain is not None:
                in_use.update(chain)
            elif not _being_created(os.path.join(snapshots, name)):
                removed.append(name)
        for name in _listdir(mounts):
            chain = _read_chain(os.path.join(mounts, name, "chain.json")) or []
            in_use.update(chain)
            if not os.path.exists(_resting(name)):
                stacked.update(chain)
        kept = {_store_of(layer) for layer in in_use}
        for name in removed:
            if name not in in_use:
                store = _store_of(name)
                if store is not None and (store in kept or _sandbox_of(store) is not None):
                    # Its layer is in a store that stays: deleted there (a
                    # store that goes takes its layers with it).
                    _mount_store(store)
                    shutil.rmtree(os.readlink(_tree(name)), ignore_errors=True)
                shutil.rmtree(os.path.join(snapshots, name), ignore_errors=True)
        _free_stores(kept, stacked)
