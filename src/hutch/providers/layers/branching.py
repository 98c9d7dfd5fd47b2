"""Branches: a working directory started from a snapshot, copy-on-write."""

from __future__ import annotations

import os
import shutil

from ..._atomic import write_json
from ..._errors import ProviderError
from .._diskcap import mount_capped_workdir, unmount_capped
from .adoption import adopted
from .chain import _chain_of, chain_of
from .giveback import giving_back
from .overlay import _mount, overlay_available
from .records import _copy_tree, _listdir, _lock, _read_chain, _tree, mount_dir, root
from .stores import _in_hand, _make_upper


def start_branch(
    sandbox_id: str, snapshot_id: str, *, cap: int | None = None
) -> tuple[str, list[str] | None]:
    """A working directory for a new sandbox started from ``snapshot_id``:
    (its path, the chain it is mounted on, or None when it is a plain copy).
    ``cap``: a plain copy's size cap (a capped working directory of its own,
    as its sandbox would have had; a layered one is capped by ``prepare``)."""
    base = mount_dir(sandbox_id)
    merged = os.path.join(base, "merged")
    if overlay_available():
        with _lock:  # no give-back takes a layer away between the two
            chain = _chain_of(snapshot_id)
            os.makedirs(merged, exist_ok=True)
            # Recorded before the mount: the layers it stacks are in use from now.
            write_json(os.path.join(base, "chain.json"), chain)
        try:
            with _in_hand(chain) as lowers:
                # The overlay's root is the upper directory: the snapshot's root's
                # mode and owner.
                _make_upper(sandbox_id, lowers[0])
                _mount(merged, lowers, os.path.join(base, "upper"), os.path.join(base, "work"))
        except BaseException:
            shutil.rmtree(base, ignore_errors=True)
            raise
        return merged, chain
    # No overlayfs here: the merged view, copied (whiteouts applied by
    # copying bottom layer first, each upper one over it).
    chain = chain_of(snapshot_id)
    if len(chain) != 1:
        raise ProviderError(
            f"snapshot {snapshot_id} is layered and overlayfs cannot be mounted here"
        )
    os.makedirs(base, exist_ok=True)
    try:
        if cap is not None:
            try:
                mount_capped_workdir(merged, cap)
            except OSError as exc:
                raise ProviderError(f"cannot cap the working directory {merged} (a loop "
                                    f"mount, which needs root): {exc}") from None
        with _in_hand(chain, read_only=True):
            _copy_tree(_tree(chain[0]), merged, into=cap is not None)
    except BaseException:
        if cap is not None:
            unmount_capped(merged)
        shutil.rmtree(base, ignore_errors=True)
        raise
    return merged, None


def branches() -> list[str]:
    """The sandbox ids that have a branch working directory here."""
    return sorted(_listdir(os.path.join(root(), "mounts")))


def ensure_mounted(sandbox_id: str) -> None:
    """Mount a branch's (or an adopted directory's) working directory again if
    it is not (a host reboot, a crash in the middle of an adoption)."""
    base = mount_dir(sandbox_id)
    found = adopted(sandbox_id)
    if found and giving_back(sandbox_id):
        return  # being given back: the next end_adopted finishes it
    merged = found[0] if found else os.path.join(base, "merged")
    chain = _read_chain(os.path.join(base, "chain.json"))
    if chain is None or os.path.ismount(merged):
        return
    os.makedirs(merged, exist_ok=True)
    with _in_hand(chain) as lowers:
        _mount(merged, lowers, os.path.join(base, "upper"), os.path.join(base, "work"))
