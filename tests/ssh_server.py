"""A real OpenSSH server on a loopback port, for the ssh provider's tests.

Everything lives in a temporary directory: a generated host key, a generated
user key (authorized for this machine's current user), a known_hosts file that
trusts the host key, and an ssh config file whose ``Host`` alias points at the
server. The machine's own sshd configuration and service are never touched
(scripts/ensure-sshd.sh installs the binary).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import getpass
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time

SSHD = "/usr/sbin/sshd"
ALIAS = "hutch-test-host"


def sshd_available() -> bool:
    return os.path.exists(SSHD) and shutil.which("ssh-keygen") is not None


def _die_with_parent() -> None:
    # A test run killed outright (no atexit) must not leave sshd listening.
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _keygen(path: str) -> str:
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "hutch-test", "-f", path],
        check=True,
    )
    with open(path + ".pub") as fh:
        return fh.read().strip()


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out: list[int] = []
    todo = [root]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


class SshServer:
    """One sshd on 127.0.0.1, started and stopped by the tests."""

    def __init__(self, *, max_sessions: int | None = None) -> None:
        self.dir = tempfile.mkdtemp(prefix="hutch-sshd-")
        os.chmod(self.dir, 0o700)
        self.port = _free_port()
        self.user = getpass.getuser()
        self.host_key = os.path.join(self.dir, "host_ed25519")
        self.user_key = os.path.join(self.dir, "user_ed25519")
        self.other_key = os.path.join(self.dir, "other_ed25519")
        self.known_hosts = os.path.join(self.dir, "known_hosts")
        self.config_file = os.path.join(self.dir, "ssh_config")
        self.sshd_config = os.path.join(self.dir, "sshd_config")
        self._proc: subprocess.Popen[bytes] | None = None

        host_pub = _keygen(self.host_key)
        user_pub = _keygen(self.user_key)
        _keygen(self.other_key)  # a key the server does not accept
        with open(os.path.join(self.dir, "authorized_keys"), "w") as fh:
            fh.write(user_pub + "\n")
        with open(self.known_hosts, "w") as fh:
            fh.write(f"[127.0.0.1]:{self.port} {host_pub}\n")
        with open(self.sshd_config, "w") as fh:
            fh.write(
                f"Port {self.port}\n"
                "ListenAddress 127.0.0.1\n"
                f"HostKey {self.host_key}\n"
                f"PidFile {self.dir}/sshd.pid\n"
                f"AuthorizedKeysFile {self.dir}/authorized_keys\n"
                "PubkeyAuthentication yes\n"
                "PasswordAuthentication no\n"
                "KbdInteractiveAuthentication no\n"
                "PermitRootLogin prohibit-password\n"
                "UsePAM no\n"
                "StrictModes no\n"
                "MaxStartups 100:30:200\n"
                "Subsystem sftp internal-sftp\n"
                # bash sources ~/.bashrc for a command run by sshd only at
                # SHLVL 1: this machine's root .bashrc (pyenv, cargo) costs
                # 0.3-1 s a command, which is the host's and not what we test.
                "SetEnv SHLVL=1\n"
                "LogLevel ERROR\n"
                # MaxSessions stays at sshd's default (10), as on real hosts.
                + (f"MaxSessions {max_sessions}\n" if max_sessions else "")
            )
        self.write_client_config(self.config_file, self.user_key)

    def write_client_config(self, path: str, identity: str, *, alias: str = ALIAS) -> str:
        with open(path, "w") as fh:
            fh.write(
                f"Host {alias}\n"
                "  HostName 127.0.0.1\n"
                f"  Port {self.port}\n"
                f"  User {self.user}\n"
                f"  IdentityFile {identity}\n"
                f"  UserKnownHostsFile {self.known_hosts}\n"
            )
        return path

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def start(self) -> SshServer:
        # sshd's privilege-separation directory (what the service unit makes).
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)
        self._proc = subprocess.Popen(
            [SSHD, "-D", "-e", "-f", self.sshd_config],
            stdout=subprocess.DEVNULL,
            stderr=open(os.path.join(self.dir, "sshd.log"), "ab"),  # noqa: SIM115
            start_new_session=True,
            preexec_fn=_die_with_parent,  # started from the main thread, which outlives it
        )
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                with open(os.path.join(self.dir, "sshd.log")) as fh:
                    raise RuntimeError(f"sshd exited: {fh.read()}")
            with contextlib.suppress(OSError), socket.create_connection(
                ("127.0.0.1", self.port), timeout=1
            ) as s:
                if s.recv(4).startswith(b"SSH-"):
                    return self
            time.sleep(0.05)
        raise RuntimeError("sshd did not start listening")

    def kill_all(self) -> None:
        """Kill the listener and every per-connection sshd it forked: what a
        crash or a host reboot looks like to the client."""
        if self._proc is None:
            return
        # Each connection's sshd calls setsid, so a process-group kill misses
        # them: walk the tree down from the listener instead.
        for pid in [self._proc.pid, *_descendants(self._proc.pid)]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self._proc.wait()
        self._proc = None

    def stop(self) -> None:
        self.kill_all()

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


_shared: SshServer | None = None


def shared_server() -> SshServer:
    """One sshd for the whole test session (started on first use)."""
    global _shared
    if _shared is None:
        if not sshd_available():
            raise RuntimeError(
                f"the ssh tests need OpenSSH's server at {SSHD}: run scripts/ensure-sshd.sh"
            )
        _shared = SshServer().start()
        atexit.register(_shared.cleanup)
    return _shared


def close_shared() -> None:
    """End the session's sshd (the run's end does, before it checks what is left)."""
    global _shared
    if _shared is not None:
        _shared.cleanup()
        _shared = None
