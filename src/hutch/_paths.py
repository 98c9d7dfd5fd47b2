"""Where hutch keeps what it makes on this host."""

from __future__ import annotations

import os


def hutch_home() -> str:
    """hutch's data directory: ``HUTCH_HOME`` (the daemon sets it to its own), else
    ``~/.local/share/hutch``."""
    return os.environ.get("HUTCH_HOME") or os.path.expanduser("~/.local/share/hutch")


#: The file in a daemon's data directory holding the token it made for itself
#: (when its operator gave none): 0600, so its user's CLI and SDK alone find it.
TOKEN_FILE_NAME = "api-token"


def token_file_path(home: str | None = None) -> str:
    """Where a daemon on data directory ``home`` (else hutch's) keeps the token it made."""
    return os.path.join(home or hutch_home(), TOKEN_FILE_NAME)


def sandbox_workdir(sandbox_id: str) -> str:
    """A fresh host directory for a sandbox made without one; its parent, which
    is the sandbox's own, goes with the sandbox."""
    return os.path.join(hutch_home(), "sandboxes", sandbox_id, "workspace")
