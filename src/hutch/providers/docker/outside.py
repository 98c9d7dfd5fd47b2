"""What a docker sandbox's working directory holds once its container is
gone outside hutch's hands (removed, killed): the host mounts it stood on
are let go and its files are kept, until the sandbox is deleted (SPEC §3).

While the sandbox is on record, failed, its working directory stays
mounted as it was, readable on the host where it always was. A preserved
container (kept after its sandbox was deleted, on purpose) that is removed
later lets go of its working directory's mounts, which nothing else would
ever release while the daemon runs: a layered one's overlay, anchor and
store (a loop-mounted, size-capped file system, and its loop device), or a
plain capped one's mount; the files stay on disk.
"""

from __future__ import annotations

import contextlib
import logging
import threading

from ..._paths import sandbox_workdir
from .. import layers
from .._diskcap import unmount_capped

log = logging.getLogger("hutch.docker")

#: Sandboxes whose container this process kept after their close
#: (``preserve``), whose working directory's mounts stay for that container.
_preserved: set[str] = set()
_preserved_lock = threading.Lock()


def kept_for_preserved_container(sandbox_id: str) -> None:
    """The sandbox was closed and its container kept (``preserve``)."""
    with _preserved_lock:
        _preserved.add(sandbox_id)


def preserved_container_removed(sandbox_id: str) -> bool:
    """A container of ``sandbox_id`` was removed: if it was one kept after
    its sandbox's close, its working directory's mounts (an overlay, a
    size-capped store or directory and their loop devices) go with it, the
    files kept. Whether it was one. Blocking."""
    with _preserved_lock:
        if sandbox_id not in _preserved:
            return False
        _preserved.discard(sandbox_id)
    layers.let_go(sandbox_id)
    with contextlib.suppress(OSError):  # a plain capped directory (no overlay here)
        unmount_capped(sandbox_workdir(sandbox_id))
    log.info("sandbox %s: its preserved container was removed; its mounts are released "
             "(its files stay on disk)", sandbox_id)
    return True
