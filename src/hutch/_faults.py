"""Named fault points: where a test may have this process die (SIGKILL) in
the middle of an operation, as a crash or an OOM kill of the daemon would.

``HUTCH_FAULT=name`` in the environment arms one point: the process kills
itself the first time it reaches ``fault_point("name")``.
``HUTCH_FAULT=file:PATH`` arms the point named in that file when a point is
reached (none while it is empty or missing), so that a test arms one daemon
for one step after another without a restart each. Unset (always, but in
tests), a point costs one comparison with None. Names are literal strings
at their call sites, ``<operation>.<where>`` or ``<operation>.<provider>.<where>``
(``suspend.docker.frozen``), so that the fault harness (tests/faults.py) finds
every point by reading the source: a step added with its point is covered.
"""

from __future__ import annotations

import os
import signal

#: The armed point, read once: the environment is the daemon's own at start.
_ARMED: str | None = os.environ.get("HUTCH_FAULT") or None


_FROM_FILE = "file:"


def fault_point(name: str) -> None:
    """Die here (SIGKILL, no cleanup of any kind) if ``name`` is armed."""
    if _ARMED is not None and (name == _ARMED or _armed_in_file(_ARMED, name)):
        os.kill(os.getpid(), signal.SIGKILL)


def _armed_in_file(armed: str, name: str) -> bool:
    if not armed.startswith(_FROM_FILE):
        return False
    try:
        with open(armed[len(_FROM_FILE):], encoding="utf-8") as fh:
            return fh.read().strip() == name
    except OSError:
        return False
