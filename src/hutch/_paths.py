"""Where hutch keeps what it makes on this host."""

from __future__ import annotations

import os


def hutch_home() -> str:
    """hutch's data directory: ``HUTCH_HOME`` (the daemon sets it to its own), else
    ``~/.local/share/hutch``."""
    return os.environ.get("HUTCH_HOME") or os.path.expanduser("~/.local/share/hutch")


def sandbox_workdir(sandbox_id: str) -> str:
    """A fresh host directory for a sandbox made without one; its parent, which
    is the sandbox's own, goes with the sandbox."""
    return os.path.join(hutch_home(), "sandboxes", sandbox_id, "workspace")
