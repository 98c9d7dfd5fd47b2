"""The hutch command against a real daemon: output, and exit codes scripts rely on."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator

import pytest

from tests.daemon_fixture import DaemonProcess

HUTCH = [sys.executable, "-m", "hutch.cli.main"]


@pytest.fixture(scope="module")
def daemon() -> Iterator[DaemonProcess]:
    d = DaemonProcess().start()
    yield d
    d.stop()


def hutch(d: DaemonProcess | None, *args: str, token: str | None = None,
          cwd: str | None = None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, COLUMNS="200")
    if d is not None:
        env.update(HUTCH_URL=d.url, HUTCH_TOKEN=token if token is not None else d.token)
    return subprocess.run([*HUTCH, *args], capture_output=True, text=True, env=env,
                          timeout=120, cwd=cwd)


def test_demo_runs_with_no_daemon() -> None:
    result = hutch(None, "demo")
    assert result.returncode == 0, result.stderr
    assert "hello from" in result.stdout
    assert "a result, not an error" in result.stdout


def test_create_exec_ls_kill(daemon: DaemonProcess) -> None:
    workdir = tempfile.mkdtemp()
    made = hutch(daemon, "create", "--provider", "local", "--workdir", workdir,
                 "--idle-timeout", "600")
    assert made.returncode == 0, made.stderr
    sid = made.stdout.strip()
    ran = hutch(daemon, "exec", sid, "--", "sh", "-c", "echo out; echo err >&2; exit 7")
    assert (ran.returncode, ran.stdout, ran.stderr) == (7, "out\n", "err\n")
    listing = hutch(daemon, "ls")
    assert sid in listing.stdout and "running" in listing.stdout
    assert hutch(daemon, "set-timeout", sid, "90000").returncode == 2
    assert hutch(daemon, "pause", sid).returncode == 1  # capability_unsupported
    assert hutch(daemon, "kill", sid).returncode == 0
    assert hutch(daemon, "exec", sid, "--", "true").returncode == 4  # closed: unavailable


def test_exit_codes_for_missing_and_unauthorized(daemon: DaemonProcess) -> None:
    assert hutch(daemon, "exec", "sb-nothing", "--", "true").returncode == 3
    denied = hutch(daemon, "ls", token="wrong")
    assert denied.returncode == 5
    assert "unauthorized" in denied.stderr


def test_config_file_is_below_flags(daemon: DaemonProcess) -> None:
    workdir = tempfile.mkdtemp()
    config_dir = tempfile.mkdtemp()
    with open(os.path.join(config_dir, "hutch.toml"), "w") as fh:
        fh.write(f'[sandbox]\nprovider = "local"\nmax_lifetime = 50\n'
                 f'[providers.local]\nworkdir = "{workdir}"\n')
    made = hutch(daemon, "create", "--max-lifetime", "500", cwd=config_dir)
    assert made.returncode == 0, made.stderr
    sid = made.stdout.strip()
    shown = hutch(daemon, "ls", "--json")
    entry = next(line for line in shown.stdout.split("{") if sid in line)
    assert workdir in entry
    assert hutch(daemon, "kill", sid).returncode == 0


def test_snapshot_create_ls_rm_and_fork(daemon: DaemonProcess) -> None:
    made = hutch(daemon, "create", "--provider", "local")
    assert made.returncode == 0, made.stderr
    sid = made.stdout.strip()
    snap = hutch(daemon, "snapshot", "create", sid, "--label", "setup")
    assert snap.returncode == 0, snap.stderr
    root = snap.stdout.split()[0]
    forked = hutch(daemon, "fork", sid, "-n", "2", "--label", "try")
    assert forked.returncode == 0, forked.stderr
    lines = forked.stdout.split()
    child, branches = lines[1], lines[2:]
    assert len(branches) == 2 and all(b.startswith("sb-") for b in branches)
    tree = hutch(daemon, "snapshot", "ls").stdout.splitlines()
    # The fork's snapshot is drawn under the one it descends from.
    assert tree[0].startswith(f"{root} setup")
    assert tree[1].startswith(f"└─ {child} try")
    refused = hutch(daemon, "snapshot", "rm", root)
    assert refused.returncode == 2 and "still needed" in refused.stderr
    for branch in branches:
        assert hutch(daemon, "kill", branch).returncode == 0
    assert hutch(daemon, "snapshot", "rm", child).returncode == 0
    assert hutch(daemon, "snapshot", "rm", root).returncode == 0
    assert hutch(daemon, "snapshot", "ls", "--json").stdout.strip() == "[]"
    assert hutch(daemon, "kill", sid).returncode == 0
