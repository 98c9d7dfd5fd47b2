"""Moved to the package :mod:`hutch.daemon` (the daemon's core, free of HTTP);
re-exported while callers move."""

from __future__ import annotations

from ..daemon.common import (
    CLEAN_STOP,
    DEFAULT_RETENTION_SECONDS,
    MAX_FORK,
    MAX_LABEL,
    MAX_SESSION_ID,
    MAX_SESSIONS,
    NOTICE_BURST_SECONDS,
    REF_USE_EVENT_SECONDS,
    REMOTE_GIT_SCHEMES,
    SETTING_UP,
    STORE_RETRY_SECONDS,
    WORKSPACE_NAME,
    AttachedSession,
    default_data_dir,
    make_private_dir,
    make_private_file,
)
from ..daemon.core import Daemon

__all__ = [
    "CLEAN_STOP", "DEFAULT_RETENTION_SECONDS", "MAX_FORK", "MAX_LABEL",
    "MAX_SESSIONS", "MAX_SESSION_ID", "NOTICE_BURST_SECONDS", "REF_USE_EVENT_SECONDS",
    "REMOTE_GIT_SCHEMES", "SETTING_UP", "STORE_RETRY_SECONDS", "WORKSPACE_NAME",
    "AttachedSession", "Daemon", "default_data_dir", "make_private_dir", "make_private_file",
]
