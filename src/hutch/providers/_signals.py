"""Default signals for the commands hutch starts on this host.

Ignored signal dispositions and the signal mask survive ``fork`` and
``exec``. A program that runs hutch may ignore some (``nohup`` ignores SIGHUP,
a test runner's workers ignore SIGINT) or block one it waits for; a command a
host-spawning provider starts as a plain child would inherit that, and then
``kill -INT`` or an agent's Ctrl-C would not end it. A sandbox's commands
start with every signal at its default instead, whatever their host process
does with its own.

Python's ``subprocess`` resets only SIGPIPE and SIGXFSZ (``restore_signals``),
and a ``preexec_fn`` would make it ``fork`` the whole process (about 40 ms
under a 200 MB heap, against ~1 ms). So the reset is done by exec'ing through
``env --default-signal`` (coreutils 8.31 and later: every signal back to its
default and the mask cleared), and only when the calling thread holds state a
child would inherit: an ignored signal or a non-empty mask.
"""

from __future__ import annotations

import functools
import importlib
import shutil
import signal
import subprocess

from .._errors import ProviderError

__all__ = [
    "default_signals_prefix", "inherits_signal_state", "resetting_env", "shrug_ignored_signals",
]

# Python itself ignores these and Popen's restore_signals resets them in
# every child; neither stops and kill can be ignored or blocked.
_NOT_INHERITED = {signal.SIGPIPE, signal.SIGXFSZ, signal.SIGKILL, signal.SIGSTOP}
_CHECKED = tuple(int(s) for s in signal.valid_signals() if s not in _NOT_INHERITED)
#: Ignored signals :func:`shrug_ignored_signals` leaves ignored: a stop from a
#: terminal, which a process that catches them meets at each tty read or
#: write from the background (the call interrupted, and retried, for ever).
_JOB_CONTROL = {signal.SIGTSTP, signal.SIGTTIN, signal.SIGTTOU}
#: The C module under :mod:`signal`: its ``getsignal`` answers the raw handler
#: (SIG_IGN as the int 1), where ``signal.getsignal`` makes each an enum member
#: first, which cost ~2 us a signal: 0.1 ms an exec, over the ~60 checked.
_RAW = importlib.import_module("_signal")


def inherits_signal_state() -> bool:
    """Whether a child started from this thread now would inherit an ignored
    signal or a blocked one."""
    if signal.pthread_sigmask(signal.SIG_BLOCK, ()):
        return True
    ignored = _RAW.SIG_IGN
    for signum in _CHECKED:
        try:
            if _RAW.getsignal(signum) == ignored:
                return True
        except ValueError:  # a number the interpreter does not know
            continue
    return False


@functools.cache
def resetting_env() -> str:
    """The ``env`` that resets every signal, checked once."""
    env = shutil.which("env", path="/usr/bin:/bin")
    if env is not None:
        probe = subprocess.run([env, "--default-signal", "true"], capture_output=True,
                               check=False)
        if probe.returncode == 0:
            return env
    raise ProviderError(
        "this host's env(1) cannot reset signals (--default-signal needs coreutils 8.31 or "
        "later), and this program ignores or blocks signals its sandboxes' commands would "
        "inherit"
    )


def default_signals_prefix() -> list[str]:
    """The argv prefix that starts a command with default signals: empty when
    nothing would be inherited (the common case, costing no exec). Call it
    on the thread that spawns the command: the mask is that thread's."""
    if inherits_signal_state():
        return [resetting_env(), "--default-signal"]
    return []


def _shrug(signum: int, frame: object) -> None:
    """A signal this process ignored when it started: still nothing to do."""


def shrug_ignored_signals() -> list[int]:
    """Catch, doing nothing, each signal this process ignores (inherited
    from whatever started it: ``nohup``'s SIGHUP, a background shell job's
    SIGINT and SIGQUIT), job control's stops aside. The process still shrugs
    them off, and a command it starts begins with them at their defaults (a
    handler does not survive exec): no exec through ``env`` first, which
    costs each command a second exec (a third of a local exec's time).

    For hutch's own programs (the daemon), from the main thread: a library
    leaves its host program's signals as they are. Answers the signals caught."""
    caught = []
    for signum in _CHECKED:
        if signum in _JOB_CONTROL:
            continue
        try:
            if _RAW.getsignal(signum) == _RAW.SIG_IGN:
                signal.signal(signum, _shrug)
                caught.append(signum)
        except (ValueError, OSError):  # a number the interpreter does not know
            continue
    return caught
