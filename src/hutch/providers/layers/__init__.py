"""Working directories as stacked layers: how ``local`` and ``docker`` capture
a host directory and start branches from it, copy-on-write.

Measured here (bench/bench_fork.py prints it; 10 000 files of 100 bytes, a
loaded 2-core machine): ``cp -a`` of the tree 4-11 s, hard links (``cp -al``)
0.6-1.6 s, an overlayfs mount 11 ms whatever the tree's size. Hard links are
also wrong for branches: a program that writes a file in place (most
editors, ``>>``) changes the inode every branch shares. So a branch's working
directory is an **overlayfs** mount: the snapshot's layers read-only below,
an empty upper directory of its own above. Where overlayfs cannot be mounted
(no privilege), an attach falls back to a full copy (``cp -a``), correct and
slower.

A plain directory's first capture (``local``) is an **adoption**, picked by
the same figures: the directory is moved, by one rename, into the snapshot's
layer and an overlay of it is mounted in its place, so the sandbox goes on at
the same path (90-350 ms for 10 000 files, most of it counting the
snapshot's size, one stat a file; ``cp -a`` 1-11 s and ``cp -al`` 0.2-1.6 s
in the same runs: 0.03-0.08x of the copy). When the sandbox ends, a
directory the caller gave is given back plain: the layer taken back by a
rename and what changed (the upper directory) moved onto it, whether or
not a snapshot still holds the layer (one that does keeps it as an archive,
unpacked when it is next attached); only a branch running on the layer
makes it a copy (see :func:`end_adopted`). A directory
a process on the host is in (its current or root directory), on another
file system, or without overlayfs is copied instead: moving it would leave
that process writing into the snapshot. ``docker`` never adopts: a plain
directory is bind-mounted into a running container, which would keep the
moved one. Its own working directory is layered from creation instead
(:func:`prepare`), and a capture **freezes** it (:func:`freeze`): the upper
directory moved into the snapshot's layer, a fresh one mounted above.

Layout under ``$HUTCH_HOME/layers``::

    snapshots/<snapshot id>/tree/        that snapshot's own layer
    snapshots/<snapshot id>/tree.tar     or that layer archived (its files
                                         given back to an adopted directory)
    snapshots/<snapshot id>/chain.json   the layers it stacks, top first
                                         (absent: removed, kept for its users)
    mounts/<sandbox id>/{upper,work,merged,chain.json}
                                         a branch's working directory
    mounts/<sandbox id>/merged{.img,.fs} a capped copy's image and file
                                         system (no overlayfs here: merged
                                         is a capped working directory)
    mounts/<sandbox id>/adopted.json     an adopted directory: where its
                                         overlay is mounted (no ``merged``)
    mounts/<sandbox id>/giving-back.json its give-back under way (the journal)
    mounts/<sandbox id>/freezing.json    a freeze under way (its journal)
    mounts/<sandbox id>/resting          at rest: its overlay unmounted, no
                                         container on it (a suspended sandbox)
    stores/<sandbox id>{,.img}           a capped one's store, and its image
    stores.lock                          held to mount or unmount stores
    empty/                               the layer under a chain of none

A capture of a branch (or an adopted directory) copies its upper directory
(what changed since it was started, overlayfs whiteouts included) into a new
layer on its chain; a capture of a plain directory that cannot be adopted,
or ``diff=False``, or a chain past :data:`MAX_LAYERS`, copies the merged view
into a single layer (:func:`flattens`: the one flattening rule, every layer
system's). A snapshot's
own layer stays on disk, after its removal, while any other snapshot's chain
or any mounted branch still stacks it: :func:`collect_garbage` frees it when
nothing does.


The package, by responsibility: :mod:`.records` (paths, chain files, locks),
:mod:`.overlay` (mounting, whiteouts), :mod:`.stores` (capped stores),
:mod:`.archive`, :mod:`.chain`, :mod:`.garbage`, :mod:`.captures`,
:mod:`.adoption`, :mod:`.giveback`, :mod:`.branching`, :mod:`.freezing`,
and :mod:`.flattening` (when a chain is flattened).
"""

from __future__ import annotations

from .adoption import adopt, adopted
from .branching import branches, ensure_mounted, start_branch
from .captures import capture
from .chain import chain_of, held, remove
from .flattening import MAX_LAYERS, NO_CEILING, flattens
from .freezing import (
    after_start,
    before_start,
    freeze,
    layer_size,
    let_go,
    mounted_chain,
    prepare,
    rest,
)
from .garbage import collect_garbage
from .giveback import end_adopted, end_branch, giving_back
from .overlay import overlay_available
from .records import mount_dir, root, sandbox_lock, snapshot_dir
from .stores import store_dir, upper_dir

__all__ = [
    "MAX_LAYERS",
    "NO_CEILING",
    "adopt",
    "adopted",
    "after_start",
    "before_start",
    "branches",
    "capture",
    "chain_of",
    "collect_garbage",
    "end_adopted",
    "end_branch",
    "ensure_mounted",
    "flattens",
    "freeze",
    "giving_back",
    "held",
    "layer_size",
    "let_go",
    "mount_dir",
    "mounted_chain",
    "overlay_available",
    "prepare",
    "remove",
    "rest",
    "root",
    "sandbox_lock",
    "snapshot_dir",
    "start_branch",
    "store_dir",
    "upper_dir",
]
