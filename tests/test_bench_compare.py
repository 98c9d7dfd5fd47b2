"""bench/compare.py refuses a run whose old and new sides would time different work."""

from __future__ import annotations

import pathlib
import signal
import subprocess
import sys

COMPARE = pathlib.Path(__file__).resolve().parent.parent / "bench" / "compare.py"


def _ignore_hangup() -> None:
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # what nohup does


def _ignore_none() -> None:
    # The suite itself may run under nohup: the child starts with none ignored.
    for number in signal.valid_signals():
        if signal.getsignal(number) is signal.SIG_IGN:
            signal.signal(number, signal.SIG_DFL)


def test_a_compare_started_with_a_signal_ignored_is_refused_before_any_checkout() -> None:
    # Main's exec resets an ignored signal by one exec more; bc2d03a's did not, so
    # under nohup the in-process exec row compared unlike work (1.41x, none of it real).
    ran = subprocess.run([sys.executable, str(COMPARE), "--ref", "no-such-ref", "fork"],
                         preexec_fn=_ignore_hangup, capture_output=True, text=True, timeout=60)
    assert ran.returncode == 2
    assert "ignores or blocks a signal" in ran.stderr
    assert "no-such-ref" not in ran.stderr  # refused before it looked for the commit


def test_a_compare_with_no_signal_ignored_goes_on_and_tells_a_ref_that_names_no_commit() -> None:
    ran = subprocess.run([sys.executable, str(COMPARE), "--ref", "no-such-ref", "fork"],
                         preexec_fn=_ignore_none, capture_output=True, text=True, timeout=60)
    assert "ignores" not in ran.stderr
    assert ran.returncode == 2
    assert ran.stderr.strip() == "compare: 'no-such-ref' names no commit here"
