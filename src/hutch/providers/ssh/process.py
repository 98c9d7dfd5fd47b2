"""Commands on the host: how an argv travels, and the process that comes back.

An SSH exec request carries one string that the host's login shell parses, so
user data must never be spliced into it. Each word of the argv (and the cwd,
the user, every ``NAME=value``) is encoded on its own: ``p`` + the word when it
is made only of characters no shell treats specially, else ``b`` + its base64.
A fixed wrapper script (:data:`WRAPPER`), the only shell text sent, decodes
the words back into ``"$@"``, exports the markers and variables, enters the
cwd, checks that the command can run, answers one status byte on stdout, and
``exec``s the command. So what the command sees is exactly the argv given.

Every process started this way carries ``HUTCH_EXEC_ID`` and
``HUTCH_SANDBOX_ID`` in its environment, as on the local and docker
providers: a kill finds the whole tree by it (children that called setsid or
ignore SIGTERM included) and the busy count counts what is still running.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import re
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING

from ..._errors import (
    HutchError,
    InvalidArgument,
    KillIncomplete,
    NoSuchUser,
    OutputLimitExceeded,
    ProviderError,
    SandboxFileNotFound,
    SandboxPermissionDenied,
    StdinClosed,
)
from ..._lazy import lazy_module
from ..._types import OutputChunk
from .._pipes import READ_SIZE, OutputPipes
from ..base import EXEC_MARKER, BackendProcess, PtyProcess
from .connection import KeptConnection, lost

if TYPE_CHECKING:
    import asyncssh
else:
    asyncssh = lazy_module("asyncssh")  # imported at its first use: see hutch._lazy

_PLAIN = re.compile(r"[A-Za-z0-9_./:@%+=,-]+")
#: How long a kill may take past its grace to say how it went: the kill
#: script's own SIGKILL rounds (10 s at most) and the round trip.
KILL_ANSWER_SECONDS = 15.0
#: How long a killed command's channel has to close.
CLOSED_AFTER_KILL_SECONDS = 5.0
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")

#: The status byte the wrapper writes before it execs the command.
STARTED = b"\x01"
#: ... or this, then a reason word and a newline, when it cannot.
FAILED = b"\x02"

# One line (a csh login shell rejects newlines inside quotes), no single
# quote (it travels inside one). Arguments: exec id (or -), sandbox id, cwd,
# user (empty: the login user), the number of NAME=value words, those words,
# then the argv words.
WRAPPER = (
    'w() { case $1 in p*) v=${1#p} ;; *) v=$(printf "%s" "${1#b}" | base64 -d; printf .); '
    "v=${v%.} ;; esac; }; "
    'fail() { printf "\\002%s\\n" "$1"; exit 127; }; '
    'mark=$1; w "$2"; sid=$v; w "$3"; cwd=$v; w "$4"; user=$v; nenv=$5; shift 5; '
    'if [ "$mark" != - ]; then export HUTCH_EXEC_ID="$mark" HUTCH_SANDBOX_ID="$sid"; fi; '
    'while [ "$nenv" -gt 0 ]; do w "$1"; export "$v"; shift; nenv=$((nenv - 1)); done; '
    'n=$#; while [ "$n" -gt 0 ]; do w "$1"; shift; set -- "$@" "$v"; n=$((n - 1)); done; '
    'cd "$cwd" 2>/dev/null || fail cwd; '
    'case $1 in */*) if [ -d "$1" ]; then fail isdir; elif [ ! -e "$1" ]; then fail notfound; '
    'elif [ ! -x "$1" ]; then fail noexec; fi ;; '
    '*) command -v "$1" >/dev/null 2>&1 || fail notfound ;; esac; '
    'if [ -n "$user" ]; then id -u "$user" >/dev/null 2>&1 || fail nouser; '
    'if [ "$(id -u)" != 0 ]; then [ "$(id -un)" = "$user" ] || fail notroot; user=; fi; fi; '
    'printf "\\001"; '
    'if [ -n "$user" ]; then exec setpriv --reuid="$user" --regid="$(id -g "$user")" '
    '--init-groups -- "$@"; fi; '
    'exec "$@"'
)
assert "'" not in WRAPPER and "\n" not in WRAPPER


def encode_word(value: str) -> str:
    """One word for the wrapper: never shell syntax, whatever ``value`` holds."""
    if _PLAIN.fullmatch(value):
        return "p" + value
    return "b" + base64.b64encode(value.encode("utf-8", "surrogateescape")).decode()


def command_line(
    argv: Sequence[str],
    *,
    cwd: str,
    env: Mapping[str, str],
    user: str | None,
    exec_id: str | None,
    sandbox_id: str,
) -> str:
    """The exec request's string: the fixed wrapper and encoded words only."""
    for name in env:
        if not _ENV_NAME.fullmatch(name):
            raise InvalidArgument(f"environment variable name {name!r} is not valid")
    words = [
        exec_id or "-",
        encode_word(sandbox_id),
        encode_word(cwd),
        encode_word(user or ""),
        str(len(env)),
        *(encode_word(f"{k}={v}") for k, v in env.items()),
        *(encode_word(a) for a in argv),
    ]
    return f"sh -c '{WRAPPER}' hutch " + " ".join(words)


def start_error(
    reason: str, argv: Sequence[str], cwd: str, user: str | None, dest: str
) -> HutchError:
    if reason == "cwd":
        return SandboxFileNotFound(f"working directory {cwd} does not exist on {dest}")
    if reason == "notfound":
        return SandboxFileNotFound(f"command not found on {dest}: {argv[0]}")
    if reason == "noexec":
        return SandboxPermissionDenied(f"cannot execute {argv[0]} on {dest}: permission denied")
    if reason == "isdir":
        return SandboxPermissionDenied(f"cannot execute {argv[0]} on {dest}: it is a directory")
    if reason == "nouser":
        return NoSuchUser(f"no such user {user!r} on {dest}")
    if reason == "notroot":
        return SandboxPermissionDenied(
            f"running as {user!r} on {dest} needs the ssh login to be root"
        )
    return ProviderError(f"ssh {dest}: the command did not start ({reason})")


def exit_code(process: asyncssh.SSHClientProcess[bytes]) -> int | None:
    """The exit status, with a signal N as 128 + N (as on every provider)."""
    code = process.returncode
    if code is None:
        return None
    return 128 - code if code < 0 else code


@functools.cache
def channel_errors() -> tuple[type[BaseException], ...]:
    """What a broken channel raises (a function: asyncssh is imported lazily)."""
    return (OSError, asyncssh.Error, asyncio.IncompleteReadError)


async def open_process(
    kept: KeptConnection,
    command: str,
    *,
    term_size: tuple[int, int] | None = None,
) -> tuple[asyncssh.SSHClientConnection, asyncssh.SSHClientProcess[bytes]]:
    """Open an exec channel for ``command`` (see :meth:`KeptConnection.open_session`),
    on a pseudo-terminal of ``term_size`` (cols, rows) when given."""
    return await kept.open_session(command, term_size=term_size)


class SshProcess(BackendProcess):
    """A command running on the host, read through its exec channel."""

    def __init__(
        self,
        kept: KeptConnection,
        conn: asyncssh.SSHClientConnection,
        process: asyncssh.SSHClientProcess[bytes],
        exec_id: str,
        stdin: bytes | None,
        *,
        interactive: bool = False,
        keep_stdin: bool = False,
    ) -> None:
        self._kept = kept
        self._conn = conn
        self._proc = process
        self._exec_id = exec_id
        self._killed = False
        self._output = OutputPipes(process.stdout, process.stderr, channel_errors())
        #: What feeds the bytes given at the start (writes wait for it).
        self._fed: asyncio.Task[None] | None = None
        if not interactive:  # a terminal's input stays open for what is typed
            self._fed = asyncio.get_running_loop().create_task(
                self._feed(stdin, close=not keep_stdin))
            self._output.tasks.append(self._fed)

    async def _feed(self, data: bytes | None, *, close: bool) -> None:
        # A command that exits without reading its stdin is not an error.
        with contextlib.suppress(*channel_errors()):
            if data:
                self._proc.stdin.write(data)
                await self._proc.stdin.drain()
            if close:
                self._proc.stdin.write_eof()

    async def _fed_first(self) -> None:
        if self._fed is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.shield(self._fed)

    async def write_stdin(self, data: bytes) -> None:
        await self._fed_first()
        try:
            self._proc.stdin.write(data)
            await self._proc.stdin.drain()
        except channel_errors():
            raise StdinClosed("the command has closed its stdin, or ended") from None

    async def close_stdin(self) -> None:
        await self._fed_first()
        with contextlib.suppress(*channel_errors()):
            self._proc.stdin.write_eof()

    async def read(self) -> OutputChunk | None:
        return await self._output.read()

    async def wait(self) -> int:
        with contextlib.suppress(*channel_errors()):
            await self._proc.wait_closed()
        code = exit_code(self._proc)
        if code is not None:
            return code
        if self._killed:
            return 128 + 9
        self._kept.forget(self._conn)
        raise lost(self._kept.target, self._output.error)

    @property
    def returncode(self) -> int | None:
        code = exit_code(self._proc)
        if code is None and self._killed:
            return 128 + 9
        return code

    async def kill(self, grace: float) -> None:
        running = exit_code(self._proc) is None
        self._killed = self._killed or running
        # The whole tree, its leader ended or not: what it left running (its
        # output still open) is as much the command's.
        said = 0  # the kill script's exit status (3: processes outlived it)
        unconfirmed = ""  # why no status came: the tree may run on
        try:
            said, _, _ = await asyncio.wait_for(
                run_helper(
                    self._kept,
                    ["sh", "-c", KILL_SCRIPT, "hutch-kill",
                     f"{EXEC_MARKER}={self._exec_id}", str(max(1, int(grace * 10)))],
                ),
                grace + KILL_ANSWER_SECONDS,
            )
        except TimeoutError:
            unconfirmed = f"its kill did not answer within {grace + KILL_ANSWER_SECONDS:g} s"
        except HutchError as exc:
            unconfirmed = f"its kill could not run: {exc}"
        if running:
            with contextlib.suppress(TimeoutError, *channel_errors()):
                await asyncio.wait_for(asyncio.shield(self._proc.wait_closed()),
                                       CLOSED_AFTER_KILL_SECONDS)
        # An escaped grandchild holding a pipe would keep the channel open.
        self._proc.close()
        self._output.cancel()
        if said == 3:
            raise KillIncomplete(
                f"processes of the command on {self._kept.target.destination} outlived "
                "its kill by 10 s; they still hold their share of the host"
            )
        if unconfirmed:
            raise KillIncomplete(
                f"the command on {self._kept.target.destination} may still be running: "
                f"{unconfirmed}"
            )


class SshPtyProcess(SshProcess, PtyProcess):
    """A command on a pseudo-terminal the host's sshd made for the channel."""

    async def write(self, data: bytes) -> None:
        try:
            self._proc.stdin.write(data)
            await self._proc.stdin.drain()
        except channel_errors() as exc:
            raise lost(self._kept.target, exc) from None

    async def resize(self, rows: int, cols: int) -> None:
        try:
            self._proc.change_terminal_size(cols, rows)
        except channel_errors() as exc:
            raise lost(self._kept.target, exc) from None


# Kills every process whose environment holds the marker ($1): SIGTERM, up to
# $2 tenths of a second for them to go, then SIGKILL for what is left. GNU
# grep -z reads each /proc/PID/environ as NUL-separated records in one process.
KILL_SCRIPT = (
    'm=$1; grace=$2; '
    'marked() { grep -lzxF -e "$m" /proc/[0-9]*/environ 2>/dev/null '
    "| sed 's#^/proc/##; s#/environ$##'; }; "
    'pids=$(marked); [ -z "$pids" ] && exit 0; '
    'kill -TERM $pids 2>/dev/null; '
    'i=0; while [ "$i" -lt "$grace" ]; do sleep 0.1; i=$((i + 1)); '
    'pids=$(marked); [ -z "$pids" ] && exit 0; done; '
    # SIGKILL rounds until none is alive (what forked between a look and its
    # kill, the next look finds; a zombie's environ is empty), for at most
    # 10 s: exit 3 says some outlived it.
    'j=0; while pids=$(marked); [ -n "$pids" ]; do '
    '[ "$j" -ge 400 ] && exit 3; kill -KILL $pids 2>/dev/null; sleep 0.025; j=$((j + 1)); '
    'done; exit 0'
)

# Counts processes whose environment holds the marker ($1). Zombies have an
# empty environ, so they do not count.
COUNT_SCRIPT = 'grep -lzxF -e "$1" /proc/[0-9]*/environ 2>/dev/null | wc -l'


@contextlib.contextmanager
def closed_on_failure(
    kept: KeptConnection, conn: asyncssh.SSHClientConnection,
    process: asyncssh.SSHClientProcess[bytes],
) -> Iterator[None]:
    """Close ``process`` if what runs inside fails; a channel error is the
    connection lost (forgotten, so that the next call connects anew). A
    timeout goes on, for the caller to say what took too long."""
    try:
        yield
    except (TimeoutError, HutchError):
        process.close()
        raise
    except channel_errors() as exc:
        process.close()
        kept.forget(conn)
        raise lost(kept.target, exc) from None


async def run_helper(
    kept: KeptConnection,
    argv: Sequence[str],
    *,
    cwd: str = "/",
    stdin: bytes | None = None,
    timeout: float = 60,
    output_limit: int = 16 << 20,
) -> tuple[int, bytes, bytes]:
    """Run a command of hutch's own (unmarked: not the sandbox's work) to its
    end; past ``output_limit`` bytes of stdout it is stopped, never buffered."""
    command = command_line(argv, cwd=cwd, env={}, user=None, exec_id=None, sandbox_id="-")
    conn, process = await open_process(kept, command)

    async def collect(reader: asyncssh.SSHReader[bytes], cap: int) -> bytes:
        data = bytearray()
        while chunk := await reader.read(READ_SIZE):
            data += chunk
            if len(data) > cap:
                raise OutputLimitExceeded(
                    f"ssh {kept.target.destination}: {argv[0]} answered more than {cap} bytes"
                )
        return bytes(data)

    try:
        with closed_on_failure(kept, conn, process):
            async with asyncio.timeout(timeout):
                if stdin:
                    process.stdin.write(stdin)
                process.stdin.write_eof()
                out, err = await asyncio.gather(
                    collect(process.stdout, output_limit + 1), collect(process.stderr, 1 << 20)
                )
                await process.wait_closed()
    except TimeoutError:
        raise ProviderError(
            f"ssh {kept.target.destination}: {argv[0]} took over {timeout} s"
        ) from None
    if out[:1] == STARTED:
        out = out[1:]
    elif out[:1] == FAILED:
        raise start_error(
            out[1:].split(b"\n", 1)[0].decode(), argv, cwd, None, kept.target.destination
        )
    code = exit_code(process)
    if code is None:
        kept.forget(conn)
        raise lost(kept.target)
    return code, out, err
