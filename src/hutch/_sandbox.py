"""The sandbox every caller uses, whatever provider runs it.

:class:`Sandbox` is async. It owns what is the same on every provider: path
resolution against the working directory, exec timeouts and output caps,
background processes, the read-before-write guardrail, capability checks, and
the single gate (:meth:`Sandbox._operation`) every operation passes through,
where the lifecycle engine tracks activity and resumes a suspended sandbox.
"""

from __future__ import annotations

import re
import shlex
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from contextlib import aclosing, asynccontextmanager, suppress
from typing import IO, TYPE_CHECKING, Any

import anyio

from ._errors import (
    CapabilityUnsupported,
    InvalidArgument,
    KillIncomplete,
    NoSuchUser,
    NotFound,
    ResourceExhausted,
    SandboxPermissionDenied,
    SandboxUnavailable,
)
from ._faults import fault_point
from ._guardrail import ReadBeforeWriteGuard
from ._membudget import MemoryHold
from ._process import (
    ExecOutput,
    Process,
    StreamEvent,
    collect_output,
    kill_shielded,
)
from ._refwire import check_ref_lifetime
from ._sandbox_paths import sandbox_path, within
from ._snapshots import Fork, SandboxFactory, new_snapshot_id, snapshot_record
from ._types import (
    DEFAULT_OUTPUT_LIMIT,
    DEFAULT_READ_LIMIT,
    DEFAULT_SEARCH_TIMEOUT,
    Capabilities,
    Command,
    ExecResult,
    FileInfo,
    GrepMatch,
    Snapshot,
)
from ._watch import MAX_WATCHES, Watcher
from .core.commands import ExecCall, events_until_exit, forget_finished, process_request
from .core.fileops import make_directory, not_the_workdir, rename_entry, search_bounded
from .core.live import Attachment, LiveSandbox, closed_message
from .core.refs import ref_serving
from .core.session import SandboxSession
from .providers._grep import grep_output_budget
from .providers.base import (
    BackendProcess,
    PtyProcess,
    SandboxBackend,
    UnstartedProcess,
)
from .states import FINAL, SandboxState

if TYPE_CHECKING:
    from .config import SandboxSpec
    from .lifecycle.gate import LifecycleGate
    from .lifecycle.records import LifecycleRecord
    from .states import SandboxStatus
    from .store import RefRow


class Sandbox(SandboxSession):
    """One sandbox: exec, files, grep, glob, and its lifecycle.

    Make one with :func:`hutch.create_sandbox`; use it as an async context
    manager (or call :meth:`close`) so its resources are released. The
    session that makes it owns it; :meth:`ref` hands out a reference with
    which :func:`hutch.attach` opens another, non-owning session on it.
    """

    id: str
    #: When this session was opened (Unix time), and its id.
    created_at: float
    session_id: str

    def __init__(
        self,
        backend: SandboxBackend,
        *,
        sandbox_id: str | None = None,
        read_before_write: bool = True,
        output_limit: int = DEFAULT_OUTPUT_LIMIT,
        gate: LifecycleGate | None = None,
        factory: SandboxFactory | None = None,
    ) -> None:
        self.id = sandbox_id or backend.sandbox_id
        #: What starts its forks' branches (None: it cannot be forked here).
        self._factory = factory
        self._live = LiveSandbox(self.id, backend, gate)
        self.output_limit = output_limit
        self._guard = ReadBeforeWriteGuard(read_before_write)
        self.created_at = time.time()
        self.session_id = uuid.uuid4().hex[:12]
        self._owner = True
        self._detached = False
        #: The ref an attached session came in with (None for the owner).
        self._ref: RefRow | None = None

        #: The settings it was made with (what a fork's branches start from).
        self.spec: SandboxSpec | None = None
        #: The snapshot it was started from or last captured: its parent in
        #: the lineage tree of the next snapshot taken of it.
        self.base_snapshot_id: str | None = None
        #: The snapshot it was started from, if any: it depends on that
        #: snapshot until it captures a state of its own.
        self.origin_snapshot_id: str | None = None
    def _attached_session(self, ref: RefRow) -> Sandbox:
        """A new non-owning session on this live sandbox, with a guard of its own."""
        session = object.__new__(Sandbox)
        session._ref = ref
        session.id = self.id
        session._live = self._live
        session._factory = self._factory
        session.output_limit = self.output_limit
        session._guard = ReadBeforeWriteGuard(self._guard.enabled)
        session.created_at = time.time()
        session.session_id = uuid.uuid4().hex[:12]
        session._owner = False
        session._detached = False
        # Where it stands in the lineage tree, as of now (its snapshots are the owner's).
        session.spec = self.spec
        session.base_snapshot_id = self.base_snapshot_id
        session.origin_snapshot_id = self.origin_snapshot_id
        self._live.attached[session.session_id] = Attachment(
            session.session_id, ref, session.created_at
        )
        return session

    # -- identity -------------------------------------------------------------
    @property
    def provider(self) -> str:
        return self._backend.provider

    @property
    def capabilities(self) -> Capabilities:
        return self._backend.sandbox_capabilities()

    @property
    def workdir(self) -> str:
        return self._backend.workdir

    @property
    def closed(self) -> bool:
        """Closed (by its owner, or reaped), or, for an attached session, detached."""
        return self._live.closed or self._detached

    @property
    def open_operations(self) -> int:
        """Execs, streams and running background commands open right now."""
        return self._live.open_operations

    def require(self, capability: str) -> None:
        if not self.capabilities.supports(capability):
            raise CapabilityUnsupported.for_provider(self.provider, capability)

    def path(self, path: str) -> str:
        """The absolute path inside the sandbox that ``path`` names."""
        return sandbox_path(self.workdir, path)

    # -- exec ---------------------------------------------------------------------
    async def _kill_left(self, exc: KillIncomplete) -> None:
        """A kill left processes: an event of the sandbox says so, beside
        the error its caller gets."""
        if self._gate is not None:
            await self._gate.note(self._live, "kill", exc.message)

    async def _start_backend(self, call: ExecCall) -> BackendProcess:
        self.require("processes")
        if call.user is not None:
            self.require("users")
        request = process_request(self._runtime, self.workdir, call)
        try:
            return await self._runtime.start_process(request)
        except NoSuchUser as exc:
            # A command that could not start, as every execution API says it.
            return UnstartedProcess(exc.message)

    async def exec(
        self,
        cmd: Command,
        *,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        stdin: bytes | str | None = None,
        user: str | None = None,
        timeout: float | None = None,
        output_limit: int | None = None,
    ) -> ExecResult:
        """Run ``cmd`` to completion. A non-zero exit is a result, not an error.

        ``timeout`` kills the command's whole process tree and raises
        ``ExecTimeout``; output past ``output_limit`` bytes kills it and raises
        ``OutputLimitExceeded``.
        """
        call = ExecCall(cmd, cwd, env, stdin, user, timeout, output_limit)
        with await self._exec_output(call) as output:
            return output.result()

    async def _exec_output(self, call: ExecCall) -> ExecOutput:
        """As :meth:`exec`, its output left spooled (see :func:`exec_output`)."""
        if call.timeout is not None and call.timeout <= 0:
            raise InvalidArgument(f"timeout must be positive, got {call.timeout}")
        async with self._operation("exec"):
            proc = await self._start_backend(call)
            return await collect_output(
                proc, timeout=call.timeout, output_limit=call.output_limit or self.output_limit,
                kill_left=self._kill_left,
            )

    async def start(
        self,
        cmd: Command,
        *,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        stdin: bytes | str | None = None,
        user: str | None = None,
        output_limit: int | None = None,
        keep_stdin: bool = False,
    ) -> Process:
        """Start ``cmd`` in the background; the handle waits, streams or kills.

        ``stdin`` is fed to it and then closed, unless ``keep_stdin``: then
        its stdin stays open after those bytes, for the handle's
        ``write_stdin`` and ``close_stdin`` (a command that reads it waits
        for more until it is closed)."""
        if not isinstance(keep_stdin, bool):
            raise InvalidArgument(f"keep_stdin must be true or false, not {keep_stdin!r}")
        # Its stdin stays in memory until the command takes it, which may be
        # never, so it counts against the memory budget until the command ends.
        # Sized only for what stdin may be: anything else is refused, typed,
        # by the one check of a call (process_request) below.
        held = len(stdin) if isinstance(stdin, bytes | bytearray | memoryview | str) else 0
        hold = MemoryHold(held, "the stdin of a background command")
        try:
            async with self._operation("start"):
                proc = await self._start_backend(
                    ExecCall(cmd, cwd, env, stdin, user, keep_stdin=keep_stdin)
                )
                process = Process(
                    proc,
                    command=cmd if isinstance(cmd, str) else shlex.join(cmd),
                    output_limit=output_limit or self.output_limit,
                    on_exit=self._process_exited,
                    hold=hold,
                    keep_stdin=keep_stdin and not isinstance(proc, UnstartedProcess),
                    kill_left=self._kill_left,
                )
        except BaseException:
            hold.release()
            raise
        self._processes[process.id] = process
        return process

    def process(self, process_id: str) -> Process:
        forget_finished(self._processes)
        try:
            return self._processes[process_id]
        except KeyError:
            raise NotFound(f"no background command {process_id} in sandbox {self.id}") from None

    def processes(self) -> list[Process]:
        forget_finished(self._processes)
        return list(self._processes.values())

    @asynccontextmanager
    async def pty(
        self,
        cmd: Command | None = None,
        *,
        rows: int = 24,
        cols: int = 80,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        user: str | None = None,
    ) -> AsyncIterator[PtyProcess]:
        """An interactive command (a shell by default) on a pseudo-terminal:
        read its output, write what is typed, resize it. Open, it keeps the
        sandbox busy; on leaving, what still runs of it is killed."""
        for name, value in (("rows", rows), ("cols", cols)):
            if isinstance(value, bool) or not isinstance(value, int) or not 0 < value < 1000:
                raise InvalidArgument(f"{name} must be 1..999, got {value!r}")
        self.require("processes")
        if user is not None:
            self.require("users")
        request = process_request(self._runtime, self.workdir, ExecCall(
            ["bash"] if cmd is None else cmd, cwd, {"TERM": "xterm-256color", **(env or {})},
            user=user,
        ))
        async with self._operation("pty"):
            proc = await self._runtime.start_pty(request, rows=rows, cols=cols)
            try:
                yield proc
            finally:
                if proc.returncode is None:
                    await kill_shielded(proc, self._kill_left)

    async def exec_stream(
        self,
        cmd: Command,
        *,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        stdin: bytes | str | None = None,
        user: str | None = None,
        timeout: float | None = None,
        output_limit: int | None = None,
    ) -> AsyncIterator[StreamEvent]:
        """Run ``cmd`` and yield its output as it is produced, then its exit status."""
        # One call from start to exit, as exec is: in flight all along for
        # the other programs sharing the sandbox (their suspend waits for it).
        async with self._operation("exec"):
            process = await self.start(
                cmd, cwd=cwd, env=env, stdin=stdin, user=user, output_limit=output_limit
            )
            try:
                async with aclosing(events_until_exit(process, timeout)) as events:
                    async for event in events:
                        yield event
            finally:
                if process.running:
                    await process.kill()
                self._processes.pop(process.id, None)

    # -- files --------------------------------------------------------------------
    async def read_bytes(self, path: str, *, limit: int = DEFAULT_READ_LIMIT) -> bytes:
        full = self.path(path)
        async with self._operation("read"):
            data = await self._runtime.read_file(full, limit)
        self._session_guard.mark_read(full)
        return data

    async def read_pieces(
        self, path: str, *, limit: int = DEFAULT_READ_LIMIT
    ) -> AsyncGenerator[bytes, None]:
        """The bytes of ``path`` in pieces, for a large file to stream out (where
        the provider can, it is never whole in memory); errors come first."""
        full = self.path(path)
        async with self._operation("read"):
            pieces = self._runtime.read_file_pieces(full, limit)
            try:
                async for piece in pieces:
                    self._session_guard.mark_read(full)
                    yield piece
            finally:
                await pieces.aclose()

    async def read_text(
        self, path: str, *, limit: int = DEFAULT_READ_LIMIT, encoding: str = "utf-8"
    ) -> str:
        return (await self.read_bytes(path, limit=limit)).decode(encoding)

    async def write_bytes(self, path: str, data: bytes, *, overwrite: bool = False) -> None:
        """Write ``data`` to ``path``. An existing file this session has not
        read is refused (read before write) unless ``overwrite`` says the
        caller means to replace it, as a person's ``cp`` does."""
        if not isinstance(data, bytes | bytearray | memoryview):
            raise InvalidArgument(f"data must be bytes, not {type(data).__name__}")
        full = self.path(path)
        await self._write(full, lambda: self._runtime.write_file(full, bytes(data)), overwrite)

    async def write_from(
        self, path: str, source: IO[bytes], *, overwrite: bool = False
    ) -> None:
        """Write what the binary file ``source`` holds, from its position on, to
        ``path``; where the provider can, in pieces, never whole in memory.
        ``overwrite`` as for :meth:`write_bytes`."""
        full = self.path(path)
        await self._write(full, lambda: self._runtime.write_file_from(full, source), overwrite)

    async def write_text(
        self, path: str, text: str, *, encoding: str = "utf-8", overwrite: bool = False
    ) -> None:
        await self.write_bytes(path, text.encode(encoding), overwrite=overwrite)

    async def stat(self, path: str) -> FileInfo:
        async with self._operation("stat"):
            return await self._runtime.stat(self.path(path))

    async def exists(self, path: str) -> bool:
        async with self._operation("stat"):
            return await self._runtime.exists(self.path(path))

    async def list_dir(self, path: str = ".") -> list[FileInfo]:
        async with self._operation("list"):
            return await self._runtime.list_dir(self.path(path))

    async def remove(self, path: str, *, recursive: bool = False) -> None:
        full = self.path(path)
        if within(self.workdir, full):
            # Every command runs there, on every provider: without it, none
            # could run again (docker's is a mount point, not removable at all).
            raise InvalidArgument(
                f"{path!r} is the sandbox's working directory ({self.workdir}) or holds "
                "it: not a file to delete; remove what is in it instead"
            )
        async with self._operation("remove"):
            await self._session_guard.check_delete(self._runtime, full)
            await self._runtime.remove(full, recursive)
        self._session_guard.forget(full)

    async def mkdir(self, path: str, *, parents: bool = False, exist_ok: bool = False) -> None:
        """Make the directory ``path`` (mode 0755), as ``pathlib.Path.mkdir``:
        its missing parents too with ``parents`` (else SandboxFileNotFound
        when its parent is missing); a directory already there is
        SandboxFileExists unless ``exist_ok``; anything else there (a file)
        is SandboxFileExists always, and a file where a parent must be is
        SandboxNotADirectory."""
        full = self.path(path)
        async with self._operation("mkdir"):
            await make_directory(self._runtime, full, parents=parents, exist_ok=exist_ok)

    async def rename(self, source: str, destination: str, *, overwrite: bool = False) -> None:
        """Move ``source`` to ``destination`` inside the sandbox (a file or a
        whole directory, in one step where the file system can). The
        destination's directory must exist. Something already at
        ``destination`` is SandboxFileExists unless ``overwrite``; then, as
        rename(2): a file replaces a file, a directory an empty directory
        (a directory onto a file is SandboxNotADirectory, a file onto a
        directory SandboxIsADirectory, onto a non-empty one
        SandboxFileExists). A directory into itself, and the working
        directory (or one that holds it) either way, are InvalidArgument."""
        full_source, full_destination = self.path(source), self.path(destination)
        not_the_workdir(self.workdir, source, full_source, "rename")
        not_the_workdir(self.workdir, destination, full_destination, "replace")
        async with self._operation("rename"):
            await rename_entry(self._runtime, full_source, full_destination, overwrite=overwrite)
        # What this session had read, it knows under its new name.
        if self._session_guard.needs_check(full_source):
            self._session_guard.forget(full_destination)
        else:
            self._session_guard.mark_read(full_destination)
        self._session_guard.forget(full_source)

    async def watch(self, path: str = ".", *, recursive: bool = False) -> Watcher:
        """Watch the directory ``path`` for changes below it (in every
        directory below it too when ``recursive``), from the moment this
        returns: a :class:`~hutch._watch.Watcher` whose events (created,
        written, removed, renamed) come as a stream (``async for``) or
        collected since the last look (``await watcher.events(wait=...)``).
        SandboxFileNotFound when ``path`` is missing, SandboxNotADirectory
        when it is not a directory. ``capabilities.watch`` says how the
        sandbox's runtime learns of changes (``inotify`` or ``poll``).
        Watching is not activity: it keeps no idle sandbox awake."""
        if not isinstance(recursive, bool):
            raise InvalidArgument(f"recursive must be true or false, not {recursive!r}")
        full = self.path(path)
        if len(self._live.watchers) >= MAX_WATCHES:
            raise ResourceExhausted(
                f"sandbox {self.id} has {MAX_WATCHES} watches open: close one first"
            )
        async with self._operation("watch", activity=False):
            runtime = self._runtime
            backend = await runtime.watch(full, recursive)
        watcher = Watcher(backend, full, recursive, runtime.watch_kind,
                          on_close=self._watch_closed)
        self._live.watchers[watcher.id] = watcher
        return watcher

    def watcher(self, watcher_id: str) -> Watcher:
        """A watch of this sandbox by its id (NotFound once closed)."""
        try:
            return self._live.watchers[watcher_id]
        except KeyError:
            raise NotFound(f"no watch {watcher_id} in sandbox {self.id}") from None

    async def grep(
        self,
        pattern: str,
        path: str = ".",
        *,
        glob: str | None = None,
        ignore_case: bool = False,
        limit: int = DEFAULT_READ_LIMIT,
        timeout: float = DEFAULT_SEARCH_TIMEOUT,
    ) -> list[GrepMatch]:
        """Lines matching the regex ``pattern`` in files below ``path``.

        Regular files only. Past ``timeout`` seconds the search is stopped,
        with whatever it started, and ``ExecTimeout`` raised: a pattern that
        backtracks or a tree too large costs its caller, never the others.
        """
        try:
            regex = re.compile(pattern, re.IGNORECASE if ignore_case else 0)
        except re.error as exc:
            raise InvalidArgument(f"bad regular expression {pattern!r}: {exc}") from None
        async with self._operation("grep"), search_bounded("grep", timeout):
            with grep_output_budget():
                matches = await self._runtime.grep(regex, self.path(path), glob, limit)
        for match in matches:
            self._session_guard.mark_read(match.path)
        return matches

    async def glob(
        self, pattern: str, path: str = ".", *, timeout: float = DEFAULT_SEARCH_TIMEOUT
    ) -> list[str]:
        """Files below ``path`` whose relative path matches ``pattern``, as
        ``pathlib.Path.glob`` matches: ``*.py`` is the top level only,
        ``**/*.py`` every depth."""
        async with self._operation("glob"), search_bounded("glob", timeout):
            return await self._runtime.glob(pattern, self.path(path))

    async def preview_url(self, port: int) -> str:
        if not 0 < port < 65536:
            raise InvalidArgument(f"port must be 1..65535, got {port}")
        self.require("preview_url")
        # Through the gate, though not activity: an expired sandbox answers
        # with its reason, and a suspended one is brought back (a URL into a
        # removed container would lead nowhere).
        async with self._operation("preview_url", activity=False):
            return await self._backend.preview_url(port)

    # -- lifecycle ------------------------------------------------------------------
    @property
    def state(self) -> SandboxState:
        if self._live.record is not None:
            return self._live.record.state
        return SandboxState.TERMINATED if self._live.closed else SandboxState.RUNNING

    def status(self) -> SandboxStatus:
        """State, reason, deadline, idle time and meter. Reading it is not activity."""
        status: SandboxStatus = self._engine().status(self._live)
        return status

    async def info(self) -> dict[str, Any]:
        """What the sandbox is and how it is: identity, capabilities, status, memory.

        Plain JSON-ready data, the same a daemon answers for the sandbox.
        Reading it is not activity.
        """
        # Limits another program holding the sandbox set: read off the loop here.
        await self._engine().look_at_limits(self._live)
        memory = disk = None
        if self.state not in FINAL:
            try:
                memory = await self._backend.memory_bytes()
                disk = await self._backend.disk_bytes()
            except Exception:  # a figure for a dashboard: its absence is an answer
                pass
        return self._live.info_json(self.status(), memory, disk)

    @property
    def meter(self) -> dict[str, float]:
        """Seconds spent running, paused and suspended so far."""
        return self.status().meter

    async def pause(self) -> None:
        """Hold the sandbox as it is: processes and memory stay, no CPU is used."""
        self.require("pause")
        await self._engine().pause(self._live)

    async def suspend(self) -> None:
        """Free the sandbox's memory and keep its state on disk until resume."""
        self.require("suspend")
        await self._engine().suspend(self._live)

    async def resume(self) -> None:
        """Bring a paused or suspended sandbox back to running."""
        await self._engine().resume(self._live)

    # -- snapshots and forks ------------------------------------------------------------
    async def snapshot(self, label: str | None = None, *, diff: bool = True) -> Snapshot:
        """Capture this sandbox's state (running, paused or suspended; it stays
        as it is) and return the snapshot. ``diff``: the provider may store
        only what changed since the state this sandbox started from."""
        self.require("snapshot")
        sid = new_snapshot_id()
        if self._gate is not None:
            async with self._gate.held(self._live):
                handle = await self._backend.capture(sid, diff=diff)
        else:
            if self._live.closed:
                raise SandboxUnavailable(f"sandbox {self.id} has been closed")
            handle = await self._backend.capture(sid, diff=diff)
        record = snapshot_record(
            handle, label=label, sandbox_id=self.id, parent_id=self.base_snapshot_id,
            spec=self.spec.model_dump() if self.spec is not None else {},
        )
        self.base_snapshot_id = record.id
        return record

    async def fork(self, label: str | None = None, *, count: int = 0) -> Fork:
        """Snapshot this sandbox and return a handle whose ``attach()`` starts
        independent branches from that state (any number of them); ``count``
        branches are started at once (``fork.branches``)."""
        self.require("fork")
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise InvalidArgument(f"fork count must be a non-negative integer, not {count!r}")
        if self._factory is None:
            raise SandboxUnavailable(
                f"sandbox {self.id} was made without a factory for its branches: "
                "make it with hutch.create_sandbox to fork it"
            )
        snapshot = await self.snapshot(label)
        fork = Fork(snapshot, self._factory)
        if count > 1 and self._backend.branches_concurrently:
            fork.branches.extend(await self._branch_together(self._factory, snapshot, count))
        else:
            for _ in range(count):
                await fork.attach()
        return fork

    @staticmethod
    async def _branch_together(
        factory: SandboxFactory, snapshot: Snapshot, count: int
    ) -> list[Sandbox]:
        """``count`` sandboxes from ``snapshot`` started at once (a provider
        whose branches may start side by side); all or none: where one fails
        (or the caller gives up), those started are closed and the first
        failure raised."""
        started: list[Sandbox | None] = [None] * count
        failures: list[Exception] = []

        async def one(index: int) -> None:
            try:
                started[index] = await factory.from_snapshot(snapshot, None)
            except Exception as exc:  # raised below, once every start has ended
                failures.append(exc)

        try:
            async with anyio.create_task_group() as group:
                for index in range(count):
                    group.start_soon(one, index)
            if failures:
                raise failures[0]
        except BaseException:
            with anyio.CancelScope(shield=True):
                for made in started:
                    if made is not None:
                        with suppress(Exception):
                            await made.close()
            raise
        return [made for made in started if made is not None]

    async def set_timeout(self, seconds: float) -> float:
        """Make the sandbox's deadline now + ``seconds``; returns it as Unix time."""
        deadline: float = await self._engine().set_timeout(self._live, seconds)
        return deadline

    async def close(self) -> None:
        """The owner's close kills background commands and releases the sandbox
        (for every session); an attached session's only detaches it. Idempotent."""
        if not self._owner:
            self._detached = True
            self._live.attached.pop(self.session_id, None)
            return
        try:
            if self._live.closed:  # reaped (or being reaped): done once it is released
                await self._live.released.wait()
                return
            # Recorded ended and released as one: a caller that gives up meanwhile
            # (a client gone) leaves neither a live record nor a runtime behind.
            with anyio.CancelScope(shield=True):
                if self._gate is not None:
                    await self._gate.closed(self._live)
                    fault_point("delete.recorded")
                await self._live.reap()
        finally:
            server, self._live.server = self._live.server, None
            if server is not None:
                await server.close()

    # -- references -------------------------------------------------------------------
    async def ref(self, *, expires_in: float | None = None) -> str:
        """An opaque reference to this live sandbox for :func:`hutch.attach`,
        in this process or in another: it carries where the sandbox is served.

        Only the owner hands them out. The first one starts serving the
        sandbox to other processes, on a private unix socket, for as long as
        the owner keeps it (see :mod:`hutch.server.owner`). ``expires_in``
        seconds bound how long it works; :meth:`revoke_ref` ends it sooner.
        """
        if not self._owner:
            raise SandboxPermissionDenied(
                f"only the owner of sandbox {self.id} hands out refs; this session is attached"
            )
        if expires_in is not None:
            check_ref_lifetime(expires_in)
        async with self._live.server_lock:
            if self._live.closed:
                raise SandboxUnavailable(closed_message(self.id))
            if self._live.server is None:
                self._live.server = await ref_serving().start(self)
            server = self._live.server
        return await server.hand_out(expires_in)

    async def revoke_ref(self, ref: str) -> None:
        """End a ref this sandbox handed out (the ref itself, or its id): it
        attaches no more, and sessions holding it are refused. Idempotent."""
        if not self._owner:
            raise SandboxPermissionDenied(
                f"only the owner of sandbox {self.id} revokes refs; this session is attached"
            )
        if self._live.server is None:
            raise NotFound(f"no ref {ref} for sandbox {self.id}: it has handed none out")
        await self._live.server.revoke(ref)

    async def __aenter__(self) -> Sandbox:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def __repr__(self) -> str:
        return f"<Sandbox {self.id} provider={self.provider}>"


def attach_session(owner: Sandbox, ref: RefRow) -> Sandbox:
    """A new attached session on the live sandbox ``owner`` owns, through
    ``ref`` (checked by the caller)."""
    if owner.closed:
        raise SandboxUnavailable(closed_message(owner.id))
    return owner._attached_session(ref)


# -- the lifecycle seam: what a lifecycle engine (and the daemon over it) does to
# an in-process sandbox; a sandbox's callers never need it, a remote one has none.


def live_of(sandbox: Sandbox) -> LiveSandbox:
    """The live sandbox under a session: what a lifecycle engine (and the
    daemon over it) tracks and drives; a remote sandbox has none."""
    return sandbox._live


def lifecycle_record(sandbox: Sandbox) -> LifecycleRecord | None:
    """The lifecycle engine's record of the live sandbox (None: untracked)."""
    return sandbox._live.record


async def exec_output(sandbox: Sandbox, call: ExecCall) -> ExecOutput:
    """As ``sandbox.exec``, its output left spooled (memory, then disk) to be
    read in pieces: what a server answering with a large output uses, so
    that the output is never whole in its memory. Close the answer.

    A function, not a method: a caller holding a sandbox (in-process or
    remote) takes ``exec``'s bytes; only the daemon needs the spool."""
    return await sandbox._exec_output(call)


def forget_process(sandbox: Sandbox, process_id: str) -> None:
    """Drop a command started by ``Sandbox.start`` from its list (one whose
    output the daemon streamed to the end, or killed)."""
    sandbox._processes.pop(process_id, None)


def guard_enabled(sandbox: Sandbox) -> bool:
    """Whether the session's read-before-write guardrail is on."""
    return sandbox._guard.enabled


def backend_of(sandbox: Sandbox) -> SandboxBackend:
    """The provider backend under an in-process sandbox.

    For the layers that drive a provider directly (the lifecycle engine, the
    daemon) and for tests of a provider; callers of a sandbox never need it,
    and a remote sandbox has none.
    """
    return sandbox._backend


def new_sandbox_id() -> str:
    return "sb-" + uuid.uuid4().hex[:12]
