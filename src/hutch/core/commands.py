"""A command run in a sandbox, as the sandbox hands it to its runtime: what
was asked (:class:`ExecCall`), checked and resolved into the runtime's
:class:`~hutch.providers.base.ProcessRequest`, and the background commands
kept once they end.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .._errors import ExecTimeout, InvalidArgument
from .._process import release_output
from .._sandbox_paths import sandbox_path
from .._types import Command, ExitStatus
from .._values import check_command, check_text
from ..providers.base import ProcessRequest

if TYPE_CHECKING:
    from .._process import Process, StreamEvent
    from ..providers.base import SandboxRuntime

#: How long an ended background command (and its output) is kept, seconds.
FINISHED_PROCESS_RETENTION = 600.0
#: The most ended background commands one sandbox keeps.
MAX_FINISHED_PROCESSES = 64


@dataclass(frozen=True)
class ExecCall:
    """A command as ``Sandbox.exec``, ``start`` and ``exec_stream`` are asked
    to run it (``timeout`` is exec's and exec_stream's only)."""

    cmd: Command
    cwd: str | None = None
    env: Mapping[str, str] | None = None
    stdin: bytes | str | None = None
    user: str | None = None
    timeout: float | None = None
    output_limit: int | None = None
    #: ``start``'s: its stdin stays open after ``stdin`` (see ``Sandbox.start``).
    keep_stdin: bool = False


def command_argv(runtime: SandboxRuntime, cmd: Command) -> list[str]:
    """The argv ``cmd`` runs as: a string through the runtime's shell."""
    if isinstance(cmd, str):
        if not cmd.strip():
            raise InvalidArgument("command is empty")
        return runtime.shell_argv(cmd)
    argv = list(cmd)
    if not argv or not all(isinstance(a, str) for a in argv):
        raise InvalidArgument("command must be a non-empty string or list of strings")
    return argv


def process_request(runtime: SandboxRuntime, workdir: str, call: ExecCall) -> ProcessRequest:
    """A command as a runtime is given it, every part checked first
    (text a program can be given, within the kernel's limits)."""
    argv = command_argv(runtime, call.cmd)
    variables = dict(call.env or {})
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in variables.items()):
        raise InvalidArgument("env must map names to strings")
    check_command(argv, variables)
    user, stdin = call.user, call.stdin
    if user is not None:
        if not isinstance(user, str) or not user:
            raise InvalidArgument("user must be a user name or uid (a string)")
        check_text(user, "user")
    if isinstance(stdin, str):
        check_text(stdin, "stdin", nul=False)
        stdin = stdin.encode()
    elif stdin is not None and not isinstance(stdin, bytes | bytearray | memoryview):
        raise InvalidArgument(f"stdin must be bytes or text, not {type(stdin).__name__}")
    return ProcessRequest(
        argv,
        cwd=sandbox_path(workdir, call.cwd) if call.cwd is not None else workdir,
        env=variables,
        stdin=bytes(stdin) if stdin is not None else None,
        user=user,
        keep_stdin=call.keep_stdin,
    )


async def events_until_exit(
    process: Process, timeout: float | None
) -> AsyncGenerator[StreamEvent, None]:
    """A started command's output as it comes, then its exit status; past
    ``timeout`` seconds its whole process tree is killed (``ExecTimeout``)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    stream = process.stream()
    while True:
        remaining = None if deadline is None else deadline - time.monotonic()
        try:
            event = await asyncio.wait_for(anext(stream), remaining)
        except StopAsyncIteration:
            return
        except TimeoutError:
            await process.kill()
            raise ExecTimeout(
                f"command timed out after {timeout} s; its whole process tree was killed"
            ) from None
        yield event
        if isinstance(event, ExitStatus):
            return


def forget_finished(processes: dict[str, Process]) -> None:
    """Drop ended background commands past their retention, or past the
    most kept, oldest first: their output is not held for ever."""
    ended = sorted(
        (p for p in processes.values() if p.ended_at is not None),
        key=lambda p: p.ended_at or 0.0,
    )
    cutoff = time.monotonic() - FINISHED_PROCESS_RETENTION
    excess = len(ended) - MAX_FINISHED_PROCESSES
    for index, process in enumerate(ended):
        if index < excess or (process.ended_at or 0.0) < cutoff:
            processes.pop(process.id, None)
            release_output(process)
