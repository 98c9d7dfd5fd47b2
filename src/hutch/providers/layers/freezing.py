"""Layered working directories a container binds before they are mounted.

A branch mounted before its container starts is bound into the container
as it is: the container holds that overlay for good, and the layers under
it can never be changed. Here the container binds an *anchor* instead (the
``merged`` directory bind-mounted on itself and made shared, bound with
``rslave``), and the overlay is mounted on the anchor once the container
runs: the mount reaches the container by propagation, and so does its
unmount. A snapshot can then **freeze** the working directory: with the
container stopped, unmount the overlay (the kernel refuses while any
process holds it: a current directory or an open file in it), move the
upper directory, whole, into the snapshot's layer (one rename, whatever
the tree's size), and mount a fresh upper directory on the grown chain.
An empty chain (nothing captured yet) stacks on :func:`_empty_layer`.

A freeze is journalled (``freezing.json``) and :func:`_recover` finishes or
undoes one cut short; the sandbox's chain names the new layer before the
move, so no garbage collection frees it in between."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
from collections.abc import Iterator

from ..._atomic import write_json
from ..._errors import SandboxUnavailable
from .. import _mounts
from . import flattening
from .chain import chain_of
from .garbage import collect_garbage
from .giveback import end_branch
from .overlay import _anchor, _mount, _overlay_on_top, _stack, _umount
from .records import (
    _copy_tree,
    _creating,
    _lock,
    _read_chain,
    _resting,
    _size,
    _tree,
    mount_dir,
    sandbox_lock,
    snapshot_dir,
)
from .stores import _frozen_path, _in_hand, _make_upper, _upper_work

log = logging.getLogger(__name__)


def prepare(
    sandbox_id: str, snapshot_id: str | None, *, cap: int | None = None
) -> tuple[str, list[str]]:
    """A layered working directory for a new sandbox, started from
    ``snapshot_id`` or empty, capped at ``cap`` bytes or not: (the path its
    container binds, its chain). Its overlay is mounted by :func:`after_start`."""
    chain = chain_of(snapshot_id) if snapshot_id is not None else []
    base = mount_dir(sandbox_id)
    merged = os.path.join(base, "merged")
    os.makedirs(merged, exist_ok=True)
    try:
        if cap is not None:
            write_json(os.path.join(base, "cap.json"), cap)
        with _in_hand(chain[:1], sandbox_id):  # its store made; the top layer read
            _make_upper(sandbox_id, _tree(chain[0]) if chain else None)
            # Recorded before anything is mounted: the layers it stacks are in use from now.
            write_json(os.path.join(base, "chain.json"), chain)
        _anchor(merged)
    except BaseException:
        end_branch(sandbox_id)
        raise
    return merged, chain


def before_start(sandbox_id: str) -> None:
    """Ready a layered working directory for a container about to start: the
    anchor there, the overlay not (the container must bind the anchor)."""
    with sandbox_lock(sandbox_id):
        _before_start(sandbox_id)


def _before_start(sandbox_id: str) -> None:
    _recover(sandbox_id)
    with _in_hand([], sandbox_id):  # its store, for the overlay after_start mounts
        pass
    merged = os.path.join(mount_dir(sandbox_id), "merged")
    os.makedirs(merged, exist_ok=True)
    while _overlay_on_top(merged):
        _umount(merged)
    _anchor(merged)


def after_start(sandbox_id: str) -> None:
    """Mount a layered working directory's overlay (its container, started on
    the anchor, sees it by propagation); a freeze cut short is finished or
    undone first."""
    with sandbox_lock(sandbox_id):
        _recover(sandbox_id)
        base = mount_dir(sandbox_id)
        if _read_chain(os.path.join(base, "chain.json")) is None:
            raise SandboxUnavailable(f"the working directory of {sandbox_id} is gone from {base}")
        _remount(sandbox_id)


def mounted_chain(sandbox_id: str) -> list[str] | None:
    """The chain a sandbox's working directory stacks now, or None (none here)."""
    _recover(sandbox_id)
    return _read_chain(os.path.join(mount_dir(sandbox_id), "chain.json"))


def freeze(snapshot_id: str, sandbox_id: str, *, flatten: bool, holder: int | None) -> bool:
    """Capture a layered working directory as ``snapshot_id`` by moving what
    changed since its last capture into the snapshot's layer (the overlay's
    upper directory, by one rename), and going on over a fresh one: what
    this costs does not grow with the tree. False when it cannot (a process
    holds the directory: the caller copies instead). Its size:
    :func:`layer_size` (a stat a file: done apart, off the moment the
    caller stops the sandbox for).

    ``flatten`` (asked for, or the chain at its ceiling: :func:`.flattening.flattens`): the merged
    view is copied into a single layer, and the sandbox goes on over that one
    alone. The caller stops every process that may write in the directory
    first; ``holder`` is a process of the container whose mount namespace
    must follow the unmount.
    """
    base = mount_dir(sandbox_id)
    merged = os.path.join(base, "merged")
    with _awake(sandbox_id), sandbox_lock(sandbox_id), _lock:
        _recover_locked(sandbox_id)
        chain = _read_chain(os.path.join(base, "chain.json"))
        if chain is None or not _overlay_on_top(merged):
            return False
        flatten = flattening.flattens(len(chain), asked=flatten)
        with _creating(snapshot_id) as target:
            return _freeze(snapshot_id, sandbox_id, chain, target, flatten=flatten,
                           holder=holder)


def _freeze(snapshot_id: str, sandbox_id: str, chain: list[str], target: str, *,
            flatten: bool, holder: int | None) -> bool:
    """:func:`freeze` with its locks held and the snapshot's directory made."""
    base = mount_dir(sandbox_id)
    merged = os.path.join(base, "merged")
    upper, work = _upper_work(sandbox_id)
    new_chain = [snapshot_id] if flatten else [snapshot_id, *chain]
    if flatten:  # hutch's own copy: on the host's disk, not counted in a cap
        _copy_tree(merged, _tree(snapshot_id))
    try:
        _mounts.umount(merged)  # refused (EBUSY) while any process holds it
        moved = True
    except OSError:
        moved = False
    if moved and holder is not None and any(
        f"upperdir={upper}" in m.options for m in _mounts.mountinfo(holder)
    ):
        # The container holds the overlay itself (bound before the
        # anchor existed): moving its upper would move it under it.
        with _in_hand(chain, sandbox_id) as lowers:
            _mount(merged, lowers, upper, work)
        moved = False
    if not moved:
        if flatten:  # the copy stands as the snapshot; the sandbox goes on as it was
            write_json(os.path.join(target, "chain.json"), new_chain)
            return True
        shutil.rmtree(target, ignore_errors=True)
        return False
    try:
        write_json(os.path.join(base, "freezing.json"),
                    {"snapshot": snapshot_id, "chain": chain, "flatten": flatten})
        write_json(os.path.join(base, "chain.json"), new_chain)
        if flatten:
            os.rename(upper, os.path.join(os.path.dirname(upper), "discarded"))
        else:
            frozen = _frozen_path(sandbox_id, snapshot_id)
            os.makedirs(os.path.dirname(frozen), exist_ok=True)
            os.rename(upper, frozen)
        _finish_freeze(sandbox_id, snapshot_id)
        write_json(os.path.join(target, "chain.json"), new_chain)
    except BaseException:
        # Finished or undone as after a crash, and the sandbox's directory
        # mounted again either way: it must never be left on the anchor.
        _recover_locked(sandbox_id)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(target, "chain.json"))
        _remount(sandbox_id)
        raise
    _remount(sandbox_id)
    return True


def layer_size(snapshot_id: str) -> int:
    """The bytes in a snapshot's own layer."""
    with _in_hand([snapshot_id], read_only=True):
        return _size(_tree(snapshot_id))


def _remount(sandbox_id: str) -> None:
    base = mount_dir(sandbox_id)
    merged = os.path.join(base, "merged")
    chain = _read_chain(os.path.join(base, "chain.json"))
    if chain is not None and not _overlay_on_top(merged):
        with _in_hand(chain, sandbox_id) as lowers:
            _mount(merged, lowers, *_upper_work(sandbox_id))
            # Its stores are stacked again, by the records from now on.
            with contextlib.suppress(FileNotFoundError):
                os.unlink(_resting(sandbox_id))


def rest(sandbox_id: str) -> None:
    """Put a layered working directory whose container is gone (a suspended
    sandbox's) at rest: its overlay unmounted and the directory marked, so
    that the stores it stacks, its own among them, are unmounted unless
    something else stacks them (:func:`collect_garbage`): a suspended
    sandbox holds no mounted store. Its files stay in its layers and upper
    directory; :func:`after_start` (the resume) mounts it all again, and a
    capture of it in the meantime wakes it for the capture. A plain
    unmount: a host process in the directory keeps it mounted as it is."""
    with sandbox_lock(sandbox_id):
        if mounted_chain(sandbox_id) is None or not _rest_locked(sandbox_id):
            return
    try:
        collect_garbage()
    except OSError as exc:  # a saving, not the suspend's: the next collection frees them
        log.warning("sandbox %s at rest, its stores not yet unmounted: %s", sandbox_id, exc)


def let_go(sandbox_id: str) -> None:
    """A layered working directory no container will run on again (its
    preserved container was removed): at rest (:func:`rest`) and its anchor
    unmounted too, so that no mount nor store of it is left; its files stay
    in its upper directory and layers, for :func:`end_branch` to free."""
    rest(sandbox_id)
    merged = os.path.join(mount_dir(sandbox_id), "merged")
    with sandbox_lock(sandbox_id):
        for _ in range(8):
            if not _stack(merged) or _overlay_on_top(merged):
                break  # nothing left; or mounted again meanwhile, in use
            _umount(merged)


def _rest_locked(sandbox_id: str) -> bool:
    """Whether the directory is at rest now. Resting saves memory; it is
    never worth failing a suspend over: where the marker cannot be written
    (a full disk) or the overlay cannot be unmounted (a process in it), the
    directory stays mounted as it was, unmarked."""
    merged = os.path.join(mount_dir(sandbox_id), "merged")
    try:
        # Marked before the unmount: never an overlay unmounted that no
        # marker says is at rest (its stores would be kept mounted for good).
        write_json(_resting(sandbox_id), True)
    except OSError as exc:
        log.warning("sandbox %s stays mounted while suspended: %s", sandbox_id, exc)
        return False
    while _overlay_on_top(merged):
        try:
            _mounts.umount(merged)
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(_resting(sandbox_id))
            return False
    return True


@contextlib.contextmanager
def _awake(sandbox_id: str) -> Iterator[None]:
    """A working directory at rest mounted for the block (a capture of a
    suspended sandbox reads it), and at rest again after it."""
    with sandbox_lock(sandbox_id):
        resting = os.path.exists(_resting(sandbox_id))
        if resting:
            _recover(sandbox_id)
            _remount(sandbox_id)
        try:
            yield
        finally:
            if resting:
                _rest_locked(sandbox_id)
    if resting:
        collect_garbage()


def _finish_freeze(sandbox_id: str, snapshot_id: str) -> None:
    """The rest of a freeze whose move is done (the sandbox's chain already
    names the new layer: it is written before the move): the snapshot's
    layer linked to a store's, a fresh upper directory, the journal gone,
    what a flatten discarded freed."""
    base = mount_dir(sandbox_id)
    frozen = _frozen_path(sandbox_id, snapshot_id)
    if frozen != _tree(snapshot_id) and not os.path.lexists(_tree(snapshot_id)):
        os.makedirs(snapshot_dir(snapshot_id), exist_ok=True)
        os.symlink(frozen, _tree(snapshot_id))
    _make_upper(sandbox_id, _tree(snapshot_id))
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(base, "freezing.json"))
    upper, _ = _upper_work(sandbox_id)
    shutil.rmtree(os.path.join(os.path.dirname(upper), "discarded"), ignore_errors=True)


def _recover(sandbox_id: str) -> None:
    with sandbox_lock(sandbox_id), _lock:
        _recover_locked(sandbox_id)


def _recover_locked(sandbox_id: str) -> None:
    """Finish or undo a freeze cut short (a crash): finished once its move
    was made (the upper directory in the new layer, or a flatten's set
    aside), undone before. A snapshot finished here is not listed (its chain
    file is not written: no record names it); its layer stays while the
    sandbox stacks it."""
    base = mount_dir(sandbox_id)
    journal = os.path.join(base, "freezing.json")
    upper, _ = _upper_work(sandbox_id)
    discarded = os.path.join(os.path.dirname(upper), "discarded")
    try:
        with open(journal) as fh:
            state = json.load(fh)
    except (OSError, ValueError):
        shutil.rmtree(discarded, ignore_errors=True)
        return
    with _in_hand([], sandbox_id):  # its store: where the move is seen or not
        pass
    snapshot_id, chain = str(state["snapshot"]), [str(s) for s in state["chain"]]
    if state.get("flatten"):
        moved = os.path.exists(discarded) or not os.path.isdir(upper)
    else:
        moved = os.path.isdir(_frozen_path(sandbox_id, snapshot_id))
    if moved:
        _finish_freeze(sandbox_id, snapshot_id)
        return
    write_json(os.path.join(base, "chain.json"), chain)
    shutil.rmtree(snapshot_dir(snapshot_id), ignore_errors=True)
    os.unlink(journal)
