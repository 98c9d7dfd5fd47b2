"""Capped stores: a layered working directory's own loop-mounted file system.

A size-capped one keeps its upper directory in a **store** of its own
(``stores/<sandbox id>``: a loop-mounted file system of the cap's size,
nosuid and nodev, see ``_diskcap``), and a freeze moves the upper
directory within it (``frozen/<snapshot id>``, which the snapshot's
``tree`` links to): what the sandbox wrote counts against its cap, frozen
or not, and the store lives on after the sandbox while a snapshot or a
branch still stacks a layer in it (:func:`collect_garbage` frees it).
A mounted store costs about 4 MB of host memory and a kernel thread
(jbd2), so one that no working directory here stacks (its sandbox ended,
or suspended: :func:`rest`) is unmounted, its image kept, and mounted
again on demand by whatever reads it (:func:`_in_hand`): an overlay
mounted on it, a size, a copy, a removal. Programs sharing a home do
this concurrently; :func:`_stores_lock` keeps one's unmount out of the
window between another's mount of a store and the overlay over it."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Iterator

from ..._errors import ProviderError
from .. import _mounts
from .._diskcap import IMAGE_SUFFIX, image_for, mount_capped, unmount_capped
from .records import _flock, _listdir, _resting, _tree, mount_dir, root


def _sandbox_of(store: str) -> str | None:
    """The sandbox whose working directory has ``store`` as its own, if it is still here."""
    name = os.path.basename(store)
    return name if os.path.exists(mount_dir(name)) else None


def _overlay_stores() -> set[str]:
    """The stores an overlay mounted here stacks (its upper directory in
    one, or a lower layer): read from the mounts themselves, beside the
    records."""
    stores = os.path.join(root(), "stores") + os.sep
    snapshots = os.path.join(root(), "snapshots") + os.sep
    found: set[str] = set()
    for mount in _mounts.mountinfo():
        if mount.fstype != "overlay":
            continue
        for option in mount.options:
            key, _, value = option.partition("=")
            if key.rstrip("+") not in ("lowerdir", "upperdir", "workdir"):
                continue
            for path in value.split(":"):
                if path.startswith(stores):
                    found.add(stores + path[len(stores):].split(os.sep)[0])
                elif path.startswith(snapshots):
                    store = _store_of(path[len(snapshots):].split(os.sep)[0])
                    if store is not None:
                        found.add(store)
    return found


def _empty_layer() -> str:
    path = os.path.join(root(), "empty")
    os.makedirs(path, mode=0o755, exist_ok=True)
    return path


def store_dir(sandbox_id: str) -> str:
    return os.path.join(root(), "stores", sandbox_id)


def _cap(sandbox_id: str) -> int | None:
    """The size cap of a layered working directory (its store's), or None."""
    try:
        with open(os.path.join(mount_dir(sandbox_id), "cap.json")) as fh:
            return int(json.load(fh))
    except (OSError, ValueError, TypeError):
        return None


def _mount_store(store: str, size: int | None = None) -> None:
    """Mount a store (again after a reboot: its image keeps the files); a new
    one is made at ``size``."""
    image = image_for(store)
    if size is None and not os.path.exists(image):
        return
    try:
        mount_capped(store, size if size is not None else os.path.getsize(image))
    except OSError as exc:
        raise ProviderError(f"cannot mount the capped working directory store {store} "
                            f"(a loop mount, which needs root): {exc}") from None


def _upper_work(sandbox_id: str) -> tuple[str, str]:
    """Where a layered working directory's upper and work directories are."""
    home = store_dir(sandbox_id) if _cap(sandbox_id) is not None else mount_dir(sandbox_id)
    return os.path.join(home, "upper"), os.path.join(home, "work")


def upper_dir(sandbox_id: str) -> str:
    """Where a layered working directory keeps what its sandbox wrote (its
    overlay's upper directory; in its store, mounted while it runs, if capped)."""
    return _upper_work(sandbox_id)[0]


def _frozen_path(sandbox_id: str, snapshot_id: str) -> str:
    """Where a freeze moves the upper directory: the snapshot's layer, or in
    a capped one's store (same file system: a rename)."""
    if _cap(sandbox_id) is not None:
        return os.path.join(store_dir(sandbox_id), "frozen", snapshot_id)
    return _tree(snapshot_id)


def _store_of(layer: str) -> str | None:
    """The store a layer is in (its ``tree`` links there), or None (a plain
    directory). Read from the link: the store need not be mounted."""
    try:
        return os.path.dirname(os.path.dirname(os.readlink(_tree(layer))))
    except OSError:
        return None


def _stores_lock() -> contextlib.AbstractContextManager[None]:
    """Held by whatever mounts a store on demand, from the mount until the
    overlay that stacks it is mounted (or its read of the store is done),
    and by the collector that unmounts idle stores: so no process unmounts a
    store another has just mounted to use. Taken after :func:`sandbox_lock`,
    ``_lock`` and a snapshot's :func:`_creating`, never before them (the
    collector only tries the last, without waiting); nothing that collects
    garbage or waits on another lock runs while it is held."""
    return _flock(os.path.join(root(), "stores.lock"))


@contextlib.contextmanager
def _in_hand(
    chain: list[str], sandbox_id: str | None = None, *, read_only: bool = False
) -> Iterator[list[str]]:
    """``chain``'s lower directories (top first) with every store they are
    in mounted (an idle one is not: mounted on demand here), and
    ``sandbox_id``'s own store too if it is capped; the stores stay mounted
    while the block runs (:func:`_stores_lock`). Mount the overlay that
    stacks them, or read them, inside it: once the overlay is mounted, the
    records of the sandbox that stacks them keep them (:func:`_free_stores`).
    ``read_only``: a read of the layers, no overlay mounted on them; the
    stores it mounted are unmounted again when it is done (none other used
    them: a store is only used mounted, and it was not)."""
    stores = list(dict.fromkeys(s for s in map(_store_of, chain) if s is not None))
    cap = _cap(sandbox_id) if sandbox_id is not None else None
    if not stores and cap is None:  # plain directories only: nothing to mount or hold
        yield [_tree(s) for s in chain] or [_empty_layer()]
        return
    os.makedirs(root(), exist_ok=True)
    with _stores_lock():
        if sandbox_id is not None and cap is not None:
            _mount_store(store_dir(sandbox_id), cap)
        idle = [s for s in stores if not os.path.ismount(s)]
        for store in stores:
            _mount_store(store)
        try:
            yield [_tree(s) for s in chain] or [_empty_layer()]
        finally:
            for store in idle if read_only else []:
                with contextlib.suppress(OSError):
                    _mounts.umount(store)


def _make_upper(sandbox_id: str, like: str | None) -> None:
    """A fresh, empty upper directory (and work directory) for a layered
    working directory; its root takes ``like``'s mode and owner (the
    overlay's root is the upper directory's)."""
    upper, work = _upper_work(sandbox_id)
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    os.makedirs(upper, exist_ok=True)
    if like is not None:
        st = os.stat(like)
        os.chmod(upper, st.st_mode & 0o7777)
        os.chown(upper, st.st_uid, st.st_gid)


def _free_stores(kept: set[str | None], stacked: set[str]) -> None:
    """Each store of an ended sandbox that holds no layer still stacked or
    held (not in ``kept``) is unmounted and deleted, its image with it. Each
    other one that no working directory here stacks (``stacked``: the
    layers of their chains, recorded before they are mounted), and no
    overlay mounted here either, is unmounted, its image kept (a sandbox's
    own store too, while its directory is at rest): a store costs
    host memory and a kernel thread while it is mounted, and one a snapshot
    alone holds is mounted again when something reads it (:func:`_in_hand`).
    Called with the lock and :func:`_stores_lock` held.

    A plain unmount only, never a lazy one: the kernel refuses it while a
    process is in the store (left mounted, for a later collection).
    The records decide, not the kernel's refusal: an overlay holds a clone
    of its layers' mount, and does not make the store's own busy."""
    stores = os.path.join(root(), "stores")
    busy: set[str | None] = {_store_of(layer) for layer in stacked}
    busy.update(_overlay_stores())
    for name in _listdir(stores):
        store = os.path.join(stores, name)
        if name.endswith(IMAGE_SUFFIX):
            continue  # an image, beside its store
        owner = _sandbox_of(store)
        if owner is not None and not os.path.exists(_resting(owner)):
            continue  # a sandbox's working directory, mounted or about to be
        if owner is not None or store in kept:
            if store not in busy and os.path.ismount(store):
                with contextlib.suppress(OSError):
                    _mounts.umount(store)  # idle
            continue
        with contextlib.suppress(OSError):
            unmount_capped(store)
        if not os.path.ismount(store):
            shutil.rmtree(store, ignore_errors=True)
