"""Files written whole or not at all: into a temporary file beside the
target, then renamed over it, so a reader finds the old content or the new,
never half of one. A write that fails midway (a full disk, a value that is
not JSON) leaves the target as it was and takes its temporary file away."""

from __future__ import annotations

import contextlib
import json
import os


def write_json(path: str, value: object, *, durable: bool = True) -> None:
    """``value`` as JSON in ``path``, whole or not at all. ``durable``: on
    disk (fsync) before it replaces the old, for a record that must survive
    the host's crash; not for one remade at each start."""
    tmp = path + ".tmp"
    try:
        with open(tmp, "w") as fh:
            json.dump(value, fh)
            if durable:
                fh.flush()
                os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
