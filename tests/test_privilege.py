"""Least privilege around the daemon: its data directory, its token.

Each test tries the door on a real daemon process, as the unprivileged host
user ``nobody`` where the question is what another user can do.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator

import pytest

import hutch
from tests.conftest import TEST_IMAGE
from tests.daemon_fixture import DaemonProcess

#: Run a command as the unprivileged host user nobody. runuser, not setpriv:
#: here setpriv's exec reached a file in a root-only directory, proving nothing.
AS_NOBODY = ["runuser", "-u", "nobody", "--"]


def as_nobody(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*AS_NOBODY, *argv], capture_output=True, text=True, timeout=60,
                          check=False)


@pytest.fixture
def shared_data_dir() -> Iterator[str]:
    """A data directory made the way a default one is (umask 022: 0755),
    in a place every user can traverse."""
    parent = tempfile.mkdtemp(prefix="hutch-priv-")
    os.chmod(parent, 0o755)
    data_dir = os.path.join(parent, "hutch")
    os.makedirs(data_dir)
    os.chmod(data_dir, 0o755)
    yield data_dir
    subprocess.run(["rm", "-rf", parent], check=False)


@pytest.fixture
def daemon(shared_data_dir: str) -> Iterator[DaemonProcess]:
    d = DaemonProcess(shared_data_dir, token=f"tok-{uuid.uuid4().hex}").start()
    yield d
    d.stop()


def mode(path: str) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


# -- 1. the data directory is the daemon's user's alone -------------------------------------


def test_data_dir_and_store_are_private(daemon: DaemonProcess) -> None:
    with hutch.Client(daemon.url, token=daemon.token) as c:
        c.create_sandbox("virtual").close()
    assert mode(daemon.data_dir) == 0o700
    store_files = [n for n in os.listdir(daemon.data_dir) if n.startswith("hutch.db")]
    assert "hutch.db" in store_files
    for name in store_files:
        assert mode(os.path.join(daemon.data_dir, name)) == 0o600, name
    listing = as_nobody("ls", daemon.data_dir)
    assert listing.returncode != 0 and "Permission denied" in listing.stderr


@pytest.mark.docker
def test_a_setuid_shell_made_in_a_sandbox_gives_a_host_user_nothing(
    daemon: DaemonProcess,
) -> None:
    with hutch.Client(daemon.url, token=daemon.token) as c:
        sb = c.create_sandbox("docker", image=TEST_IMAGE)
        try:
            made = sb.exec("cp /bin/bash /workspace/sh && chmod 4755 /workspace/sh "
                           "&& stat -c %a:%u /workspace/sh")
            assert made.stdout.strip() == "4755:0", made
            host_copy = os.path.join(daemon.data_dir, "layers", "mounts", sb.id, "merged", "sh")
            assert os.stat(host_copy).st_mode & stat.S_ISUID  # it is there, setuid root
            tried = as_nobody(host_copy, "-p", "-c", "id -u")
            assert "0" not in tried.stdout.split(), (tried.stdout, tried.stderr)
            assert tried.returncode != 0, tried
            # And were the data directory open, the mount the copy lives on
            # is nosuid: its setuid bit means nothing on the host.
            where = os.path.dirname(host_copy)
            while len(where) >= len(daemon.data_dir):
                os.chmod(where, 0o755)
                where = os.path.dirname(where)
            opened = as_nobody(host_copy, "-p", "-c", "id -u")
            assert opened.stdout.split() == ["65534"], (opened.stdout, opened.stderr)
        finally:
            sb.close()


@pytest.mark.docker
def test_links_planted_in_the_workspace_do_not_lead_the_daemon_onto_host_files(
    daemon: DaemonProcess,
) -> None:
    victim_dir = tempfile.mkdtemp(prefix="hutch-victim-")
    victim_file = os.path.join(victim_dir, "precious")
    with open(victim_file, "w") as fh:
        fh.write("keep me")
    with hutch.Client(daemon.url, token=daemon.token) as c:
        sb = c.create_sandbox("docker", image=TEST_IMAGE)
        planted = sb.exec(
            f"ln -s {victim_file} /workspace/file-link && ln -s {victim_dir} /workspace/dir-link"
            f" && mkdir -p /workspace/sub && ln -s / /workspace/sub/root"
        )
        assert planted.exit_code == 0, planted
        host_workdir = os.path.join(daemon.data_dir, "layers", "mounts", sb.id, "merged")
        assert os.path.islink(os.path.join(host_workdir, "dir-link"))
        sb.close()  # the daemon removes the working directory it made
        assert not os.path.exists(host_workdir)
    with open(victim_file) as fh:
        assert fh.read() == "keep me"
    subprocess.run(["rm", "-rf", victim_dir], check=False)


# -- 2. the token stays secret -----------------------------------------------------------------


def test_the_token_is_not_on_the_command_line_nor_in_a_sandbox(daemon: DaemonProcess) -> None:
    assert daemon.proc is not None
    with open(f"/proc/{daemon.proc.pid}/cmdline", "rb") as fh:
        cmdline = fh.read()
    assert daemon.token.encode() not in cmdline
    environ = as_nobody("cat", f"/proc/{daemon.proc.pid}/environ")
    assert daemon.token not in environ.stdout and environ.returncode != 0
    with hutch.Client(daemon.url, token=daemon.token) as c, tempfile.TemporaryDirectory() as wd:
        sb = c.create_sandbox("local", workdir=wd)
        try:
            seen = sb.exec("env; cat /proc/$PPID/environ | tr '\\0' '\\n'")
        finally:
            sb.close()
    assert seen.exit_code == 0, seen
    assert daemon.token not in seen.stdout


@pytest.mark.docker
def test_the_token_is_not_in_a_docker_sandbox(daemon: DaemonProcess) -> None:
    with hutch.Client(daemon.url, token=daemon.token) as c:
        sb = c.create_sandbox("docker", image=TEST_IMAGE)
        try:
            seen = sb.exec("env; cat /proc/1/environ")
        finally:
            sb.close()
    assert daemon.token not in seen.stdout


def test_the_token_comes_from_a_private_file(shared_data_dir: str) -> None:
    token = f"file-{uuid.uuid4().hex}"
    token_file = os.path.join(shared_data_dir, "token")
    with open(token_file, "w") as fh:
        fh.write(token + "\n")
    os.chmod(token_file, 0o644)
    refused = subprocess.run(
        [sys.executable, "-m", "hutch.server", "--port", "1", "--token-file", token_file],
        capture_output=True, text=True, timeout=60, check=False,
    )
    assert refused.returncode != 0
    assert "chmod 600" in refused.stderr and token not in refused.stderr
    os.chmod(token_file, 0o600)
    d = DaemonProcess(shared_data_dir, token=token, extra_args=["--token-file", token_file],
                      extra_env={"HUTCH_TOKEN": ""}).start()
    try:
        import httpx

        assert httpx.get(f"{d.url}/v1/sandboxes").status_code == 401
        ok = httpx.get(f"{d.url}/v1/sandboxes", headers={"Authorization": f"Bearer {token}"})
        assert ok.status_code == 200
        assert d.proc is not None
        with open(f"/proc/{d.proc.pid}/cmdline", "rb") as fh:
            assert token.encode() not in fh.read()
    finally:
        d.stop()


def test_serve_takes_no_token_argument_and_says_where_it_comes_from() -> None:
    cli = [sys.executable, "-m", "hutch.cli.main", "serve"]
    helped = subprocess.run([*cli, "--help"], capture_output=True, text=True, timeout=60,
                            env={**os.environ, "COLUMNS": "200"}, check=False)
    assert "HUTCH_TOKEN" in helped.stdout and "--token-file" in helped.stdout
    given = subprocess.run([*cli, "--token", "x", "--port", "1"], capture_output=True,
                           text=True, timeout=60, check=False)
    assert given.returncode != 0 and "No such option" in given.stderr
