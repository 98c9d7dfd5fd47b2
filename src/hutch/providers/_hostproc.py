"""Processes on this host: spawn in a new session, read both pipes, and kill a
whole tree, for the providers whose commands run as host processes.

Every process hutch starts carries ``HUTCH_EXEC_ID`` (and ``HUTCH_SANDBOX_ID``)
in its environment. Children inherit it, so a kill finds the whole tree even
when a child left the process group (``setsid``, ``nohup ... &``), and the
lifecycle engine can count what is still running in a sandbox.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import pwd
import shutil
import signal
import subprocess
from collections.abc import Callable

from .._errors import (
    NoSuchUser,
    SandboxFileNotFound,
    SandboxPermissionDenied,
    StdinClosed,
)
from .._liveness import process_start_time
from .._types import OutputChunk
from ._pipes import OutputPipes
from ._proctree import ProcessTree
from ._signals import default_signals_prefix
from .base import EXEC_MARKER, SANDBOX_MARKER, BackendProcess, ProcessRequest

__all__ = ["EXEC_MARKER", "SANDBOX_MARKER", "HostProcess", "pids_with_env", "spawn"]


def pids_with_env(name: str, value: str) -> list[int]:
    """PIDs of host processes whose environment has ``name=value``."""
    needle = f"{name}={value}".encode()
    found: list[int] = []
    own = os.getpid()
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        if pid == own:
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as fh:
                env = fh.read()
        except OSError:
            continue
        if needle + b"\0" in env or env.endswith(needle):
            found.append(pid)
    return found


class HostProcess(BackendProcess):
    def __init__(
        self, proc: asyncio.subprocess.Process, exec_id: str, stdin: bytes | None,
        keep_stdin: bool = False, *, monitor: bool = False,
        held: Callable[[], bool] | None = None, cgroup: str | None = None,
    ) -> None:
        """``monitor``: ``proc`` is not the command but what runs it and ends
        with it (bwrap, whose child the command is); ``held``: whether its
        sandbox is frozen (see :meth:`ProcessTree.kill`); ``cgroup``: its
        sandbox's, where its kill looks for its processes (None: all of
        this host's)."""
        self._proc = proc
        # Read now, while the leader is certainly the command (the pid of a
        # child not yet reaped is not taken again): its kill tells its group
        # from a later one under the same number (see ProcessTree).
        self._leader_start = process_start_time(proc.pid)
        self._cgroup = cgroup
        self._monitor = monitor
        self._held = held
        #: Its end as settled by a kill in its frozen sandbox (the SIGKILL's,
        #: told before the kernel tells it, at the thaw); where it can be frozen.
        self._doomed: asyncio.Future[int] | None = (
            None if held is None else asyncio.get_running_loop().create_future())
        self._exec_id = exec_id
        assert proc.stdout is not None and proc.stderr is not None
        self._output = OutputPipes(proc.stdout, proc.stderr)
        #: What feeds the bytes given at the start (writes wait for it).
        self._fed: asyncio.Task[None] | None = None
        if stdin is not None or keep_stdin:
            self._fed = asyncio.get_running_loop().create_task(
                self._feed(stdin or b"", close=not keep_stdin))
            self._output.tasks.append(self._fed)

    async def _feed(self, data: bytes, *, close: bool) -> None:
        stdin = self._proc.stdin
        assert stdin is not None
        # A command that exits without reading its stdin is not an error.
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            if data:
                stdin.write(data)
                await stdin.drain()
        if close:
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                stdin.close()

    async def write_stdin(self, data: bytes) -> None:
        stdin = self._proc.stdin
        if stdin is None or self._fed is None:
            raise StdinClosed("this command's stdin is not a pipe hutch writes")
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.shield(self._fed)
        try:
            if stdin.is_closing():
                raise BrokenPipeError
            stdin.write(data)
            await stdin.drain()
        except (BrokenPipeError, ConnectionResetError):
            raise StdinClosed("the command has closed its stdin, or ended") from None

    async def close_stdin(self) -> None:
        stdin = self._proc.stdin
        if stdin is None:
            return
        if self._fed is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.shield(self._fed)
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            stdin.close()

    async def read(self) -> OutputChunk | None:
        return await self._output.read()

    async def wait(self) -> int:
        doomed = self._doomed
        if doomed is None or self._proc.returncode is not None:
            return signal_exit_code(await self._proc.wait())
        if not doomed.done():
            # Whichever is first: the kernel's end, or a kill's in its frozen sandbox.
            ended = asyncio.ensure_future(self._proc.wait())
            try:
                await asyncio.wait((ended, doomed), return_when=asyncio.FIRST_COMPLETED)
            finally:
                if not ended.done():
                    ended.cancel()
            if ended.done() and not ended.cancelled():
                return signal_exit_code(ended.result())
        return doomed.result()

    @property
    def returncode(self) -> int | None:
        code = self._proc.returncode
        if code is None and self._doomed is not None and self._doomed.done():
            return self._doomed.result()
        return None if code is None else signal_exit_code(code)

    async def kill(self, grace: float) -> None:
        # The whole tree, gone and reaped before this returns (see _proctree).
        # A monitor (bwrap) is spared: it reaps the command and ends with it,
        # where killed first it would leave the command's zombie to the host's init.
        leader = self._proc.pid
        tree = ProcessTree(
            f"{EXEC_MARKER}={self._exec_id}",
            group=None if self._monitor else leader,
            spare=leader if self._monitor else None,
            held=self._held,
            cgroup=self._cgroup,
            leader_start=self._leader_start,
        )
        doomed = False
        try:
            doomed = await tree.kill(grace)
        finally:
            if doomed:
                self._settle_doomed()
            else:
                await self._end_leader()

    def _settle_doomed(self) -> None:
        """The end of a command whose tree holds its SIGKILLs in a frozen
        sandbox: the SIGKILL's, told now, as its output's end (the thaw
        closes its pipes, whose readers have stopped; nothing of it is left
        running)."""
        assert self._doomed is not None  # a tree held only where it can be frozen
        if not self._doomed.done():
            self._doomed.set_result(128 + signal.SIGKILL)
        self._output.cancel()

    async def _end_leader(self) -> None:
        """After a kill (a tree gone, or what outlived it said): the end of its
        leader, and of its pipes."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._proc.wait(), 1 if self._monitor else 5)
        if self._proc.returncode is None:  # a monitor still setting up
            with contextlib.suppress(ProcessLookupError):
                self._proc.kill()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._proc.wait(), 5)
        # Its pipes to their end, so the subprocess's transport closes
        # (an escaped holder of one: given up after a second).
        await self._output.discard(1.0)


def signal_exit_code(code: int) -> int:
    """A subprocess's return code as a shell reports it: ``128 + N`` for one
    killed by signal N (Python says ``-N``), as every provider answers."""
    return 128 - code if code < 0 else code


async def spawn(request: ProcessRequest, *, exec_id: str) -> HostProcess:
    """Start ``request`` as a host process in a session of its own; its
    ``env`` is the whole environment it gets."""
    argv, cwd, stdin = list(request.argv), request.cwd, request.stdin
    if not os.path.isdir(cwd):
        raise SandboxFileNotFound(f"working directory {cwd} does not exist")
    # Through env(1) when this thread ignores or blocks a signal the command
    # would inherit (see _signals); found first, so a missing or unrunnable
    # command is the same error as without it.
    reset = default_signals_prefix()
    preexec: Callable[[], None] | None = None
    if reset and request.user is None:
        # Looked up only for the error: the command keeps its argv[0] as
        # given (ps, /proc/PID/cmdline), and env(1) finds it the same way.
        _found(argv[0], request.env.get("PATH", os.defpath), cwd)
        if "=" in argv[0]:  # env would read it as an assignment
            reset, preexec = [], _default_signals
    if request.user is not None:
        # setpriv (util-linux), not user= or preexec_fn: uvloop (the daemon's
        # loop) has no user=, and switches before it enters cwd.
        argv = [*_as_user(request.user), *argv]
    try:
        proc = await asyncio.create_subprocess_exec(
            *reset, *argv,
            cwd=cwd,
            env=dict(request.env),
            stdin=subprocess.PIPE if request.stdin_piped else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
            preexec_fn=preexec,
        )
    except PermissionError:
        raise SandboxPermissionDenied(f"cannot execute {argv[0]}: permission denied") from None
    except FileNotFoundError:
        raise SandboxFileNotFound(f"command not found: {argv[0]}") from None
    return HostProcess(proc, exec_id, stdin, request.keep_stdin)


def _found(command: str, path: str, cwd: str) -> str:
    """``command`` as exec would find it, or the error exec would give."""
    if "/" in command:
        found: str | None = os.path.join(cwd, command)
    else:
        found = shutil.which(command, mode=os.F_OK, path=path)
    if found is None or not os.path.exists(found):
        raise SandboxFileNotFound(f"command not found: {command}")
    if os.path.isdir(found) or not os.access(found, os.X_OK):
        raise SandboxPermissionDenied(f"cannot execute {command}: permission denied")
    return found


def _default_signals() -> None:
    signal.pthread_sigmask(signal.SIG_SETMASK, ())
    for signum in signal.valid_signals():
        with contextlib.suppress(OSError, ValueError):
            signal.signal(signum, signal.SIG_DFL)


def _as_user(user: str) -> list[str]:
    try:
        entry = pwd.getpwnam(user)
    except KeyError:
        raise NoSuchUser(f"no such user {user!r}") from None
    return [
        "setpriv", f"--reuid={entry.pw_uid}", f"--regid={entry.pw_gid}", "--init-groups", "--",
    ]
