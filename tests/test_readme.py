"""The README's examples run as pasted: the shell session against a real
daemon, the Python program against the real Docker Engine."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator

import pytest

from tests.daemon_fixture import DaemonProcess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def blocks(language: str) -> list[str]:
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as fh:
        text = fh.read()
    return re.findall(rf"^```{language}\n(.*?)^```", text, flags=re.S | re.M)


@pytest.fixture(scope="module")
def daemon() -> Iterator[DaemonProcess]:
    # As scripts/quickstart.sh starts it: no token (it makes its own), local allowed.
    d = DaemonProcess(token=None, provider=None, extra_args=["--allow-provider", "local"]).start()
    yield d
    d.stop()


def test_the_cli_session_runs_as_pasted(daemon: DaemonProcess) -> None:
    session = next(b for b in blocks("sh") if "hutch create" in b)
    # The commands are those of a clone: .venv/bin/hutch is this interpreter's.
    bin_dir = tempfile.mkdtemp()
    os.makedirs(os.path.join(bin_dir, ".venv", "bin"))
    with open(os.path.join(bin_dir, ".venv", "bin", "hutch"), "w") as fh:
        fh.write(f'#!/bin/sh\nexec {sys.executable} -m hutch.cli.main "$@"\n')
    os.chmod(os.path.join(bin_dir, ".venv", "bin", "hutch"), 0o755)
    os.symlink(os.path.join(ROOT, "README.md"), os.path.join(bin_dir, "README.md"))
    shutil.rmtree("/tmp/docs-back", ignore_errors=True)  # where the session copies to
    # No token given: the CLI finds the one the daemon made in its data directory.
    env = {k: v for k, v in os.environ.items() if k != "HUTCH_TOKEN"}
    env.update(HUTCH_URL=daemon.url, HUTCH_HOME=daemon.data_dir)
    ran = subprocess.run(["bash", "-euo", "pipefail", "-c", session], cwd=bin_dir, env=env,
                         capture_output=True, text=True, timeout=300,
                         stdin=subprocess.DEVNULL)
    assert ran.returncode == 0, (ran.stdout, ran.stderr)
    assert "42\n" in ran.stdout  # the program given on stdin ran
    with open(os.path.join(ROOT, "README.md"), "rb") as fh, \
            open("/tmp/docs-back/README.md", "rb") as back:
        assert back.read() == fh.read()
    assert "hello from" in ran.stdout  # the demo


@pytest.mark.docker
def test_the_python_example_runs_as_pasted() -> None:
    program = next(b for b in blocks("python") if "create_sandbox" in b)
    ran = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                         timeout=600, cwd=tempfile.mkdtemp(), stdin=subprocess.DEVNULL)
    assert ran.returncode == 0, (ran.stdout, ran.stderr)
    assert "GrepMatch(" in ran.stdout and "def main():" in ran.stdout
    assert "step 3" in ran.stdout and "app.py" in ran.stdout
    assert "running" in ran.stdout
