"""Test artifacts (the dashboard's screenshots): files a run saves for people
to look at, outside the repository, named at the end of the run's output."""

from __future__ import annotations

import os
import time

#: When this process (the run's, or a worker's) began: what is newer, this run saved.
_STARTED = time.time()


def artifacts_dir() -> str:
    """``$HUTCH_TEST_ARTIFACTS``, else /tmp/hutch-artifacts; made if missing."""
    where = os.environ.get("HUTCH_TEST_ARTIFACTS") or "/tmp/hutch-artifacts"
    os.makedirs(where, exist_ok=True)
    return where


def summary(terminalreporter: object) -> None:
    """Name the artifacts this run saved (the workers' too: one directory)."""
    where = os.environ.get("HUTCH_TEST_ARTIFACTS") or "/tmp/hutch-artifacts"
    try:
        names = sorted(n for n in os.listdir(where)
                       if os.stat(os.path.join(where, n)).st_mtime >= _STARTED)
    except OSError:
        return
    if names:
        write = getattr(terminalreporter, "write_line", print)
        write(f"test artifacts in {where}: {', '.join(names)}")
