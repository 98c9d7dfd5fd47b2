"""The daemon's core, free of HTTP (:mod:`hutch.server` serves it): sandboxes,
snapshots, refs and workspaces that outlive the process, written through the
store before they are acknowledged, and reconciled with what runs at start.

Its parts build one class by responsibility, each on the one before:
:mod:`.base` (state, durable transitions) → :mod:`.watch` → :mod:`.refs` →
:mod:`.sandboxes` → :mod:`.snapshots` → :mod:`.workspaces` →
:mod:`.reconcile` → :mod:`.core` (:class:`Daemon`: start and stop).
"""

from __future__ import annotations

from .common import DEFAULT_RETENTION_SECONDS, default_data_dir
from .core import Daemon
from .policy import OperatorPolicy

__all__ = ["DEFAULT_RETENTION_SECONDS", "Daemon", "OperatorPolicy", "default_data_dir"]
