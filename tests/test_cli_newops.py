"""hutch mkdir, mv, watch, start, stdin and wait against a real daemon."""

from __future__ import annotations

import os
import subprocess

from tests.daemon_fixture import DaemonProcess
from tests.test_cli import HUTCH, daemon, hutch, make_local

__all__ = ["daemon"]  # the module's daemon, shared with test_cli's fixture


def test_mkdir_and_mv(daemon: DaemonProcess) -> None:
    sb = make_local(daemon)
    assert hutch(daemon, "mkdir", sb, "a/b").returncode == 3  # no parent: file_not_found
    assert hutch(daemon, "mkdir", sb, "-p", "a/b").returncode == 0
    assert hutch(daemon, "mkdir", sb, "-p", "a/b").returncode == 0  # as mkdir -p
    again = hutch(daemon, "mkdir", sb, "a/b")
    assert again.returncode == 1 and "file_exists" in again.stderr
    assert hutch(daemon, "exec", sb, "--", "sh", "-c", "echo x > f; echo y > g").returncode == 0
    assert hutch(daemon, "mv", sb, "f", "a/b/f").returncode == 0
    onto = hutch(daemon, "mv", sb, "g", "a/b/f")
    assert onto.returncode == 1 and "file_exists" in onto.stderr
    assert hutch(daemon, "mv", sb, "--force", "g", "a/b/f").returncode == 0
    shown = hutch(daemon, "exec", sb, "--", "sh", "-c", "cat a/b/f; ls")
    assert shown.stdout == "y\na\n"
    assert hutch(daemon, "mv", sb, ".", "elsewhere").returncode == 2  # invalid_argument
    hutch(daemon, "kill", sb)


def test_start_stdin_wait(daemon: DaemonProcess) -> None:
    sb = make_local(daemon)
    started = hutch(daemon, "start", sb, "--keep-stdin", "--", "cat")
    assert started.returncode == 0, started.stderr
    process = started.stdout.strip()
    sent = hutch(daemon, "stdin", sb, process, stdin="typed in\nand more\n")
    assert sent.returncode == 0, sent.stderr
    waited = hutch(daemon, "wait", sb, process, "--timeout", "30")
    assert (waited.returncode, waited.stdout) == (0, "typed in\nand more\n")
    closed = hutch(daemon, "stdin", sb, process, stdin="late")
    assert closed.returncode == 1 and "stdin_closed" in closed.stderr
    plain = hutch(daemon, "start", sb, "--", "sh", "-c", "exit 3").stdout.strip()
    assert hutch(daemon, "wait", sb, plain).returncode == 3
    hutch(daemon, "kill", sb)


def test_watch_prints_events_as_they_come(daemon: DaemonProcess) -> None:
    sb = make_local(daemon)
    assert hutch(daemon, "mkdir", sb, "seen").returncode == 0
    env = {**os.environ, "HUTCH_URL": daemon.url, "HUTCH_TOKEN": daemon.token}
    with subprocess.Popen([*HUTCH, "watch", sb, "seen", "--count", "2"], env=env,
                          stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True) as watching:
        assert watching.stderr is not None and watching.stdout is not None
        assert watching.stderr.readline().startswith("watching ")
        made = hutch(daemon, "exec", sb, "--", "sh", "-c", "touch seen/one; rm seen/one")
        assert made.returncode == 0
        out, _ = watching.communicate(timeout=60)
    assert watching.returncode == 0
    workdir = hutch(daemon, "exec", sb, "--", "pwd").stdout.strip()
    assert out.splitlines() == [f"created\t{workdir}/seen/one", f"removed\t{workdir}/seen/one"]
    hutch(daemon, "kill", sb)
