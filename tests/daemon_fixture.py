"""A real ``hutch serve`` process on a free loopback port, for tests."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import time
import weakref
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING

import httpx
import pytest

from hutch._paths import token_file_path
from hutch.providers import _mounts
from hutch.providers._diskcap import unescape_raw

if TYPE_CHECKING:
    import hutch

#: Every daemon made and not yet closed: tests/conftest.py closes those a test
#: left when the test (or its module, or the session) that made them ends.
OPEN: weakref.WeakSet[DaemonProcess] = weakref.WeakSet()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def end_everything(c: hutch.Client, *, force: bool) -> None:
    """Delete a daemon's workspaces, sandboxes, then snapshots, leaves first
    (a parent is refused while a child names it)."""
    for ws in c.list_workspaces():
        c.delete_workspace(ws["name"])
    for sb in c.list_sandboxes():
        c.delete_sandbox(sb["id"])
    for _ in range(20):
        snapshots = c.snapshots()
        if not snapshots:
            break
        parents = {s.parent_id for s in snapshots}
        for s in snapshots:
            if s.id not in parents:
                c.delete_snapshot(s.id, force=force)


class DaemonProcess:
    """Start, kill (SIGKILL as a crash would) and restart the daemon on one data dir."""

    #: Every data directory a daemon of this test run used (the run's own
    #: snapshot storage is labelled with them; conftest checks it at the end).
    data_dirs: list[str] = []

    def __init__(
        self,
        data_dir: str | None = None,
        token: str | None = "test-token",
        *,
        provider: str | None = "local",
        extra_args: Sequence[str] = (),
        extra_env: Mapping[str, str] | None = None,
        log_path: str | None = None,
        for_session: bool = False,
    ) -> None:
        self.data_dir = data_dir or tempfile.mkdtemp(prefix="hutch-daemon-")
        DaemonProcess.data_dirs.append(self.data_dir)
        #: None: the operator gives none, and the daemon makes its own (read
        #: from its data directory once it has started).
        self.configured_token = token
        self.token = token or ""
        #: The operator's default provider (``--provider``): ``local``, so that
        #: the tests' requests that name none (and those naming local) are
        #: served as they were; None leaves the daemon's own choice (or the
        #: config file's).
        self.provider = provider
        self.extra_env = dict(extra_env or {})
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None
        #: More ``hutch.server`` flags (``--retention 2``).
        self.extra_args = list(extra_args)
        #: What the daemon's command runs under (``unshare ...``), if anything.
        self.launcher: list[str] = []
        self.log_path = log_path or os.path.join(self.data_dir, "daemon.log")
        self.closed = False
        #: Shared by the whole run (made on first use): closed when the run ends,
        #: not when the test or module that happened to make it does.
        self.for_session = for_session
        OPEN.add(self)

    def start(self, timeout: float = 120) -> DaemonProcess:
        # Its log's directory may be gone: a failed test's cleanup removed it
        # before the module's teardown starts the daemon again to close it.
        os.makedirs(os.path.dirname(self.log_path), exist_ok=True)
        log = open(self.log_path, "ab")  # noqa: SIM115 - kept open for the child
        # The token goes in the environment: a command line is every user's to read.
        provider = ["--provider", self.provider] if self.provider else []
        self.proc = subprocess.Popen(
            [*self.launcher, sys.executable, "-m", "hutch.server", "--host", "127.0.0.1",
             "--port", str(self.port), "--data-dir", self.data_dir, *provider,
             *self.extra_args],
            stdout=log, stderr=subprocess.STDOUT,
            env={**os.environ, "HUTCH_TOKEN": self.configured_token or "", **self.extra_env},
        )
        deadline = time.monotonic() + timeout
        # One client for every probe: making one costs more than a probe.
        with httpx.Client(timeout=1) as http:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"daemon exited at start:\n{self.log()}")
                if self.configured_token is None:
                    self.token = made_token(self.data_dir) or ""
                try:
                    answer = http.get(f"{self.url}/healthz",
                                      headers={"Authorization": f"Bearer {self.token}"})
                    if answer.status_code == 200:
                        return self
                except httpx.TransportError:
                    pass
                time.sleep(0.05)
        raise RuntimeError(f"daemon did not answer in {timeout} s:\n{self.log()}")

    def kill(self) -> None:
        """SIGKILL: no cleanup runs, as after a crash."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
        self.proc = None

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()
        self.proc = None

    def remove_everything(self) -> None:
        """End what this daemon holds: workspaces, sandboxes, then snapshots,
        leaves first (sandboxes outlive a daemon's stop by design, and a
        snapshot outlives its sandbox). Starts it first if it was killed."""
        import hutch

        if self.proc is None:
            self.start()
        with hutch.Client(self.url, token=self.token) as c:
            end_everything(c, force=True)

    def close(self) -> None:
        """End everything this daemon holds and remove its data directory, as
        a test's teardown must: sandboxes outlive a daemon's stop by design,
        and a SIGKILLed one leaves its containers, mounts and processes. A
        daemon that is down but left something is started again on the same
        data directory (its start adopts or reaps what the dead one left),
        emptied through the API and stopped. Idempotent."""
        if self.closed:
            return
        self.closed = True
        OPEN.discard(self)
        try:
            if self.proc is None and self._holds_something():
                with contextlib.suppress(RuntimeError):
                    self.start()
            if self.proc is not None:
                with contextlib.suppress(Exception):  # what stays is released below
                    self.remove_everything()
        finally:
            self.stop()
            release_leftovers(self.data_dir)
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def _holds_something(self) -> bool:
        """Whether the store names anything live, or the engine holds a container of ours."""
        db = os.path.join(self.data_dir, "hutch.db")
        if os.path.exists(db):
            try:
                with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as con:
                    live = con.execute(
                        "SELECT COUNT(*) FROM sandboxes WHERE state NOT IN "
                        "('terminated', 'failed')").fetchone()[0]
                    workspaces = con.execute("SELECT COUNT(*) FROM workspaces").fetchone()[0]
                    snapshots = con.execute("SELECT COUNT(*) FROM snapshots").fetchone()[0]
                if live or workspaces or snapshots:
                    return True
            except sqlite3.Error:
                return True  # cannot tell: the daemon's own start will
        return bool(containers_of(self.data_dir))

    def restart(self) -> DaemonProcess:
        self.kill()
        return self.start()

    def log(self) -> str:
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as fh:
                return fh.read()[-5000:]
        except OSError:
            return ""


def made_token(data_dir: str) -> str | None:
    """The token a daemon given none made in ``data_dir``, once it has."""
    try:
        with open(token_file_path(data_dir), encoding="utf-8") as fh:
            return fh.read().strip() or None
    except FileNotFoundError:
        return None


def containers_of(data_dir: str) -> list[str]:
    """The ids of the containers a daemon on ``data_dir`` made (its home label)."""
    if shutil.which("docker") is None:
        return []
    done = subprocess.run(
        ["docker", "ps", "-aq", "--filter", f"label=hutch.home={data_dir}"],
        capture_output=True, text=True, timeout=120, check=False,
    )
    return done.stdout.split() if done.returncode == 0 else []


def images_of(data_dir: str) -> list[str]:
    """The Docker images hutch built for the hutch home ``data_dir`` (a
    daemon's): tagged under that home's prefix, labelled as hutch's. The
    home's own record of them goes with the directory; these would stay."""
    if shutil.which("docker") is None:
        return []
    from hutch.providers.images import docker_tag

    with pytest.MonkeyPatch.context() as env:
        env.setenv("HUTCH_HOME", data_dir)
        prefix = docker_tag("x").removesuffix("x")
    done = subprocess.run(
        ["docker", "images", "--filter", "label=hutch.image=1",
         "--format", "{{.Repository}}:{{.Tag}}"],
        capture_output=True, text=True, timeout=120, check=False,
    )
    return [i for i in done.stdout.split() if i.startswith(prefix)] if done.returncode == 0 else []


def mounts_under(root: str) -> list[str]:
    """Mount points at or under ``root`` in this mount namespace, deepest first
    (also those whose directory was deleted while mounted)."""
    root = root.rstrip("/")
    found = []
    for mount in _mounts.mountinfo():
        point = mount.point.removesuffix("//deleted").removesuffix(" (deleted)")
        if point == root or point.startswith(root + "/"):
            found.append(point)
    return sorted(found, key=len, reverse=True)


def loops_under(root: str) -> list[tuple[str, str]]:
    """(device, backing file) of the loop devices backed by a file under ``root``."""
    done = subprocess.run(
        ["losetup", "--list", "--noheadings", "--raw", "--output", "NAME,BACK-FILE"],
        capture_output=True, text=True, timeout=60, check=False,
    )
    found = []
    for line in done.stdout.splitlines():
        device, _, back = line.partition(" ")
        back = unescape_raw(back).removesuffix(" (deleted)")
        if back.startswith(root.rstrip("/") + "/"):
            found.append((device, back))
    return found


def sandbox_processes(sandbox_id: str) -> list[int]:
    """This host's processes in a sandbox's cgroups (its keeper, its agent,
    its commands), by their cgroup path: ``.../hutch/<sandbox id>[/...]``."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cgroup", encoding="ascii") as fh:
                paths = [line.rstrip("\n").split(":", 2)[-1] + "/" for line in fh]
            if any(f"/hutch/{sandbox_id}/" in path for path in paths):
                found.append(int(entry))
        except OSError:
            continue  # ended meanwhile
    return found


def release_leftovers(root: str) -> list[str]:
    """The last resort after a daemon on ``root`` is gone: remove its
    containers, unmount what is mounted under it and detach the loop devices
    backed there. Returns what it had to do (nothing, when the daemon's own
    start and the API ended all it held)."""
    done = []
    for container in containers_of(root):
        subprocess.run(["docker", "rm", "-f", container], capture_output=True, timeout=120,
                       check=False)
        done.append(f"container {container}")
    if done:  # their network policy's host rules, which went with no close
        import docker

        from hutch.providers.docker import netguard as _dockernet

        _dockernet.sweep(docker.APIClient(), "hutch-")
    for image in images_of(root):
        subprocess.run(["docker", "rmi", "-f", image], capture_output=True, timeout=120,
                       check=False)
        done.append(f"image {image}")
    for point in mounts_under(root):
        if subprocess.run(["umount", point], capture_output=True, check=False).returncode:
            subprocess.run(["umount", "-l", point], capture_output=True, check=False)
        done.append(f"mount {point}")
    for device, back in loops_under(root):
        subprocess.run(["losetup", "--detach", device], capture_output=True, check=False)
        done.append(f"loop device {device} ({back})")
    return done


@pytest.fixture(name="daemon")
def cleaned_daemon() -> Iterator[DaemonProcess]:
    """A daemon for one test; whatever the test left on the engine (containers,
    images) goes with it, so later tests start from an empty engine."""
    d = DaemonProcess().start()
    yield d
    try:
        d.remove_everything()
    finally:
        d.close()


def client(d: DaemonProcess) -> hutch.Client:
    import hutch

    return hutch.Client(d.url, token=d.token)
