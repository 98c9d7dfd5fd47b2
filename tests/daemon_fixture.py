"""A real ``hutch serve`` process on a free loopback port, for tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence

import httpx


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class DaemonProcess:
    """Start, kill (SIGKILL as a crash would) and restart the daemon on one data dir."""

    #: Every data directory a daemon of this test run used (the run's own
    #: snapshot storage is labelled with them; conftest checks it at the end).
    data_dirs: list[str] = []

    def __init__(
        self,
        data_dir: str | None = None,
        token: str = "test-token",
        *,
        extra_args: Sequence[str] = (),
        extra_env: Mapping[str, str] | None = None,
        log_path: str | None = None,
    ) -> None:
        self.data_dir = data_dir or tempfile.mkdtemp(prefix="hutch-daemon-")
        DaemonProcess.data_dirs.append(self.data_dir)
        self.token = token
        self.extra_env = dict(extra_env or {})
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None
        #: More ``hutch.server`` flags (``--retention 2``).
        self.extra_args = list(extra_args)
        self.log_path = log_path or os.path.join(self.data_dir, "daemon.log")

    def start(self, timeout: float = 30) -> DaemonProcess:
        log = open(self.log_path, "ab")  # noqa: SIM115 - kept open for the child
        # The token goes in the environment: a command line is every user's to read.
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "hutch.server", "--host", "127.0.0.1",
             "--port", str(self.port), "--data-dir", self.data_dir, *self.extra_args],
            stdout=log, stderr=subprocess.STDOUT,
            env={**os.environ, "HUTCH_TOKEN": self.token, **self.extra_env},
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited at start:\n{self.log()}")
            try:
                answer = httpx.get(f"{self.url}/healthz", timeout=1,
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
                        c.delete_snapshot(s.id, force=True)

    def restart(self) -> DaemonProcess:
        self.kill()
        return self.start()

    def log(self) -> str:
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as fh:
                return fh.read()[-5000:]
        except OSError:
            return ""
