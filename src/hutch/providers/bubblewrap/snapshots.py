"""Snapshots of bubblewrap sandboxes: captured upper layers, stacked.

A snapshot is the sandbox's upper layer copied (while the freezer holds its
processes still) into ``snapshots/<id>/layer-0``, plus the list of layers it
stands on: the lower layers of the sandbox it came from (the root file
system, and the layers of the snapshot that sandbox was started from, if
any). A sandbox started from a snapshot mounts that list as its lower layers
under a fresh, empty upper layer: nothing is copied (copy-on-write), so
starting one costs the same whatever the snapshot holds.

``diff=False`` copies the snapshot layers below too, so that the new snapshot
depends on no other (only on the root file system, which images own): this
system's flatten, by the one rule (:func:`hutch.providers.layers.flattens`),
with no ceiling by depth (the overlay's options are checked when mounted).
It keeps each layer apart: the chain stands alone, as deep as before.

A removed snapshot whose layers another snapshot or a live sandbox still
stands on is only marked removed; its layers go when nothing names them.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from typing import Any

from ..._atomic import write_json
from ..._errors import InvalidArgument, NotFound
from ..._faults import fault_point
from ..layers import NO_CEILING, flattens
from . import freezes
from .cgroups import SandboxCgroup
from .provisioning import Layers, bubblewrap_home, copy_tree

_META = "meta.json"


def snapshots_dir() -> str:
    return os.path.join(bubblewrap_home(), "snapshots")


def _sandboxes_dir() -> str:
    return os.path.join(bubblewrap_home(), "sandboxes")


def snapshot_path(snapshot_id: str) -> str:
    if not snapshot_id or "/" in snapshot_id or snapshot_id.startswith("."):
        raise InvalidArgument(f"snapshot id {snapshot_id!r} cannot name a directory")
    return os.path.join(snapshots_dir(), snapshot_id)


def disk_usage(paths: list[str]) -> int:
    """Bytes the files under ``paths`` take on disk (their blocks, not their sizes)."""
    total = 0
    for top in paths:
        for dirpath, _dirs, files in os.walk(top):
            for name in files:
                with contextlib.suppress(OSError):
                    total += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
    return total


def capture(layers: Layers, cgroup: SandboxCgroup, snapshot_id: str, *, diff: bool,
            running: bool) -> dict[str, Any]:
    """Copy ``layers``' upper layer into snapshot ``snapshot_id``; the data a
    sandbox is started from (``layers``: top first) and the bytes it costs."""
    final = snapshot_path(snapshot_id)
    if os.path.exists(final):
        raise InvalidArgument(f"snapshot {snapshot_id} already exists")
    partial = final + ".partial"
    shutil.rmtree(partial, ignore_errors=True)
    os.makedirs(partial)
    try:
        # Processes held still while their files are copied; a sandbox the
        # caller paused stays paused.
        with (freezes.held(cgroup, layers.sandbox_dir) if running
              else contextlib.nullcontext()):
            fault_point("snapshot.bubblewrap.frozen")
            copy_tree(layers.upper, os.path.join(partial, "layer-0"))
        own = [os.path.join(final, "layer-0")]
        stack = [own[0]]
        below = layers.lowers
        if not flattens(len(below), asked=not diff, limit=NO_CEILING):
            stack.extend(below)
        else:
            for index, lower in enumerate(below[:-1], 1):
                copy_tree(lower, os.path.join(partial, f"layer-{index}"))
                own.append(os.path.join(final, f"layer-{index}"))
                stack.append(own[-1])
            stack.append(below[-1])
        meta = {"layers": stack, "own": own, "removed": False}
        with open(os.path.join(partial, _META), "w") as fh:
            json.dump(meta, fh)
        os.rename(partial, final)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return {"layers": stack, "size_bytes": disk_usage(own)}


def layers_of(snapshot_id: str, data: dict[str, Any]) -> list[str]:
    """The lower layers a sandbox started from the snapshot mounts."""
    stack = [str(p) for p in data.get("layers") or []]
    if not stack or not all(os.path.isdir(p) for p in stack):
        raise NotFound(f"snapshot {snapshot_id} is gone from this host")
    meta = _read_meta(snapshot_path(snapshot_id))
    if meta is not None and meta.get("removed"):
        raise NotFound(f"snapshot {snapshot_id} was removed")
    return stack


def _read_meta(directory: str) -> dict[str, Any] | None:
    try:
        with open(os.path.join(directory, _META)) as fh:
            meta = json.load(fh)
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) else None


def held() -> list[str]:
    """Snapshot ids with storage here, not marked removed."""
    try:
        names = os.listdir(snapshots_dir())
    except FileNotFoundError:
        return []
    out = []
    for name in names:
        meta = _read_meta(os.path.join(snapshots_dir(), name))
        if meta is not None and not meta.get("removed"):
            out.append(name)
    return sorted(out)


def remove(snapshot_id: str) -> None:
    """Mark the snapshot removed, and free every removed snapshot's layers
    that nothing stands on any more. Idempotent."""
    directory = snapshot_path(snapshot_id)
    meta = _read_meta(directory)
    if meta is not None and not meta.get("removed"):
        meta["removed"] = True
        write_json(os.path.join(directory, _META), meta, durable=False)
    collect_garbage()


def collect_garbage() -> None:
    """Delete removed snapshots whose layers no snapshot and no sandbox uses."""
    try:
        names = os.listdir(snapshots_dir())
    except FileNotFoundError:
        return
    metas = {n: _read_meta(os.path.join(snapshots_dir(), n)) for n in names}
    in_use: set[str] = set()
    for meta in metas.values():
        if meta is not None and not meta.get("removed"):
            in_use.update(str(p) for p in meta.get("layers") or [])
    with contextlib.suppress(FileNotFoundError):
        for sandbox in os.listdir(_sandboxes_dir()):
            try:
                with open(os.path.join(_sandboxes_dir(), sandbox, "lowers.json")) as fh:
                    in_use.update(str(p) for p in json.load(fh))
            except (OSError, ValueError):
                continue
    for name, meta in metas.items():
        if name.endswith(".partial") or meta is None or not meta.get("removed"):
            continue
        if not in_use.intersection(str(p) for p in meta.get("own") or []):
            shutil.rmtree(os.path.join(snapshots_dir(), name), ignore_errors=True)
