"""What a hostile sandbox hands out, and what a caller tries on its working
directory: copies out never carry privilege (``hutch cp`` strips setuid,
setgid and sticky bits and refuses device nodes and FIFOs), and the working
directory's root is not a file to delete, on every provider.

Through a real daemon and the real ``hutch`` command, on docker, bubblewrap,
gvisor, kubernetes (the stand-in API server's) and local (and ssh in-process:
the daemon's ssh settings are the operator's).
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

import hutch
from tests import isolating
from tests.conftest import TEST_IMAGE
from tests.daemon_fixture import DaemonProcess
from tests.isolating import kube_standin  # noqa: F401  (a fixture)
from tests.ssh_server import ALIAS, shared_server, sshd_available

HUTCH = [sys.executable, "-m", "hutch.cli.main"]
#: The providers whose sandboxes run commands, each with its settings.
COPY_PROVIDERS = {
    "docker": {"provider": "docker", "runtime": "agent"},
    "docker-native": {"provider": "docker", "runtime": "native"},
    "bubblewrap": {"provider": "bubblewrap"},
    "gvisor": {"provider": "gvisor"},
    "kubernetes": {"provider": "kubernetes", "image": TEST_IMAGE},
    "local": {"provider": "local"},
}


def kinds(table: dict[str, dict[str, Any]]) -> list[Any]:
    return [isolating.param(k) if k == "gvisor" else k for k in table]


@pytest.fixture
def settings_of(request: pytest.FixtureRequest) -> Any:
    """A kind's settings; a kubernetes sandbox's name the stand-in's kubeconfig."""
    def settings(kind: str) -> dict[str, Any]:
        found = dict(DELETE_PROVIDERS[kind])
        if found["provider"] == "kubernetes":
            found["kubeconfig"] = request.getfixturevalue("kube_standin").kubeconfig
        return found
    return settings


def _operator_flags() -> list[str]:
    """What lets an API client make ``local`` sandboxes on a daemon whose
    operator allows it, where the daemon has such a flag (it is the operator's)."""
    done = subprocess.run([sys.executable, "-m", "hutch.server", "--help"],
                          capture_output=True, text=True, timeout=60, check=False)
    return ["--allow-provider", "local"] if "--allow-provider" in done.stdout else []


@pytest.fixture(scope="module")
def daemon() -> Iterator[DaemonProcess]:
    d = DaemonProcess(extra_args=[*_operator_flags(), *isolating.DAEMON_ALLOWS]).start()
    yield d
    d.close()


@pytest.fixture
def client(daemon: DaemonProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=daemon.url, timeout=180,
                      headers={"Authorization": f"Bearer {daemon.token}"}) as c:
        yield c


@pytest.fixture
def here() -> Iterator[str]:
    """A directory on this host that any user may enter (the copy's
    destination, run by an unprivileged user afterwards)."""
    path = tempfile.mkdtemp(prefix="hutch-copied-")
    os.chmod(path, 0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def make(client: httpx.Client, settings: dict[str, Any]) -> str:
    made = client.post("/v1/sandboxes", json=settings)
    assert made.status_code == 201, made.text
    return str(made.json()["id"])


def run(client: httpx.Client, sid: str, command: str) -> dict[str, Any]:
    done = client.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": command})
    assert done.status_code == 200, done.text
    answer: dict[str, Any] = done.json()
    assert answer["exit_code"] == 0, answer
    return answer


def hutch_cp(
    daemon: DaemonProcess, source: str, destination: str
) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HUTCH_URL": daemon.url, "HUTCH_TOKEN": daemon.token}
    return subprocess.run([*HUTCH, "cp", source, destination], capture_output=True, text=True,
                          env=env, timeout=120, stdin=subprocess.DEVNULL, check=False)


def _privileged_bits(path: str) -> list[str]:
    """Every file and directory under ``path`` (itself included) that carries
    setuid, setgid or sticky, or belongs to another user than this one."""
    found = []
    for top, dirs, files in os.walk(path):
        for name in [top, *(os.path.join(top, n) for n in dirs + files)]:
            st = os.lstat(name)
            privileged = st.st_mode & (stat.S_ISUID | stat.S_ISGID | stat.S_ISVTX)
            if privileged or st.st_uid != os.getuid():
                found.append(f"{name} {stat.filemode(st.st_mode)} uid={st.st_uid}")
    return found


def _euid_as_nobody(program: str) -> str | None:
    """The effective uid ``program -p`` (a copy of bash) has when the
    unprivileged user ``nobody`` runs it; None where no such user can be had."""
    runuser = shutil.which("runuser") or shutil.which("setpriv")
    if os.getuid() != 0 or runuser is None:
        return None
    argv = ([runuser, "-u", "nobody", "--"] if runuser.endswith("runuser")
            else [runuser, "--reuid=nobody", "--regid=nogroup", "--clear-groups"])
    done = subprocess.run([*argv, program, "-p", "-c", "id -u"], capture_output=True,
                          text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@pytest.mark.docker
@pytest.mark.parametrize("kind", kinds(COPY_PROVIDERS))
def test_a_setuid_file_comes_out_without_privilege(
    daemon: DaemonProcess, client: httpx.Client, here: str, kind: str, settings_of: Any
) -> None:
    sid = make(client, settings_of(kind))
    try:
        run(client, sid, "cp /bin/bash s && chmod 6755 s && mkdir -p d/e && chmod 1777 d "
                         "&& cp /bin/bash d/e/t && chmod 4755 d/e/t && chmod 3777 d/e")
        # python3's stat, not coreutils': gVisor's 2022 build refuses the
        # statx flags coreutils 9 passes (EINVAL).
        mode = run(client, sid, "python3 -c \"import os; print(oct(os.stat('s').st_mode))\"")
        assert mode["stdout"].strip().endswith("6755"), mode
        out = hutch_cp(daemon, f"{sid}:s", here + "/")
        assert out.returncode == 0, out.stderr
        copied = os.path.join(here, "s")
        assert stat.S_IMODE(os.stat(copied).st_mode) == 0o755
        assert os.stat(copied).st_uid == os.getuid()  # the caller's, whoever owned it there
        euid = _euid_as_nobody(copied)
        if euid is not None:
            assert euid != "0"

        # A whole tree: no file or directory in it keeps a privileged bit.
        tree = os.path.join(here, "tree")
        out = hutch_cp(daemon, f"{sid}:d", tree)
        assert out.returncode == 0, out.stderr
        assert os.path.isfile(os.path.join(tree, "e", "t"))
        assert _privileged_bits(here) == []
    finally:
        client.delete(f"/v1/sandboxes/{sid}")


@pytest.mark.docker
@pytest.mark.parametrize("kind", kinds(COPY_PROVIDERS))
def test_a_fifo_or_a_device_is_refused_naming_it(
    daemon: DaemonProcess, client: httpx.Client, here: str, kind: str, settings_of: Any
) -> None:
    sid = make(client, settings_of(kind))
    try:
        run(client, sid, "mkfifo f && mkdir -p tree/in && echo hi > tree/a && mkfifo tree/in/p")
        for source, named in (("f", "f"), ("/dev/null", "/dev/null"), ("tree", "tree/in/p")):
            destination = os.path.join(here, "out-" + os.path.basename(source))
            out = hutch_cp(daemon, f"{sid}:{source}", destination)
            assert out.returncode != 0, (source, out.stdout)
            assert "invalid_argument" in out.stderr, out.stderr
            assert named in out.stderr, out.stderr
            assert "device" in out.stderr or "FIFO" in out.stderr, out.stderr
            # Refused before anything was written here.
            assert not os.path.lexists(destination), source
    finally:
        client.delete(f"/v1/sandboxes/{sid}")


# -- the working directory's root is not a file to delete -------------------------------


def _spellings(workdir: str) -> list[tuple[str, bool]]:
    """(path, recursive): every way of naming the working directory, then
    what holds it. What holds it is tried without ``recursive`` only: should
    the rule ever break, a removal of ``/`` must not go on to empty a host."""
    itself = ["", ".", "./", "a/..", "a/../.", workdir, workdir + "/", workdir + "/.",
              workdir + "/a/.."]
    holders = ["..", "../..", "/", "//"]
    return ([(p, r) for p in itself for r in (True, False)]
            + [(p, False) for p in holders])


DELETE_PROVIDERS = {**COPY_PROVIDERS, "virtual": {"provider": "virtual"}}


@pytest.mark.docker
@pytest.mark.parametrize("kind", kinds(DELETE_PROVIDERS))
def test_the_working_directory_cannot_be_deleted_through_the_daemon(
    client: httpx.Client, kind: str, settings_of: Any
) -> None:
    sid = make(client, settings_of(kind))
    try:
        info = client.get(f"/v1/sandboxes/{sid}").json()
        workdir = info["workdir"]
        put = client.put(f"/v1/sandboxes/{sid}/files", params={"path": "kept.txt"},
                         content=b"still here")
        assert put.status_code == 204, put.text
        for path, recursive in _spellings(workdir):
            gone = client.delete(f"/v1/sandboxes/{sid}/files",
                                 params={"path": path, "recursive": str(recursive).lower()})
            assert gone.status_code == 400, (path, recursive, gone.text)
            assert gone.json()["error"]["code"] == "invalid_argument", gone.text
            assert "working directory" in gone.json()["error"]["message"]
        read = client.get(f"/v1/sandboxes/{sid}/files", params={"path": "kept.txt"})
        assert read.status_code == 200 and read.content == b"still here", read.text
        if DELETE_PROVIDERS[kind]["provider"] != "virtual":
            assert run(client, sid, "pwd && ls")["stdout"].split() == [workdir, "kept.txt"]
        # A directory inside it is still a file to delete.
        client.put(f"/v1/sandboxes/{sid}/files", params={"path": "sub/x"}, content=b"x")
        client.get(f"/v1/sandboxes/{sid}/files", params={"path": "sub/x"})
        gone = client.delete(f"/v1/sandboxes/{sid}/files",
                             params={"path": "sub/..//sub", "recursive": "true"})
        assert gone.status_code == 204, gone.text
    finally:
        client.delete(f"/v1/sandboxes/{sid}")


@pytest.mark.skipif(not sshd_available(), reason="no sshd here")
@pytest.mark.anyio
async def test_the_working_directory_cannot_be_deleted_over_ssh() -> None:
    server = shared_server()
    workdir = tempfile.mkdtemp(prefix="hutch-ssh-")
    try:
        async with await hutch.create_sandbox(
            "ssh", destination=ALIAS, config_file=server.config_file,
            working_directory=workdir, read_before_write=False,
        ) as sb:
            await sb.write_bytes("kept.txt", b"still here")
            for path, recursive in _spellings(workdir):
                with pytest.raises(hutch.InvalidArgument, match="working directory"):
                    await sb.remove(path, recursive=recursive)
            assert await sb.read_bytes("kept.txt") == b"still here"
            assert (await sb.exec("pwd")).stdout.strip() == workdir
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
