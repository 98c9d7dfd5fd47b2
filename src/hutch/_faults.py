"""Named fault points: where a test may have this process die (SIGKILL) in
the middle of an operation, as a crash or an OOM kill of the daemon would.

``HUTCH_FAULT=name`` in the environment arms one point: the process kills
itself the first time it reaches ``fault_point("name")``. Unset (always, but
in tests), a point costs one comparison with None. Names are literal strings
at their call sites, ``<operation>.<where>`` or ``<operation>.<provider>.<where>``
(``suspend.docker.frozen``), so that the fault harness (tests/faults.py) finds
every point by reading the source: a step added with its point is covered.
"""

from __future__ import annotations

import os
import signal

#: The armed point, read once: the environment is the daemon's own at start.
_ARMED: str | None = os.environ.get("HUTCH_FAULT") or None


def fault_point(name: str) -> None:
    """Die here (SIGKILL, no cleanup of any kind) if ``name`` is armed."""
    if _ARMED is not None and name == _ARMED:
        os.kill(os.getpid(), signal.SIGKILL)
