"""Processes in a docker sandbox: an exec started over the Engine's hijacked
socket (:class:`DockerProcess`), a failed start's error from what the runtime
said, and kills by the exec's marker, from inside the container and the host."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import os
import select
import signal
import socket
import struct
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import anyio
import anyio.to_thread

from ..._errors import (
    HutchError,
    NoSuchUser,
    OutputLimitExceeded,
    ProviderError,
    ResourceExhausted,
    SandboxFileNotFound,
    SandboxPermissionDenied,
    SandboxUnavailable,
    StdinClosed,
)
from ..._types import KILL_GRACE_SECONDS, OutputChunk
from .._docker_engine import call as _call
from .._docker_engine import engine
from .._hostproc import EXEC_MARKER, SANDBOX_MARKER
from .._proctree import ProcessTree, cgroup_members
from ..agent import workload as _workload
from ..base import FutureExitProcess, ProcessRequest
from .cgroups import cgroup_dir, frozen, frozen_state, oom_kills, pids_refusals
from .freeze import FreezeGuard, freeze_guard
from .provisioning import DockerProvisioning

log = logging.getLogger("hutch.docker")


def read_ahead(hijacked: Any) -> bytes:
    """What the HTTP client already read from an exec's hijacked connection
    past its response's headers: the start of the command's output, when it
    came in the same read as the headers (a fast command, the client's
    thread slow to get to it). The SDK hands out the socket beneath the
    client's buffered reader, so reading the socket alone loses it: seen
    under load as a fast exec answering exit 0 and no output (about one in
    a hundred while pauses ran; one in three with the reading thread slowed
    by others holding the GIL). Call before the socket is read."""
    try:
        buffered = hijacked._response.raw._fp.fp
        sock = hijacked._sock
    except AttributeError:
        # Fail loudly rather than lose output without a word.
        raise ProviderError(
            "docker exec: the docker SDK no longer gives the exec's connection "
            "the way hutch reads it (its response's buffered reader)"
        ) from None
    timeout = sock.gettimeout()
    sock.setblocking(False)
    try:
        # read1 hands back what its buffer holds without touching the socket,
        # or else one non-blocking read (b"" when nothing waits).
        return bytes(buffered.read1(1 << 20) or b"")
    except BlockingIOError:
        return b""
    finally:
        sock.settimeout(timeout)


def wait_until_started(api: Any, exec_id: str) -> int | None:
    """Return once the Engine has started (or failed to start) ``exec_id``:
    its process's pid on the Engine's host (None if it never got one)."""
    deadline = time.monotonic() + FreezeGuard.START_WAIT_SECONDS
    pause = 0.0005
    while time.monotonic() < deadline:
        # Not "Running": the Engine sets it before it asks runc to start the
        # process; the pid comes once runc is done, the exit code if it failed.
        state = api.exec_inspect(exec_id)
        if state.get("Pid") or state.get("ExitCode") is not None:
            return int(state.get("Pid") or 0) or None
        time.sleep(pause)
        pause = min(pause * 2, 0.05)
    log.warning("docker exec %s not started after %.0f s", exec_id[:12],
                FreezeGuard.START_WAIT_SECONDS)
    return None


# Kills every process whose environment carries the exec's marker, and every
# process of the sessions they were in (each exec is a session of its own, so
# a child that cleared its environment is still found): SIGTERM, up to $2
# tenths of a second of grace, then SIGKILL. Children that ignore SIGTERM or
# left the process group still carry the marker, so none escapes. GNU grep -z
# reads every /proc/PID/environ in one process; without it (busybox) each is
# read by a loop.
_KILL_SCRIPT = r"""
m="$1"; grace="$2"
grep -qz x /dev/null 2>/dev/null; [ $? -eq 1 ] && fast=1 || fast=
by_marker() {
  if [ -n "$fast" ]; then
    grep -lzxF -e "$m" /proc/[0-9]*/environ 2>/dev/null | sed 's#^/proc/##; s#/environ$##'
    return
  fi
  for d in /proc/[0-9]*; do
    tr '\0' '\n' < "$d/environ" 2>/dev/null | grep -qxF -e "$m" && echo "${d#/proc/}"
  done
}
session_of() { sed 's/.*) //' "/proc/$1/stat" 2>/dev/null | cut -d' ' -f4; }
first=$(by_marker); [ -z "$first" ] && exit 0
# The sessions, taken once: the marked leaders may be gone by the next look.
sessions=$(for p in $first; do session_of "$p"; done | grep -vx -e 0 -e 1 | sort -u)
me=$(session_of $$)
want=" $(echo $sessions) "
marked() {
  by_marker
  [ "$want" = "  " ] && return
  # One pass over every /proc/PID/stat: "PID (comm) state ppid pgrp session ...".
  cat /proc/[0-9]*/stat 2>/dev/null | awk -v want="$want" -v me="$me" '{
    pid = $1; rest = $0; sub(/.*\) /, "", rest); split(rest, f, " ")
    if (f[4] != me && index(want, " " f[4] " ")) print pid
  }' 2>/dev/null
}
pids=$(marked); [ -z "$pids" ] && exit 0
kill -TERM $pids 2>/dev/null
i=0
while [ "$i" -lt "$grace" ]; do
  sleep 0.1; i=$((i + 1))
  pids=$(marked); [ -z "$pids" ] && exit 0
done
kill -KILL $(marked) 2>/dev/null
exit 0
"""

# Run a shell string in bash where the image has it, else in sh, with no
# extra round trip to find out.
_SHELL_SHIM = 'if command -v bash >/dev/null 2>&1; then exec bash -c "$1"; else exec sh -c "$1"; fi'

#: How the engine's first output line reads when the exec never started (exit 126).
_START_FAILURES = (b"OCI runtime exec failed", b"unable to find user", b"unable to find group")


def _oci_error(message: str, request: ProcessRequest, *, pids_refused: bool) -> HutchError:
    """The error of an exec the runtime could not start, from what it said;
    ``pids_refused``: the kernel refused a fork at the container's pids limit
    meanwhile (runc's own processes, once inside the container's cgroup, are
    refused there, and it says only that its child went away)."""
    if "unable to find user" in message or "unable to find group" in message:
        return NoSuchUser(f"no such user {request.user!r}")
    if "chdir to cwd" in message:
        return SandboxFileNotFound(f"working directory {request.cwd} does not exist")
    if "permission denied" in message:
        return SandboxPermissionDenied(f"cannot execute {request.argv[0]}: permission denied")
    if "not found" in message or "no such file" in message:
        return SandboxFileNotFound(f"command not found: {request.argv[0]}")
    if pids_refused:
        return ResourceExhausted(
            f"cannot start {request.argv[0]}: the sandbox is at its pids limit "
            f"({message.strip()}); it starts once a process in the sandbox ends"
        )
    return ProviderError(f"docker exec failed: {message.strip()}")


#: How long an exec's output stream may stay open with nothing on it, and the
#: Engine may take to record its exit, once its process is gone. The Engine itself ends the
#: stream at most 2 s after the exit (cutting off what orphans still hold);
#: the rest is room for a loaded host. Past it the exec fails, said so.
EXEC_DRAIN_SECONDS = 15.0
#: The Engine ends a container's execs one at a time (each may wait 2 s for
#: its stream's copy), so an exec's end may come long after its process's,
#: behind the container's other execs: while the Engine goes on ending them,
#: the drain time runs from its last end, up to this many drain times from
#: the exec's own end (the bound on a lost exit in a container whose other
#: execs keep ending).
EXEC_DRAIN_QUEUE_FACTOR = 10
#: The most the drain time stretches on a loaded host (see drain_seconds).
EXEC_DRAIN_LOAD_FACTOR = 8


def drain_seconds() -> float:
    """:data:`EXEC_DRAIN_SECONDS`, stretched by how far the host's run queue
    is past its CPUs (at most :data:`EXEC_DRAIN_LOAD_FACTOR`-fold): the
    Engine's steps from an exit to its stream's end (the shim's, containerd's,
    its own) wait their turn for a CPU like everything else, so on a host
    twelve times oversubscribed they take many times as long (seen in CI at
    a load of 24 on 2 CPUs: every exec of a busy container silent 15 s after
    its process ended, healthy all the same)."""
    try:
        load = os.getloadavg()[0] / (os.cpu_count() or 1)
    except OSError:
        load = 1.0
    return EXEC_DRAIN_SECONDS * min(max(load, 1.0), float(EXEC_DRAIN_LOAD_FACTOR))
#: The longest a quiet exec goes without a look at whether its process is there.
EXEC_CHECK_MAX_SECONDS = 2.0
#: Output pieces an exec's reader thread hands on before it waits for them
#: to be taken: a consumer slower than the command holds this much, not all.
EXEC_QUEUE_CHUNKS = 16


class EngineProgress:
    """When the Engine last ended an exec's stream in one sandbox (see
    :data:`EXEC_DRAIN_QUEUE_FACTOR`): its execs' ends are told in turn."""

    def __init__(self) -> None:
        self.at = 0.0

    def note(self) -> None:
        self.at = time.monotonic()


@dataclasses.dataclass(frozen=True)
class ExecStarted:
    """What starting an exec found out, for its :class:`DockerProcess`."""

    exec_id: str
    sock: socket.socket
    #: The stream's first bytes, read with the response's headers (see read_ahead).
    early: bytes
    #: The exec's process on the Engine's host (None: the Engine never said).
    pid: int | None
    #: Whether this host sees the container's processes (the Engine is local).
    host_sees: bool
    #: The container's OOM kills before the command started (None: unknown).
    oom_before: int | None
    #: The forks its pids limit had refused before it started (None: unknown).
    pids_before: int | None


class DockerProcess(FutureExitProcess):
    """One exec: a reader thread demultiplexes the hijacked socket into a queue.

    The Engine can fail to end an exec's stream, or to record its exit (seen
    under load with pauses running: a fast command's output all there, its
    process long gone, the Engine still saying it ran, for good). So the
    reader never waits on the Engine alone: while the stream is quiet it
    looks whether the process is still there (in /proc where this host sees
    the container's processes, a look with no call; else the Engine's
    word), and once it is gone the stream and the exit status must come
    within :data:`EXEC_DRAIN_SECONDS`, or the exec fails saying what was
    missing, rather than answering output that may be cut short.
    """

    def __init__(
        self,
        sandbox: DockerProcesses,
        started: ExecStarted,
        marker: str,
        request: ProcessRequest,
    ) -> None:
        self._sandbox = sandbox
        self._exec_id = started.exec_id
        self._marker = marker
        self._sock = started.sock
        self._early = started.early
        self._pid = started.pid
        self._host_sees = started.host_sees
        #: When the exec's process was first seen gone (monotonic).
        self._gone_at: float | None = None
        #: When the stream last had bytes: the drain time runs from the later
        #: of this and the process's end, so a slow stream is never cut off.
        self._heard_at = 0.0
        #: What was asked, for the error a failed start says.
        self._request = request
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[OutputChunk | BaseException | None] = asyncio.Queue()
        self._exit_code: int | None = None
        self._oom_before = started.oom_before
        self._pids_before = started.pids_before
        self._oom_killed = False
        self._exit: asyncio.Future[int] = self._loop.create_future()
        self._first = True
        self._held: bytes | None = None
        self._eof = False
        #: Room in the queue for output; given back as the reader takes it.
        self._room = threading.Semaphore(EXEC_QUEUE_CHUNKS)
        #: Set by kill: nobody may read on, so the thread stops waiting for room.
        self._abandoned = threading.Event()
        #: Set by a kill that left its tree holding SIGKILLs in the frozen
        #: container: its end is settled, and the thread waits for no exit status.
        self._doomed = threading.Event()
        #: Writes to its stdin, one at a time in order, off the event loop
        #: (a send blocks while the command does not read).
        self._stdin_turn = threading.Lock()
        if request.stdin is not None:
            self._stdin_turn.acquire()  # the first bytes go first
            threading.Thread(
                target=self._feed, args=(request.stdin, not request.keep_stdin), daemon=True
            ).start()
        threading.Thread(target=self._pump, daemon=True).start()

    def _feed(self, data: bytes, close: bool) -> None:
        try:
            self._send_all(data)
        except OSError:
            pass  # the command exited without reading all of its stdin
        finally:
            if close:
                with contextlib.suppress(OSError):
                    self._sock.shutdown(socket.SHUT_WR)
            self._stdin_turn.release()

    def _send_all(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            sent = self._sock.send(view[: 1 << 20])
            view = view[sent:]

    def _send_stdin(self, data: bytes | None) -> None:
        """``data`` to the command's stdin, or its end (None), after what went before."""
        with self._stdin_turn:
            try:
                if data is None:
                    self._sock.shutdown(socket.SHUT_WR)
                else:
                    self._send_all(data)
            except OSError:
                if data is not None:
                    raise StdinClosed("the command has closed its stdin, or ended") from None

    async def write_stdin(self, data: bytes) -> None:
        await asyncio.to_thread(self._send_stdin, data)

    async def close_stdin(self) -> None:
        await asyncio.to_thread(self._send_stdin, None)

    def _post(self, item: OutputChunk | BaseException | None) -> None:
        # The loop may be gone (a sync caller's loop ended): nobody is left to tell.
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)

    def _host_says_gone(self) -> bool | None:
        """Whether the exec's process has ended, as this host's /proc says
        (gone, a zombie, or its pid now another process's); None where this
        host cannot tell."""
        if self._pid is None or not self._host_sees:
            return None
        try:
            with open(f"/proc/{self._pid}/environ", "rb") as fh:
                environ = fh.read()
        except (FileNotFoundError, ProcessLookupError):
            return True
        except OSError:
            return None
        return f"{EXEC_MARKER}={self._marker}".encode() not in environ.split(b"\0")

    def _note_if_gone(self) -> None:
        if self._gone_at is not None:
            return
        gone = self._host_says_gone()
        if gone is None:
            gone = not engine().exec_inspect(self._exec_id).get("Running")
        if gone:
            self._gone_at = time.monotonic()

    def _drain_deadline(self) -> float:
        assert self._gone_at is not None
        own = max(self._gone_at, self._heard_at)
        drain = drain_seconds()
        # The Engine still ending the sandbox's other execs is not one that
        # lost this exec's end: its turn may not have come.
        queued = max(own, self._sandbox.engine_progress.at)
        return min(queued, own + drain * (EXEC_DRAIN_QUEUE_FACTOR - 1)) + drain

    def _never_ended(self) -> ProviderError:
        info = engine().exec_inspect(self._exec_id)
        name = self._request.argv[0] if self._request.argv else "the command"
        if not info.get("Running") and info.get("ExitCode") is not None:
            said = f"exited with status {info['ExitCode']}"
        else:
            said = "is gone, but the Engine still says it runs (it lost its exit)"
        return ProviderError(
            f"docker exec of {name} in sandbox {self._sandbox.sandbox_id}: its process "
            f"{said}, and its output stream stayed open with nothing on it for "
            f"{drain_seconds():.0f} s; its output may be incomplete, run it again"
        )

    def _await_readable(self, poller: select.poll) -> None:
        """Return once the socket has bytes or its end to read. While it is
        quiet, look now and then whether the process is still there; once it
        is gone, the stream may go quiet for :data:`EXEC_DRAIN_SECONDS` at
        most before it ends (however long its bytes take to arrive)."""
        quiet = 0.2
        while True:
            if self._gone_at is None:
                wait = quiet
            else:
                # Bytes already waiting count even past the deadline: the
                # time this thread waited for a slow reader is not quiet.
                wait = max(0.0, self._drain_deadline() - time.monotonic())
            if poller.poll(wait * 1000):
                self._heard_at = time.monotonic()
                return
            if self._gone_at is not None and time.monotonic() >= self._drain_deadline():
                raise self._never_ended()
            quiet = min(quiet * 2, EXEC_CHECK_MAX_SECONDS)
            self._note_if_gone()

    def _recv_exact(self, size: int, poller: select.poll) -> bytes | None:
        parts = []
        while size:
            if self._early:
                chunk, self._early = self._early[:size], self._early[size:]
            else:
                self._await_readable(poller)
                chunk = self._sock.recv(min(size, 1 << 20))
            if not chunk:
                return None
            parts.append(chunk)
            size -= len(chunk)
        return b"".join(parts)

    def _pump(self) -> None:
        code = -1
        failure: HutchError | None = None
        poller = select.poll()
        poller.register(self._sock, select.POLLIN)
        try:
            while True:
                header = self._recv_exact(8, poller)
                if header is None:
                    self._sandbox.engine_progress.note()
                    break
                kind, size = header[0], struct.unpack(">I", header[4:])[0]
                payload = self._recv_exact(size, poller)
                if payload is None:
                    break
                if self._wait_for_room():
                    self._post(OutputChunk("stderr" if kind == 2 else "stdout", payload))
            code = self._inspect_exit_code()
            if code == 128 + 9 and self._oom_before is not None:
                container = self._sandbox.container_id or ""
                self._oom_killed = _workload.oom_counted_since(
                    lambda: oom_kills(container), self._oom_before)
        except HutchError as exc:  # the reader and a waiter both learn it
            failure = exc
            self._post(exc)
        except BaseException as exc:  # handed to the reader on the loop
            self._post(exc)
        finally:
            with contextlib.suppress(OSError):
                self._sock.close()
            # The exit code is known before the reader sees the end of output.
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(self._set_exit, code, failure)
            self._post(None)

    def _wait_for_room(self) -> bool:
        """Wait until the queue has room for a piece of output; False (drop
        it) once the exec is being killed and nobody takes what is queued."""
        while not self._room.acquire(timeout=0.5):
            if self._abandoned.is_set():
                return False
        return True

    def _inspect_exit_code(self) -> int:
        """The exit status the Engine records; it may come a moment after the
        stream ends, and the stream may end long before the process does (a
        command that closed its output and runs on): waited for while the
        process is there, and for :data:`EXEC_DRAIN_SECONDS` once it is gone;
        the SIGKILL's, without asking, once a kill settled it (``_doomed``)."""
        api = engine()
        delay = 0.002
        while not self._doomed.is_set():
            info = api.exec_inspect(self._exec_id)
            if not info["Running"] and info["ExitCode"] is not None:
                return int(info["ExitCode"])
            if self._gone_at is None and self._host_says_gone():
                self._gone_at = time.monotonic()
            if self._gone_at is not None and time.monotonic() > self._drain_deadline():
                name = self._request.argv[0] if self._request.argv else "the command"
                raise ProviderError(
                    f"docker exec of {name} in sandbox {self._sandbox.sandbox_id}: its "
                    f"process is gone, but the Engine still says it runs "
                    f"{drain_seconds():.0f} s later (it lost its exit): exit status unknown"
                )
            time.sleep(delay)
            delay = min(delay * 2, EXEC_CHECK_MAX_SECONDS)
        return 128 + signal.SIGKILL

    def _set_exit(self, code: int, failure: HutchError | None = None) -> None:
        if self._exit.done():  # settled by a kill (_settle_doomed)
            return
        self._exit_code = None if failure is not None else code
        if failure is not None:
            self._exit.set_exception(failure)
            self._exit.exception()  # retrieved here; wait() raises it again
        else:
            self._exit.set_result(code)

    async def read(self) -> OutputChunk | None:
        while not self._eof:
            item = await self._queue.get()
            if isinstance(item, BaseException):
                raise item
            if item is None:
                self._eof = True
                break
            self._room.release()
            if self._first:
                self._first = False
                # The runtime reports a failed start as output plus exit 126:
                # hold that first chunk until the exit code says which it is.
                if item.stream == "stdout" and item.data.startswith(_START_FAILURES):
                    self._held = item.data
                    continue
            return item
        if self._held is not None:
            held, self._held = self._held, None
            if await asyncio.shield(self._exit) == 126:
                before = self._pids_before
                after = pids_refusals(self._sandbox.container_id or "")
                error = _oci_error(
                    held.decode("utf-8", "replace"), self._request,
                    pids_refused=before is not None and after is not None and after > before,
                )
                if isinstance(error, NoSuchUser):
                    # A command that could not start: its reason, and exit 126.
                    return OutputChunk("stderr", f"{error.message}\n".encode())
                raise error
            return OutputChunk("stdout", held)
        return None

    async def kill(self, grace: float) -> None:
        self._abandoned.set()
        if self._exit.done():
            return
        # Each process of the command, as the host sees it (the daemon as root,
        # the engine local; else none), taken before any is killed: the kill
        # answers once each is reaped (by docker's init), and what forks on
        # meets the SIGKILL rounds of its kill.
        container = self._sandbox.container_id or ""
        # Looked for among the container's processes (its cgroup's) alone.
        tree = ProcessTree(f"{EXEC_MARKER}={self._marker}", held=lambda: frozen(container),
                           cgroup=cgroup_dir(container, "pids") if container else None)
        await anyio.to_thread.run_sync(tree.alive)
        with contextlib.suppress(HutchError):
            await self._sandbox.run_quiet(
                ["sh", "-c", _KILL_SCRIPT, "hutch-kill", f"{EXEC_MARKER}={self._marker}",
                 str(max(1, int(grace * 10)))]
            )
        # What forks faster than a kill from inside can run (a fork bomb at the
        # pids limit leaves no room to start one) is killed from the host.
        with contextlib.suppress(HutchError):
            await _call(self._sandbox.kill_marked_from_host, self._marker)
        doomed = False
        try:
            doomed = await tree.kill(0)
        finally:
            if doomed:
                self._doomed.set()
                self._settle_doomed()
            # Closing the socket ends the reader even if an orphan kept a pipe
            # open, or the frozen tree holds it until the thaw.
            with contextlib.suppress(TimeoutError, HutchError):
                await asyncio.wait_for(asyncio.shield(self._exit), 5)
            if doomed or not self._exit.done():
                with contextlib.suppress(OSError):
                    self._sock.shutdown(socket.SHUT_RDWR)


class DockerProcesses(DockerProvisioning):
    """Starting, running and killing a docker sandbox's processes."""

    @functools.cached_property
    def engine_progress(self) -> EngineProgress:
        return EngineProgress()

    # -- processes -----------------------------------------------------------------
    def shell_argv(self, command: str) -> list[str]:
        return ["/bin/sh", "-c", _SHELL_SHIM, "sh", command]

    async def start_process(self, request: ProcessRequest) -> DockerProcess:
        import docker.errors

        api = engine()
        container = self._container()
        marker = uuid.uuid4().hex
        full_env = {**request.env, EXEC_MARKER: marker, SANDBOX_MARKER: self.sandbox_id}

        def start() -> ExecStarted:
            # Counted before it starts: a command can be OOM-killed before
            # the call that started it returns.
            oom_before = oom_kills(container)
            pids_before = pids_refusals(container)
            guard = freeze_guard(container)
            with guard.starting():
                if guard.paused_here(frozen_state(container)):
                    # Refused here, not by the Engine: its flag may lag to "running",
                    # and an exec it lets into the frozen container never returns.
                    raise SandboxUnavailable(f"docker sandbox {self.sandbox_id} is paused")
                deadline = time.monotonic() + FreezeGuard.SETTLE_SECONDS
                delay = 0.005
                while True:
                    try:
                        created = api.exec_create(
                            container, list(request.argv), stdin=request.stdin_piped,
                            environment=full_env, workdir=request.cwd,
                            user=request.user or "",
                        )
                        response = api.exec_start(created["Id"], socket=True)
                        break
                    except docker.errors.APIError as exc:
                        # "is paused" just after this process unpaused it: the
                        # Engine's flag lags (see FreezeGuard); it is running.
                        if ("is paused" not in str(exc) or not guard.refusal_is_lag()
                                or time.monotonic() > deadline):
                            raise
                        time.sleep(delay)
                        delay = min(delay * 2, 0.1)
                sock = getattr(response, "_sock", None)
                if not isinstance(sock, socket.socket):
                    raise ProviderError("docker exec gave no socket to read (TLS engine?)")
                early = read_ahead(response)
                pid = wait_until_started(api, created["Id"])
            # The client's request timeout would end a command silent that long.
            sock.settimeout(None)
            return ExecStarted(
                created["Id"], sock, early, pid, cgroup_dir(container, "pids") is not None,
                oom_before, pids_before,
            )

        started: ExecStarted = await _call(start)
        return DockerProcess(self, started, marker, request)

    async def run_quiet(
        self, argv: Sequence[str], *, env: Mapping[str, str] | None = None,
        output_limit: int | None = None,
    ) -> tuple[int, bytes, bytes]:
        """Run one of hutch's own helpers (kill, find, grep) to completion:
        (exit code, stdout, stderr). As root, like the archive API, so that
        what stat sees, list and walk see too, whatever the image's USER.
        Past ``output_limit`` bytes it is killed (OutputLimitExceeded)."""
        proc = await self.start_process(ProcessRequest(argv, cwd="/", env=env or {}, user="0"))
        out: list[bytes] = []
        err: list[bytes] = []
        total = 0
        try:
            while (chunk := await proc.read()) is not None:
                total += len(chunk.data)
                if output_limit is not None and total > output_limit:
                    raise OutputLimitExceeded(
                        f"{argv[0]} answered more than {output_limit} bytes; "
                        "narrow the path, the glob or the pattern"
                    )
                (out if chunk.stream == "stdout" else err).append(chunk.data)
            return await proc.wait(), b"".join(out), b"".join(err)
        except BaseException:
            # Cancelled (a grep's timeout, its caller gone): what it started
            # inside the sandbox is killed, not left to run unseen.
            with anyio.CancelScope(shield=True):
                await proc.kill(KILL_GRACE_SECONDS)
            raise

    def kill_marked_from_host(self, marker: str) -> int:
        """SIGKILL, from the host, every process of the container whose
        environment carries ``marker``; return how many there were.

        If any are left, the container is frozen first (cgroup freezer, as
        pause), so that none can fork while the list is taken and killed; on
        thaw they die before running again. Needs the host's /proc of the
        container's processes (the daemon as root, the engine local); without
        it nothing is done.
        """
        api = engine()
        container = self._container()
        needle = f"{EXEC_MARKER}={marker}".encode()
        where = cgroup_dir(container, "pids")

        def members() -> list[int]:
            # The container's cgroup, read here; the Engine's top runs ps over
            # every process of the host where it is not found.
            if where is not None:
                return cgroup_members(where)
            rows = api.top(container, ps_args="-e -o pid").get("Processes") or []
            return [int(row[0]) for row in rows]

        def marked() -> list[int]:
            found = []
            for pid in members():
                try:
                    with open(f"/proc/{pid}/environ", "rb") as fh:
                        if needle in fh.read().split(b"\0"):
                            found.append(pid)
                except OSError:
                    continue
            return found

        if not marked():
            return 0
        # Frozen already (the user's pause), it stays so: the kills wait for the thaw.
        with freeze_guard(container).frozen(api, container):
            pids = marked()
            for pid in pids:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
        log.info("killed %d processes of sandbox %s from the host", len(pids), self.sandbox_id)
        return len(pids)

    async def count_busy_processes(self) -> int:
        # The Engine's top runs ps on the host: no probe inside to count out.
        # A failure propagates: the lifecycle engine takes "cannot tell" as busy.
        top = await _call(engine().top, self._container(), ps_args="-e -o pid,stat")
        alive = [row for row in top.get("Processes") or [] if not row[1].startswith("Z")]
        keepers = 2 if self.config.init else 1  # init and its sleep, or sleep alone
        return max(0, len(alive) - keepers)
