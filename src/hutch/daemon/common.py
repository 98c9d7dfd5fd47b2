"""What the daemon's parts share: its constants, the sessions attached
through refs, and its private data directory."""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass

from .._paths import hutch_home

log = logging.getLogger("hutch.daemon")

WORKSPACE_NAME = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,62}$")
#: Store key written by a clean stop, cleared at start: after a crash it is absent.
CLEAN_STOP = "clean_stop_unix"
#: The lease of the daemon serving a store: one daemon a store, until
#: sandboxes have owners (issue 24's fleet); a second daemon started on the
#: same store is refused instead of adopting the first one's sandboxes as
#: its own. Renewed every third of its length; a daemon killed on this host
#: frees it at once (its holder is gone), one on another host once it lapses.
SERVING_LEASE = "daemon"
SERVING_LEASE_SECONDS = 30.0
#: A fleet (issue 24): how long a daemon's registration, and the rows it
#: owns, hold without its heartbeat (renewed every third of it); a dead
#: daemon's sandboxes are taken over (or failed) within this and a second.
#: ``HUTCH_FLEET_LEASE_SECONDS`` shortens it (tests).
FLEET_LEASE_SECONDS = 15.0
#: The lease of the one daemon of a fleet that prunes ended sandboxes.
PRUNING_LEASE = "pruning"
#: Why a sandbox only its dead daemon's host could reach failed.
HOST_GONE = "its host is gone"
#: The file in the data directory naming this daemon in its fleet.
DAEMON_ID_FILE = "daemon-id"


def fleet_lease_seconds() -> float:
    text = os.environ.get("HUTCH_FLEET_LEASE_SECONDS")
    return float(text) if text else FLEET_LEASE_SECONDS


#: Store key: the sandboxes a definition's ensure is making (a JSON list),
#: not yet recorded as its thread's: a daemon killed part-way leaves them
#: half set up, and its next start removes them.
SETTING_UP = "definition_setups"
#: A ref's use is an event at most this often (its first use after a start always is).
REF_USE_EVENT_SECONDS = 60.0
#: The git sources an API client may give a definition (nothing on the host).
REMOTE_GIT_SCHEMES = ("https://", "http://", "git://")
#: How many times a change of a row is read and made again while other
#: writes of it come between (each a compare and set on its version).
CONFLICT_TRIES = 20
#: How soon a change the store could not keep (a runtime's death) is recorded again.
STORE_RETRY_SECONDS = 2.0
#: A runtime's notices of a sandbox (not deaths) that say the same with
#: less than this many seconds between them are noted once, with their count.
#: Two, not one: on a loaded machine the OOM killer's kills of one flood came
#: in waves more than a second apart, and one flood was told in three lines.
NOTICE_BURST_SECONDS = 2.0
#: Longest snapshot label, and most branches one fork request makes.
MAX_LABEL = 200
MAX_FORK = 64
#: How long an ended (terminated or failed) sandbox stays readable, with its events.
DEFAULT_RETENTION_SECONDS = 86400.0


#: Sessions listed as attached to one sandbox at most (past it the stalest is
#: forgotten: a client that vanished never detaches), and a session id's length.
MAX_SESSIONS = 1024
MAX_SESSION_ID = 64


@dataclass
class AttachedSession:
    """A session working in a sandbox through a ref (a client's session id)."""

    ref_id: str
    session: str
    attached_at_unix: float
    last_used_unix: float


def default_data_dir() -> str:
    return hutch_home()


def make_private_dir(path: str) -> None:
    """Create ``path`` (if need be) as its owner's alone: 0700, whatever it was.

    Sandboxes write into working directories below it (a setuid copy of a
    shell, links to host files); no other host user may reach them.
    """
    os.makedirs(path, mode=0o700, exist_ok=True)
    os.chmod(path, 0o700)


def make_private_file(path: str) -> str:
    """Create ``path`` 0600 if it is missing, else make it 0600; return it.

    SQLite creates its -wal and -shm files with the database's mode.
    """
    os.close(os.open(path, os.O_CREAT | os.O_WRONLY | os.O_CLOEXEC, 0o600))
    os.chmod(path, 0o600)
    return path
