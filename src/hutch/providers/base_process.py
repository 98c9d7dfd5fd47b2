"""The process half of the provider seam: what a runtime's started command
is (:class:`BackendProcess`, and :class:`PtyProcess` on a terminal), what
starting one asks (:class:`ProcessRequest`), and the markers every command
hutch starts carries in its environment. Re-exported by :mod:`.base`."""

from __future__ import annotations

import abc
import asyncio
import signal
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from .._errors import CapabilityUnsupported
from .._types import OutputChunk


class BackendProcess(abc.ABC):
    """A process running in a sandbox, as the backend sees it.

    ``read`` returns output chunks in the order they were produced and
    ``None`` once both streams are closed. ``kill`` ends the whole process
    tree the command started (SIGTERM, ``grace`` seconds, SIGKILL), including
    children that ignore SIGTERM or left the process group.
    """

    @abc.abstractmethod
    async def read(self) -> OutputChunk | None: ...

    @abc.abstractmethod
    async def wait(self) -> int: ...

    @abc.abstractmethod
    async def kill(self, grace: float) -> None: ...

    @property
    def returncode(self) -> int | None:
        """The exit code once known: ``128 + N`` for a command killed by signal N."""
        return None

    @property
    def oom_killed(self) -> bool:
        """Whether the kernel's OOM killer ended it, where the provider can tell."""
        return False

    async def write_stdin(self, data: bytes) -> None:
        """Write ``data`` to the command's stdin, kept open at its start
        (``ProcessRequest.keep_stdin``): returns once its pipe took them (a
        command that does not read makes it wait, as a full pipe does), and
        raises :class:`StdinClosed` once the command closed its stdin or
        ended. Called only by :class:`hutch.Process`, which checks first that
        stdin was kept open and not closed, one write at a time."""
        raise CapabilityUnsupported(
            f"{type(self).__name__} cannot write to a running command's stdin"
        )

    async def close_stdin(self) -> None:
        """Close the command's stdin (it reads its end of file). Idempotent
        on a command that has ended."""
        raise CapabilityUnsupported(
            f"{type(self).__name__} cannot close a running command's stdin"
        )


class UnstartedProcess(BackendProcess):
    """A command that could not start (its user does not exist): as on every
    other execution API, a process that said why on stderr and exited 126."""

    EXIT_CODE = 126

    def __init__(self, reason: str) -> None:
        self._unread: list[OutputChunk] = [OutputChunk("stderr", f"{reason}\n".encode())]

    async def read(self) -> OutputChunk | None:
        return self._unread.pop() if self._unread else None

    async def wait(self) -> int:
        return self.EXIT_CODE

    async def kill(self, grace: float) -> None:
        return None

    @property
    def returncode(self) -> int | None:
        return self.EXIT_CODE


class FutureExitProcess(BackendProcess):
    """A process whose reader settles its end: ``_exit`` (a future, given the
    exit code or the failure), ``_exit_code`` and ``_oom_killed``, set by the
    subclass; how they are answered is written once here."""

    _exit: asyncio.Future[int]
    _exit_code: int | None
    _oom_killed: bool

    async def wait(self) -> int:
        return await asyncio.shield(self._exit)

    @property
    def returncode(self) -> int | None:
        return self._exit_code

    @property
    def oom_killed(self) -> bool:
        return self._oom_killed

    def _settle_doomed(self) -> None:
        """Settle its end as a kill in its frozen sandbox leaves it: each of
        its processes holds a SIGKILL (see :meth:`ProcessTree.kill`), so its
        exit is the SIGKILL's, told now rather than at the thaw."""
        if not self._exit.done():
            self._exit_code = 128 + signal.SIGKILL
            self._exit.set_result(self._exit_code)


class PtyProcess(BackendProcess):
    """A process on a pseudo-terminal: its output (one stream, ``stdout``) is
    read as any process's; what is typed is written; the window resized."""

    @abc.abstractmethod
    async def write(self, data: bytes) -> None: ...

    @abc.abstractmethod
    async def resize(self, rows: int, cols: int) -> None: ...


@dataclass(frozen=True, slots=True)
class ProcessRequest:
    """A command a runtime is asked to start: ``argv`` in ``cwd`` (absolute,
    inside the sandbox), with ``env`` over the sandbox's own environment,
    ``stdin`` fed and then closed (None: no input, its stdin at end of file),
    as ``user`` (None: the sandbox's default user). With ``keep_stdin`` its
    stdin is a pipe left open after ``stdin``'s bytes, for
    :meth:`BackendProcess.write_stdin` and ``close_stdin``."""

    argv: Sequence[str]
    cwd: str
    env: Mapping[str, str] = field(default_factory=dict)
    stdin: bytes | None = None
    user: str | None = None
    keep_stdin: bool = False

    @property
    def stdin_piped(self) -> bool:
        """Whether the command's stdin is a pipe hutch writes (not /dev/null)."""
        return self.stdin is not None or self.keep_stdin


#: In the environment of every command hutch starts: its own id, and its sandbox's.
EXEC_MARKER = "HUTCH_EXEC_ID"
SANDBOX_MARKER = "HUTCH_SANDBOX_ID"
