"""The native runtime of a bubblewrap sandbox: exec by joining its keeper's
namespaces, files through the overlay resolved inside its root.

An exec is ``sh`` (join the sandbox's cgroups) -> ``nsenter`` (its net, ipc,
uts and cgroup namespaces, by descriptors checked against the keeper's
recorded inodes, so a reused PID can never lead elsewhere) -> ``bwrap``
(its PID namespace, the overlay as ``/``, a fresh /proc and /dev, no
capabilities, NoNewPrivs, the seccomp filter, a new session). It joins the
running sandbox: it sees the keeper's processes, shares its loopback and
files, and its orphans are reaped by the sandbox's own init.

bwrap says on its ``--json-status-fd`` that the command's process exists
(``child-pid``, right after its clone) and, when it ends, its exit code
(``exit-code``), which bwrap writes only if its setup of the sandbox
finished and the command was executed. An exec whose pipe closes without
the first never started; one that ends without the second failed in
bwrap's setup (a working directory it cannot enter, a mount that failed):
either way its stderr (bwrap's, not the command's) says why, as an error,
never as the command's exit 1 with bwrap's words for its output. A fork the
pids limit refuses (EAGAIN) is ``resource_exhausted``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import os
import posixpath
import subprocess
import uuid
from dataclasses import dataclass, field

from ..._errors import (
    HutchError,
    NoSuchUser,
    ProviderError,
    ResourceExhausted,
    SandboxFileNotFound,
    SandboxPermissionDenied,
    SandboxUnavailable,
)
from ..._types import OutputChunk
from .._hostproc import EXEC_MARKER, SANDBOX_MARKER, HostProcess
from .._signals import default_signals_prefix
from ..agent import workload as _workload
from ..agent.runtime import AgentRuntime, Recover
from ..base import BackendProcess, FilesRuntime, ProcessRequest, PtyProcess, SandboxRuntime
from . import userns
from .cgroups import JOIN_AND_EXEC, SandboxCgroup
from .files import CrossesLayers, RootFiles
from .provisioning import (
    KEEPER_MARKER,
    Keeper,
    Layers,
    capability_args,
    proc_args,
    seccomp_fd,
)

DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
#: Seconds an exec has to start its command (bwrap to clone it), and then
#: to exit and say why, when it did not.
START_TIMEOUT = 60.0
#: How C's strerror says EAGAIN: what bwrap prints when the kernel refuses its fork.
EAGAIN_TEXT = os.strerror(errno.EAGAIN)


@dataclass
class SandboxParts:
    """What the provisioning half owns and the runtime uses."""

    layers: Layers
    cgroup: SandboxCgroup
    keeper: Keeper | None
    env: dict[str, str] = field(default_factory=dict)


class OomWatch(BackendProcess):
    """A command in the sandbox, whichever runtime runs it; a kill by the OOM
    killer is said as such (``oom_killed``, and a line on stderr)."""

    def __init__(self, inner: BackendProcess, cgroup: SandboxCgroup) -> None:
        self._inner = inner
        self._cgroup = cgroup
        self._oom_kills_before = cgroup.oom_kills()
        self._ended = False
        self._oom_killed = False

    @property
    def oom_killed(self) -> bool:
        return self._oom_killed

    @property
    def returncode(self) -> int | None:
        return self._inner.returncode

    async def wait(self) -> int:
        return await self._inner.wait()

    async def kill(self, grace: float) -> None:
        await self._inner.kill(grace)

    async def write_stdin(self, data: bytes) -> None:
        await self._inner.write_stdin(data)

    async def close_stdin(self) -> None:
        await self._inner.close_stdin()

    async def read(self) -> OutputChunk | None:
        chunk = await self._inner.read()
        if chunk is None and not self._ended:
            self._ended = True
            code = await self._inner.wait()
            if code == 128 + 9 and await asyncio.to_thread(
                _workload.oom_counted_since, self._cgroup.oom_kills, self._oom_kills_before
            ):
                self._oom_killed = True
                limit = self._cgroup.memory_limit()
                said = f" of {limit} bytes" if limit is not None else ""
                return OutputChunk(
                    "stderr",
                    f"hutch: killed by the OOM killer: the sandbox reached its memory "
                    f"limit{said}\n".encode(),
                )
        return chunk


class PtyOomWatch(OomWatch, PtyProcess):
    """A command on a pseudo-terminal, watched as :class:`OomWatch` watches
    any: what is typed and the window's size still reach its terminal."""

    def __init__(self, inner: PtyProcess, cgroup: SandboxCgroup) -> None:
        super().__init__(inner, cgroup)
        self._terminal = inner

    async def write(self, data: bytes) -> None:
        await self._terminal.write(data)

    async def resize(self, rows: int, cols: int) -> None:
        await self._terminal.resize(rows, cols)


class BwrapStatus:
    """bwrap's ``--json-status-fd``, read as it comes: one JSON object a line."""

    def __init__(self, reader: asyncio.StreamReader, transport: asyncio.BaseTransport) -> None:
        self._reader = reader
        self._transport = transport
        self._said = b""

    @classmethod
    async def open(cls, fd: int) -> BwrapStatus:
        """Read ``fd`` (taken)."""
        reader = asyncio.StreamReader()
        loop = asyncio.get_running_loop()
        transport, _ = await loop.connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(fd, "rb", buffering=0)
        )
        return cls(reader, transport)

    async def _said_before_end(self, key: bytes) -> bool:
        while f'"{key.decode()}"'.encode() not in self._said:
            line = await self._reader.readline()
            if not line:
                return False
            self._said += line
        return True

    async def started(self) -> bool:
        """Whether bwrap cloned the command's process (False: it ended first)."""
        try:
            return await asyncio.wait_for(self._said_before_end(b"child-pid"), START_TIMEOUT)
        except TimeoutError:
            raise ProviderError("bwrap did not start the command in time") from None

    async def ran(self) -> bool:
        """Whether the command was executed (bwrap's setup finished): known
        once bwrap ends, which it does as the command does."""
        try:
            return await self._said_before_end(b"exit-code")
        finally:
            self.close()

    def close(self) -> None:
        self._transport.close()


class CommandRan(BackendProcess):
    """A native exec after bwrap cloned its process: its end says whether the
    command ran at all; when bwrap's setup failed instead, the output (bwrap's
    words on stderr) and the exit status (bwrap's 1) are not the command's,
    and the exec fails with what bwrap said."""

    def __init__(self, inner: HostProcess, status: BwrapStatus, name: str,
                 sandbox_id: str) -> None:
        self._inner = inner
        self._status = status
        self._name = name
        self._sandbox_id = sandbox_id
        self._stderr_tail = b""
        self._ran: bool | None = None
        self._killed = False

    @property
    def returncode(self) -> int | None:
        return self._inner.returncode

    async def _check_ran(self) -> None:
        if self._ran is None:
            self._ran = await self._status.ran()
        # bwrap ended without a word of the command: its setup failed, and it
        # said why. Killed (a kill, a timeout, the OOM killer on bwrap itself),
        # it says nothing, and the status it ends with is the kill's.
        if not self._ran and not self._killed and self._stderr_tail.strip():
            raise not_started_error(
                self._name, self._sandbox_id, self._stderr_tail, self._inner.returncode
            )

    async def read(self) -> OutputChunk | None:
        chunk = await self._inner.read()
        if chunk is None:
            await self._check_ran()
        elif chunk.stream == "stderr":
            self._stderr_tail = (self._stderr_tail + chunk.data)[-4000:]
        return chunk

    async def wait(self) -> int:
        code = await self._inner.wait()
        await self._check_ran()
        return code

    async def kill(self, grace: float) -> None:
        self._killed = True
        try:
            await self._inner.kill(grace)
        finally:
            self._status.close()

    async def write_stdin(self, data: bytes) -> None:
        await self._inner.write_stdin(data)

    async def close_stdin(self) -> None:
        await self._inner.close_stdin()


def not_started_error(name: str, sandbox_id: str, said: bytes, status: int | None) -> HutchError:
    """The error of an exec whose command never ran, from what bwrap (or the
    join before it) printed as it ended."""
    why = said.decode(errors="replace").strip()[-2000:]
    if EAGAIN_TEXT in why:
        # The kernel refused bwrap's fork: the pids limit is reached.
        return ResourceExhausted(
            f"cannot start {name}: sandbox {sandbox_id} is at its pids limit "
            f"({why}); it starts once a process in the sandbox ends"
        )
    return ProviderError(
        f"cannot start {name} in sandbox {sandbox_id}: {why or f'exit status {status}'}"
    )


class AgentWithNativeUsers(AgentRuntime):
    """hutch's agent as the runtime, but for ``user=``: the agent runs with no
    capabilities (it cannot switch users), so a command as another user goes
    through the native path (``setpriv``, given CAP_SETUID for that one exec)."""

    def __init__(self, native: BubblewrapRuntime, socket_path: str, recover: Recover) -> None:
        super().__init__(
            native.sandbox_id, native.workdir, socket_path, provider_name="bubblewrap",
            recover=recover, frozen=lambda: native.parts.cgroup.frozen(), signals_here=True,
            cgroup=lambda: native.parts.cgroup.root(),
        )
        self._native = native

    def shell_argv(self, command: str) -> list[str]:
        return self._native.shell_argv(command)

    async def start_process(  # type: ignore[override]
        self, request: ProcessRequest, pty: tuple[int, int] | None = None
    ) -> BackendProcess:
        if request.user is not None and pty is None:
            return await self._native.start_process(request)
        request = dataclasses.replace(request, env={**self._native.parts.env, **request.env})
        inner = await super().start_process(request, pty=pty)
        if isinstance(inner, PtyProcess):
            return PtyOomWatch(inner, self._native.parts.cgroup)
        return OomWatch(inner, self._native.parts.cgroup)


class BubblewrapRuntime(FilesRuntime):
    provider = "bubblewrap"
    watch_kind = "inotify"

    async def rename(self, source: str, destination: str) -> None:
        try:
            await self.files.rename(source, destination)
        except CrossesLayers:
            # A directory of the image: mv in the sandbox copies it.
            await SandboxRuntime.rename(self, source, destination)

    def __init__(self, sandbox_id: str, workdir: str, parts: SandboxParts) -> None:
        super().__init__(sandbox_id, workdir)
        self.parts = parts
        self.files: RootFiles = RootFiles(
            lambda: parts.layers.merged_view, self._check_view, self._owner
        )
        self._shell: str | None = None

    def _owner(self) -> tuple[int, int] | None:
        """Root inside, as the host's ids: who owns what hutch makes there
        (none to shift to in a keeper started before user namespaces)."""
        keeper = self.parts.keeper
        if keeper is None or "user" not in keeper.namespaces:
            return None
        return userns.id_range().root

    def _check_view(self) -> None:
        if self.parts.keeper is None:
            raise SandboxUnavailable(f"sandbox {self.sandbox_id} is not running")
        self.parts.keeper.check_view()

    # -- processes ---------------------------------------------------------------
    def shell_argv(self, command: str) -> list[str]:
        if self._shell is None:
            try:
                root = self.parts.layers.merged_view
            except SandboxUnavailable:
                return ["bash", "-c", command]
            self._shell = "bash" if any(
                os.path.lexists(f"{root}{d}/bash") for d in ("/bin", "/usr/bin")
            ) else "sh"
        return [self._shell, "-c", command]

    async def _is_dir(self, path: str) -> bool:
        try:
            with self.files.open_path(path) as fd:
                return os.path.isdir(f"/proc/self/fd/{fd}")
        except OSError:
            return False

    async def _check_command(self, name: str, cwd: str, path_env: str) -> None:
        """What execve would say, said before the sandbox is entered: a missing
        command is file_not_found, a non-executable one permission_denied."""
        if "/" in name:
            candidates = [posixpath.normpath(posixpath.join(cwd, name))]
        else:
            candidates = [posixpath.join(d or ".", name) for d in path_env.split(":")]
            candidates = [c if c.startswith("/") else posixpath.join(cwd, c) for c in candidates]
        denied = False
        for candidate in candidates:
            try:
                with self.files.open_path(candidate) as fd:
                    st = os.fstat(fd)
            except OSError:
                continue
            if (st.st_mode & 0o170000) == 0o100000 and st.st_mode & 0o111:
                return
            denied = True
        if denied:
            raise SandboxPermissionDenied(f"cannot execute {name}: permission denied")
        raise SandboxFileNotFound(f"command not found: {name}")

    async def _user_ids(self, user: str) -> tuple[int, int]:
        try:
            passwd = (await self.files.read_file("/etc/passwd", 16 * 1024 * 1024)).decode(
                errors="replace"
            )
        except FileNotFoundError:
            passwd = ""
        for line in passwd.splitlines():
            fields = line.split(":")
            if len(fields) >= 4 and (fields[0] == user or fields[2] == user):
                return int(fields[2]), int(fields[3])
        raise NoSuchUser(f"no such user {user!r} in sandbox {self.sandbox_id}")

    async def start_process(self, request: ProcessRequest) -> BackendProcess:
        argv, cwd, stdin, user = request.argv, request.cwd, request.stdin, request.user
        keeper = self.parts.keeper
        if keeper is None:
            raise SandboxUnavailable(f"sandbox {self.sandbox_id} is not running")
        full_env = {"PATH": DEFAULT_PATH, "HOME": "/root", "LANG": "C.UTF-8"}
        full_env.update(self.parts.env)
        full_env.update(request.env)
        exec_id = uuid.uuid4().hex
        full_env[EXEC_MARKER] = exec_id
        full_env[SANDBOX_MARKER] = self.sandbox_id
        if not await self._is_dir(cwd):
            raise SandboxFileNotFound(f"working directory {cwd} does not exist")
        await self._check_command(argv[0], cwd, full_env["PATH"])
        prefix: list[str] = []
        caps: list[str] = []
        if user is not None:
            uid, gid = await self._user_ids(user)
            # setpriv (util-linux) inside the sandbox drops to the user; its
            # setuid away from 0 clears every capability it was given for that.
            await self._check_command("setpriv", "/", DEFAULT_PATH)
            prefix = ["setpriv", f"--reuid={uid}", f"--regid={gid}", "--init-groups", "--"]
            caps = ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
            if uid != 0:
                full_env["HOME"] = "/"
        namespaces = keeper.open_namespaces()
        try:
            setup_mount = keeper.open_setup_mount()
        except SandboxUnavailable:
            for fd in namespaces.values():
                os.close(fd)
            raise
        filter_fd = seccomp_fd()
        started_read, started_write = os.pipe()
        fds = [*namespaces.values(), setup_mount, filter_fd, started_write]
        try:
            setenv: list[str] = []
            for key, value in full_env.items():
                setenv += ["--setenv", key, value]
            command = [
                "/bin/sh", "-c", JOIN_AND_EXEC, "hutch-exec",
                "nsenter",
                *(f"--{name}=/proc/self/fd/{namespaces[name]}"
                  for name in ("net", "ipc", "uts", "cgroup")),
                # The private mount namespace where the overlay is mounted.
                f"--mount=/proc/self/fd/{setup_mount}",
                # The user namespace last (nsenter enters it after the
                # others), as root there: see enter_user_namespace.
                *([f"--user=/proc/self/fd/{namespaces['user']}"] if "user" in namespaces else []),
                "--",
                # No --die-with-parent: joining a pid namespace, bwrap forks
                # once more and the parent exits at once, so the command's
                # parent is that passing process; armed, the command was
                # killed whenever that exit came after its start (exit 137,
                # about 1 exec in 400 under load). The command ends with its
                # sandbox's init (the keeper's) all the same.
                "bwrap", "--pidns", str(namespaces["pid"]),
                "--bind", self.parts.layers.merged, "/", *proc_args(), "--dev", "/dev",
                *capability_args(), *caps, "--new-session",
                "--seccomp", str(filter_fd), "--json-status-fd", str(started_write),
                "--clearenv", *setenv, "--chdir", cwd,
                "--", *prefix, *argv,
            ]
            host_env = {
                "PATH": "/usr/sbin:/usr/bin:/sbin:/bin",
                "HUTCH_CGROUP_PROCS": self.parts.cgroup.procs_files(),
                EXEC_MARKER: exec_id,
                SANDBOX_MARKER: self.sandbox_id,
            }
            try:
                proc = await asyncio.create_subprocess_exec(
                    *default_signals_prefix(), *command,
                    cwd="/",
                    env=host_env,
                    stdin=subprocess.PIPE if request.stdin_piped else subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    start_new_session=True,
                    pass_fds=fds,
                )
            except BaseException:
                os.close(started_read)
                raise
        finally:
            for fd in fds:
                os.close(fd)
        process = HostProcess(proc, exec_id, stdin, request.keep_stdin, monitor=True,
                              held=self.parts.cgroup.frozen, cgroup=self.parts.cgroup.root())
        try:
            status = await BwrapStatus.open(started_read)
        except BaseException:
            os.close(started_read)
            await process.kill(0)
            raise
        try:
            started = await status.started()
        except BaseException:
            status.close()
            await process.kill(0)
            raise
        if not started:
            status.close()
            raise await self._not_started(argv[0], process)
        return OomWatch(CommandRan(process, status, argv[0], self.sandbox_id), self.parts.cgroup)

    async def _not_started(self, name: str, process: HostProcess) -> HutchError:
        """Why an exec never started its command: what bwrap (or the join
        before it) printed as it ended."""
        said = b""

        async def ended() -> int:
            nonlocal said
            while (chunk := await process.read()) is not None:
                said += chunk.data if chunk.stream == "stderr" else b""
            return await process.wait()

        try:
            status = await asyncio.wait_for(ended(), START_TIMEOUT)
        except TimeoutError:
            await process.kill(0)
            status = None
        return not_started_error(name, self.sandbox_id, said, status)

    async def count_busy_processes(self) -> int:
        keeper = self.parts.keeper
        if keeper is None:
            return 0
        return _count_busy(self.parts.cgroup.pids(), {keeper.outer_pid, keeper.init_pid})


def _count_busy(pids: list[int], keeper_pids: set[int]) -> int:
    """Live processes among ``pids`` other than the keeper's (its outer bwrap,
    its init, and the shell that carries the keeper marker)."""
    busy = 0
    marker = f"{KEEPER_MARKER}=1".encode()
    for pid in pids:
        if pid in keeper_pids:
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as fh:
                environ = fh.read()
            with open(f"/proc/{pid}/stat", "rb") as fh:
                stat = fh.read()
        except OSError:
            continue
        if marker in environ.split(b"\0") or stat[stat.rindex(b")") + 2:][:1] == b"Z":
            continue
        busy += 1
    return busy
