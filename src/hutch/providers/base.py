"""The provider seam: what every backend implements, in two halves.

**Provisioning and lifecycle** (:class:`SandboxBackend`): ``create`` provisions
one sandbox from a config model; ``describe``/``reconnect`` find it again
after a restart; ``pause``/``suspend``/``resume``/``close`` and the rest are
each behind a capability.

**Runtime** (:class:`SandboxRuntime`): what executes and moves files in that
sandbox: processes (``start_process``, ``shell_argv``), the busy count, files
(read, write, stat, list, remove, walk), ``grep`` and ``glob``.

A backend names its runtime in :attr:`SandboxBackend.runtime`. Most are
their own native runtime (docker exec and the archive API, a subprocess,
ssh): they subclass :class:`NativeBackend`, both halves in one class. A
runtime that keeps its files in an object of their own
(:class:`SandboxFiles`) subclasses :class:`FilesRuntime`, which forwards to
it. A backend that can hand its runtime over to another (hutch's agent
inside the sandbox, :mod:`hutch.providers.agent`) overrides
:attr:`SandboxBackend.runtime`; everything above this seam (exec timeouts and
output caps, background processes, the read-before-write guardrail, the
lifecycle engine, the daemon) calls ``backend.runtime``, never the runtime
methods on the backend directly, so the transport changes without touching
anything above. :meth:`SandboxBackend.sandbox_capabilities` says which
runtime a sandbox has (``Capabilities.runtime``: ``native`` or ``agent``).

Backends raise hutch's typed errors (``hutch._errors``); a backend failure
that is not one of them is wrapped as ``ProviderError`` by the caller.
"""

from __future__ import annotations

import abc
import dataclasses
import enum
import re
import stat
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping
from typing import IO, Any, ClassVar

from pydantic import BaseModel, model_validator

from .._errors import (
    CapabilityUnsupported,
    HutchError,
    InvalidArgument,
    OutputLimitExceeded,
    ProviderError,
    SandboxFileExists,
    SandboxFileNotFound,
    SandboxIsADirectory,
    SandboxNotADirectory,
    SandboxPermissionDenied,
    SandboxUnavailable,
)
from .._globmatch import compile_glob
from .._types import Capabilities, FileInfo, FileType, GrepMatch, ProviderSnapshot
from .._values import text_problems
from ._grep import GrepBatches
from .base_process import EXEC_MARKER as EXEC_MARKER
from .base_process import SANDBOX_MARKER as SANDBOX_MARKER
from .base_process import BackendProcess as BackendProcess
from .base_process import FutureExitProcess as FutureExitProcess
from .base_process import ProcessRequest as ProcessRequest
from .base_process import PtyProcess as PtyProcess
from .base_process import UnstartedProcess as UnstartedProcess
from .watching import BackendWatch, PollWatch


class RuntimeState(enum.Enum):
    """A sandbox's runtime as its provider sees it (:meth:`SandboxBackend.observed_state`)."""

    RUNNING = "running"
    #: Frozen (docker pause, the cgroup freezer): processes and memory held.
    PAUSED = "paused"
    #: Up, running or paused: the provider cannot tell which (the record says).
    LIVE = "live"
    #: Down, its state kept where ``resume`` brings it back from.
    SUSPENDED = "suspended"
    #: Nothing left to run or resume.
    GONE = "gone"


@dataclasses.dataclass(frozen=True)
class RuntimeNotice:
    """What a provider's watcher saw happen to a sandbox outside hutch's hands."""

    sandbox_id: str
    #: What happened, for a person ("its container ... was removed outside hutch").
    message: str
    #: The runtime may be gone (removed, killed): the sandbox fails if
    #: ``is_alive`` confirms it. Otherwise it is only told in its events (a
    #: process in it was OOM-killed).
    may_have_died: bool = True
    #: About what a suspended sandbox keeps (its suspend image, removed):
    #: it fails if :meth:`SandboxBackend.is_suspended` confirms it is gone.
    of_suspended: bool = False


RuntimeReport = Callable[[RuntimeNotice], Awaitable[None]]


class RuntimeLost(SandboxUnavailable):
    """A backend step found the sandbox's runtime gone for good, removed
    outside hutch (a suspended container's image deleted): the lifecycle
    engine fails the sandbox with this message as its reason, rather than
    passing on what the provider said of it (a registry's 404 about a pull).
    Its wire code stays ``sandbox_unavailable``; defined here, not in
    ``_errors``, so that the code still names :class:`SandboxUnavailable`."""



# Kills (SIGKILL) every process whose environment has an exec marker of any
# value and the sandbox's marker ($1), except this script's own exec (and
# what it runs); prints how many it killed.
_END_LEFTOVERS = r"""
own="EXEC=$(printenv EXEC)"; n=0
for d in /proc/[0-9]*; do
  e=$(tr '\0' '\n' < "$d/environ" 2>/dev/null) || continue
  printf '%s\n' "$e" | grep -qxF -e "$own" && continue
  printf '%s\n' "$e" | grep -qxF -e "$1" || continue
  printf '%s\n' "$e" | grep -q '^EXEC=' || continue
  kill -KILL "${d#/proc/}" 2>/dev/null && n=$((n + 1))
done
echo "$n"
""".replace("EXEC", EXEC_MARKER)


class ProviderSettings(BaseModel):
    """The settings of one provider. Every provider's ``config_model``
    subclasses it, with ``type`` narrowed to its registry name
    (``type: Literal["docker"] = "docker"``); hutch finds the model through the
    registry, so a provider's settings are validated by its own model alone."""

    type: str

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, data: Any) -> Any:
        """No setting of any provider holds text no system call takes (a lone
        surrogate, a NUL byte): refused naming it, before the provider's
        own fields are read."""
        for problem in text_problems(data, ""):
            raise ValueError(problem)
        return data


class SandboxPart(abc.ABC):
    """What both halves of a provider know: which provider, which sandbox,
    and the directory relative paths resolve from."""

    #: The provider name errors are reported under (``local``, ``docker``...).
    provider: ClassVar[str]

    def __init__(self, sandbox_id: str, workdir: str) -> None:
        self.sandbox_id = sandbox_id
        #: Absolute path, inside the sandbox, that relative paths resolve from.
        self.workdir = workdir


class SandboxFiles(abc.ABC):
    """File operations on one sandbox's file system, in sandbox paths
    (absolute), with hutch's typed errors. Every runtime has them; a runtime
    that keeps its files in an object of their own (the host's file system, a
    root on the host, SFTP) forwards to it (:class:`FilesRuntime`)."""

    @abc.abstractmethod
    async def read_file(self, path: str, limit: int) -> bytes:
        """Bytes of ``path`` (absolute); OutputLimitExceeded past ``limit``."""

    @abc.abstractmethod
    async def write_file(self, path: str, data: bytes) -> None:
        """Write ``data`` to ``path`` (absolute), creating parent directories."""

    async def read_file_pieces(self, path: str, limit: int) -> AsyncGenerator[bytes, None]:
        """The bytes of ``path`` in pieces, for a large file to stream out;
        errors (missing, over ``limit``) come with the first. Files that can
        read in pieces override this, so that the file is never whole in
        memory."""
        yield await self.read_file(path, limit)

    async def write_file_from(self, path: str, source: IO[bytes]) -> None:
        """Write what ``source`` holds (from its position on) to ``path``, as
        :meth:`write_file` does. Files that can copy in pieces override this,
        so that a large upload is never whole in memory."""
        await self.write_file(path, source.read())

    @abc.abstractmethod
    async def stat(self, path: str) -> FileInfo: ...

    @abc.abstractmethod
    async def list_dir(self, path: str) -> list[FileInfo]: ...

    @abc.abstractmethod
    async def remove(self, path: str, recursive: bool) -> None: ...

    @abc.abstractmethod
    async def walk_files(self, root: str) -> list[str]:
        """Every regular file below ``root`` (absolute paths), for grep and glob:
        links to regular files too; never a FIFO, device or socket (a read of
        one may never end)."""

    async def make_dir(self, path: str, parents: bool) -> None:
        """Make the directory ``path`` (mode 0755), and its missing parents
        too when ``parents``. Typed errors: SandboxFileExists (something is
        there), SandboxFileNotFound (no parent, without ``parents``),
        SandboxNotADirectory (a parent is a file). :meth:`hutch.Sandbox.mkdir`
        has checked what it could first (``exist_ok``)."""
        raise CapabilityUnsupported(f"{type(self).__name__} cannot make directories")

    async def rename(self, source: str, destination: str) -> None:
        """Move ``source`` to ``destination`` as rename(2) does: a file
        replaces a file, a directory an empty directory. Typed errors:
        SandboxFileNotFound (no source, no destination directory),
        SandboxFileExists (a non-empty directory in the way),
        SandboxIsADirectory / SandboxNotADirectory (a file onto a directory,
        a directory onto a file), InvalidArgument (a directory into itself).
        :meth:`hutch.Sandbox.rename` has checked what it could first (an
        existing destination without ``overwrite``)."""
        raise CapabilityUnsupported(f"{type(self).__name__} cannot rename files")

    async def watch(self, path: str, recursive: bool) -> BackendWatch:
        """Watch the directory ``path`` (and every directory below it when
        ``recursive``) from now on: SandboxFileNotFound when it is missing,
        SandboxNotADirectory when it is not a directory. By looking again
        and again (:class:`~.watching.PollWatch`) where a runtime has
        nothing better; its :attr:`SandboxRuntime.watch_kind` says which."""
        return await PollWatch(self, path, recursive).start()


#: What mkdir and mv (GNU coreutils, busybox) say, to the error it means;
#: the first that matches wins.
_TREE_ERRORS: tuple[tuple[str, type[HutchError]], ...] = (
    ("cannot overwrite directory", SandboxIsADirectory),
    ("cannot overwrite non-directory", SandboxNotADirectory),
    ("subdirectory of itself", InvalidArgument),
    ("Not a directory", SandboxNotADirectory),
    ("File exists", SandboxFileExists),
    ("Directory not empty", SandboxFileExists),
    ("No such file", SandboxFileNotFound),
    ("Permission denied", SandboxPermissionDenied),
    ("not permitted", SandboxPermissionDenied),
    ("Read-only", SandboxPermissionDenied),
    ("Is a directory", SandboxIsADirectory),
)


def tree_command_error(said: str, what: str) -> HutchError:
    """The typed error of a failed ``mkdir`` or ``mv`` from what it said."""
    for needle, kind in _TREE_ERRORS:
        if needle in said:
            return kind(f"{what}: {said.strip()[-500:]}")
    return ProviderError(f"{what} failed: {said.strip()[-500:] or 'no reason given'}")


async def bounded_pieces(
    read: Callable[[], Awaitable[bytes]], path: str, limit: int
) -> AsyncGenerator[bytes, None]:
    """What ``read`` gives, piece by piece, until it gives nothing: the file
    ``path`` streamed, OutputLimitExceeded once past ``limit`` bytes (it grew
    after it was measured); an empty file is one empty piece."""
    total = 0
    while piece := await read():
        total += len(piece)
        if total > limit:
            raise OutputLimitExceeded(f"{path} is over the read limit of {limit} bytes")
        yield piece
    if total == 0:
        yield b""


class SandboxRuntime(SandboxPart, SandboxFiles):
    """What executes commands and moves files in one sandbox."""

    #: Which runtime this is, as ``Capabilities.runtime`` reports it.
    runtime_name: ClassVar[str] = "native"
    #: How its :meth:`watch` learns of changes, as ``Capabilities.watch``
    #: reports it: ``inotify`` or ``poll``.
    watch_kind: ClassVar[str] = "poll"

    # -- processes ---------------------------------------------------------
    def shell_argv(self, command: str) -> list[str]:
        """The argv that runs a shell string: bash where there is one, else sh."""
        return ["bash", "-c", command]

    async def start_process(self, request: ProcessRequest) -> BackendProcess:
        raise CapabilityUnsupported.for_provider(self.provider, "processes")

    async def count_busy_processes(self) -> int:
        """Processes alive in the sandbox other than its own keeper."""
        return 0

    async def warm(self) -> None:
        """Open ahead what the next request would open on its way (a
        connection to its agent), and pay ahead what only the first command
        pays, for a sandbox made to wait for its first request (a warm
        pool's). Nothing, where nothing is opened per request. Never raises:
        what it fails to do is only not saved."""

    async def end_leftover_commands(self) -> int:
        """SIGKILL every process of a command hutch started in this sandbox
        (an earlier daemon's, whose handles died with it); return how many.

        Written once on ``start_process``: a script in the sandbox kills what
        carries an exec marker and this sandbox's marker, all but itself.
        """
        proc = await self.start_process(ProcessRequest(
            ["sh", "-c", _END_LEFTOVERS, "hutch-end", f"{SANDBOX_MARKER}={self.sandbox_id}"],
            cwd="/",
        ))
        out = []
        while (chunk := await proc.read()) is not None:
            if chunk.stream == "stdout":
                out.append(chunk.data)
        code = await proc.wait()
        words = b"".join(out).decode("utf-8", "replace").split()
        if code != 0 or not words or not words[-1].isdigit():
            raise ProviderError(
                f"ending the commands left in sandbox {self.sandbox_id} failed (exit {code})"
            )
        return int(words[-1])

    async def start_pty(self, request: ProcessRequest, rows: int, cols: int) -> PtyProcess:
        """Start ``request`` (its ``stdin`` unused: what is typed is written)
        on a pseudo-terminal of ``rows`` x ``cols`` (an interactive shell); a
        runtime that has none says so."""
        raise CapabilityUnsupported(
            f"the {self.runtime_name} runtime of sandbox {self.sandbox_id} has no "
            "pseudo-terminal (hutch's agent runtime has one)"
        )

    # -- files: SandboxFiles, and what is built on them -----------------------------
    async def make_dir(self, path: str, parents: bool) -> None:
        """By ``mkdir`` in the sandbox, where a runtime has nothing closer."""
        await self._tree_command(
            ["mkdir", *(["-p"] if parents else []), "--", path], f"mkdir {path}")

    async def rename(self, source: str, destination: str) -> None:
        """By ``mv -T`` in the sandbox (across file systems it copies), where
        a runtime has nothing closer."""
        await self._tree_command(
            ["mv", "-T", "--", source, destination], f"rename {source} to {destination}")

    async def _tree_command(self, argv: list[str], what: str) -> None:
        proc = await self.start_process(ProcessRequest(argv, cwd="/", env={"LC_ALL": "C"}))
        said = []
        while (chunk := await proc.read()) is not None:
            if chunk.stream == "stderr":
                said.append(chunk.data)
        if await proc.wait() != 0:
            raise tree_command_error(b"".join(said).decode("utf-8", "replace"), what)

    async def exists(self, path: str) -> bool:
        try:
            await self.stat(path)
        except FileNotFoundError:
            return False
        return True

    async def glob(self, pattern: str, root: str) -> list[str]:
        # As pathlib's Path.glob: "*.py" is the top level, "**/*.py" every depth.
        return await self._files_matching(pattern, root, name_anywhere=False)

    async def _files_matching(self, pattern: str, root: str, *, name_anywhere: bool) -> list[str]:
        matcher = compile_glob(pattern, name_anywhere=name_anywhere)
        prefix = root.rstrip("/") + "/"
        return sorted(
            p for p in await self.walk_files(root) if matcher.match(p[len(prefix):])
        )

    async def grep(
        self, pattern: re.Pattern[str], root: str, glob: str | None, limit: int
    ) -> list[GrepMatch]:
        """Regex search of text files below ``root`` (or ``root`` itself)."""
        info = await self.stat(root)
        if info.type == FileType.DIRECTORY:
            # grep's glob picks files by name at any depth, as grep --include does.
            files = await self._files_matching(glob or "**", root, name_anywhere=True)
        else:
            files = [root]
        return await self.grep_files(pattern, files, limit)

    async def grep_files(
        self, pattern: re.Pattern[str], paths: list[str], limit: int
    ) -> list[GrepMatch]:
        """The matching lines of ``paths``, by the one rule (:func:`grep_contents`),
        matched in a worker process; what is not a readable regular file is skipped."""
        batches = GrepBatches(pattern)
        for path in paths:
            try:
                data = await self.read_file(path, limit)
            except (OSError, InvalidArgument, ProviderError):
                # Gone, a directory, unreadable, not a regular file, or a procfs
                # entry that will not open (a socket's fd link): skipped, as
                # grep -s skips what it cannot read.
                continue
            except OutputLimitExceeded:
                if (await self.stat(path)).size > limit:
                    raise  # a file really that large: say so, as a read would
                # It said it was small and did not end (a procfs file such as
                # /proc/1/pagemap): not a text file to search.
                continue
            await batches.add(path, data)
        return await batches.matches()


class FilesRuntime(SandboxRuntime):
    """A runtime whose file operations are those of its :attr:`files`: the
    forwarding written once, for every runtime that keeps its files apart."""

    files: SandboxFiles

    async def read_file(self, path: str, limit: int) -> bytes:
        return await self.files.read_file(path, limit)

    async def write_file(self, path: str, data: bytes) -> None:
        await self.files.write_file(path, data)

    async def read_file_pieces(self, path: str, limit: int) -> AsyncGenerator[bytes, None]:
        async for piece in self.files.read_file_pieces(path, limit):
            yield piece

    async def write_file_from(self, path: str, source: IO[bytes]) -> None:
        await self.files.write_file_from(path, source)

    async def stat(self, path: str) -> FileInfo:
        return await self.files.stat(path)

    async def list_dir(self, path: str) -> list[FileInfo]:
        return await self.files.list_dir(path)

    async def remove(self, path: str, recursive: bool) -> None:
        await self.files.remove(path, recursive)

    async def walk_files(self, root: str) -> list[str]:
        return await self.files.walk_files(root)

    async def make_dir(self, path: str, parents: bool) -> None:
        await self.files.make_dir(path, parents)

    async def rename(self, source: str, destination: str) -> None:
        await self.files.rename(source, destination)

    async def watch(self, path: str, recursive: bool) -> BackendWatch:
        return await self.files.watch(path, recursive)


class SandboxBackend(SandboxPart):
    """One sandbox, as a provider provisions it and runs its lifecycle.

    What executes and moves files in it is its :attr:`runtime`, a
    :class:`SandboxRuntime`; a backend that is its own native runtime
    subclasses :class:`NativeBackend`.

    **Snapshots** (the ``snapshot`` capability) are four methods, and
    everything hutch builds on captured state (``Sandbox.snapshot`` and
    ``fork``, workspaces and their suspend, the daemon's reconciliation) is
    written against these alone, never against a provider:

    - :meth:`capture` (instance): write this sandbox's state (its file
      system; memory too where the provider can, saying so in
      ``includes_memory``) to provider storage named by the given snapshot
      id, and return the :class:`ProviderSnapshot`. It must work in every
      live state the provider has (running, paused, suspended) and leave the
      sandbox in the state it found it. ``diff=True`` may store only what
      changed since the state this sandbox was started from or last captured
      (a layer on it: the backend remembers its own base, in ``describe()``
      too, so that it survives a daemon restart); ``diff=False`` writes a
      self-contained state. Either way the result must stay valid after the
      sandbox it came from is closed and after any other snapshot is
      removed: a provider that shares layers between snapshots keeps them
      alive while any snapshot refers to them.
    - :meth:`create_from_snapshot` (class): provision a new, independent
      sandbox from a captured state, with ``config`` (the settings of the
      sandbox the state came from, or of the caller) for everything the state
      does not say. Writes in it are never seen by the snapshot, by the
      origin, or by any other sandbox started from the same state. Should
      cost little whatever the state's size (copy-on-write where possible).
    - :meth:`remove_snapshot` (class): free the storage of one captured
      state. Idempotent: removing what is gone succeeds. Sandboxes already
      started from it keep working.
    - :meth:`held_snapshots` (class): the snapshot ids this provider holds
      storage for under the current hutch home (``$HUTCH_HOME``), so that a
      daemon starting up can drop records whose storage is gone and free
      storage no record names (a capture cut short by a crash).

    Only ``capture`` is per sandbox; a provider that cannot snapshot leaves
    all four as they are here (they raise ``capability_unsupported``), and
    declares ``snapshot=False``.
    """

    #: What this provider can do; see :class:`hutch.Capabilities`.
    capabilities: ClassVar[Capabilities]
    #: The pydantic model ``create`` takes (``type: Literal[provider]``).
    config_model: ClassVar[type[ProviderSettings]]
    #: Whether a daemon on another host sharing the store can find this
    #: provider's sandboxes again from their description (a Docker Engine
    #: they share, an ssh host): a fleet's live daemon then takes over a dead
    #: one's sandboxes; otherwise (only the host that made them can: local,
    #: bubblewrap, in memory) they fail with their host.
    reachable_from_any_host: ClassVar[bool] = False
    #: Whether a sandbox's runtime runs on when the daemon that made it dies
    #: (a keeper, a container), ended by :meth:`release_runtime`: that
    #: host's daemon, back, ends the runtimes of those a fleet recorded
    #: failed while it was gone (``reachable_from_any_host`` False).
    runtime_outlives_its_daemon: ClassVar[bool] = False
    #: Whether several :meth:`create_from_snapshot` of one snapshot may run
    #: at once (a fork's ``count`` branches started together): its branches
    #: share nothing that is written while they start (gvisor: each restore
    #: reads the one checkpoint image and writes only its own directory).
    branches_concurrently: ClassVar[bool] = False

    @classmethod
    def answers_here(cls) -> bool:
        """Whether this host can make the provider's sandboxes now (its engine
        answers). A daemon whose operator names no default provider takes the
        first isolating one that does."""
        return True

    @property
    @abc.abstractmethod
    def runtime(self) -> SandboxRuntime:
        """The runtime serving this sandbox now (its native one, or another it
        hands over to, such as the agent)."""

    def sandbox_capabilities(self) -> Capabilities:
        """This sandbox's capabilities: the provider's, naming its runtime."""
        return dataclasses.replace(self.capabilities, runtime=self.runtime.runtime_name,
                                   watch=self.runtime.watch_kind)

    # -- provisioning ------------------------------------------------------
    @classmethod
    @abc.abstractmethod
    async def create(cls, config: Any, sandbox_id: str) -> SandboxBackend:
        """Provision a new sandbox from ``config`` (an instance of config_model)."""

    def describe(self) -> dict[str, Any]:
        """What the store keeps to find this sandbox again after a restart."""
        return {"provider": self.provider, "workdir": self.workdir}

    @classmethod
    async def reconnect(cls, sandbox_id: str, description: Mapping[str, Any]) -> SandboxBackend:
        """Rebuild a sandbox made by an earlier process from its ``describe()``."""
        raise CapabilityUnsupported.for_provider(cls.provider, "reconnect")

    async def memory_bytes(self) -> int | None:
        """Memory the sandbox holds now, where the provider can tell."""
        return None

    async def disk_bytes(self) -> int | None:
        """Disk the sandbox's own files take now (what it wrote over its image),
        where the provider can tell cheaply; None where it cannot."""
        return None


    async def preview_url(self, port: int) -> str:
        raise CapabilityUnsupported.for_provider(self.provider, "preview_url")

    # -- lifecycle primitives (each behind a capability) ----------------------
    async def pause(self) -> None:
        raise CapabilityUnsupported.for_provider(self.provider, "pause")

    async def unpause(self) -> None:
        raise CapabilityUnsupported.for_provider(self.provider, "pause")

    async def suspend(self) -> None:
        raise CapabilityUnsupported.for_provider(self.provider, "suspend")

    async def resume(self) -> None:
        raise CapabilityUnsupported.for_provider(self.provider, "suspend")

    async def is_alive(self) -> bool:
        """Whether the sandbox's runtime still exists (for reconciliation)."""
        return True

    async def is_suspended(self) -> bool:
        """Whether the sandbox, its runtime down, keeps its state suspended,
        so that ``resume`` brings it back. Asked of a sandbox found again
        that is not alive (another program may have suspended it since it
        was recorded) before it is given up for lost."""
        return False

    async def observed_state(self) -> RuntimeState:
        """What the sandbox's runtime is now, as the provider itself sees it
        (asked of a sandbox found again after a restart: the record may say
        otherwise, when a step was cut short between the provider and the
        store). A provider that can pause or suspend tells paused and
        suspended apart from running; the default only tells up from down."""
        if await self.is_alive():
            return RuntimeState.LIVE
        if await self.is_suspended():
            return RuntimeState.SUSPENDED
        return RuntimeState.GONE

    # -- snapshots (behind the snapshot capability; see the class docstring) -----
    async def capture(self, snapshot_id: str, *, diff: bool = True) -> ProviderSnapshot:
        """Capture this sandbox's state as ``snapshot_id``."""
        raise CapabilityUnsupported.for_provider(self.provider, "snapshot")

    @classmethod
    async def create_from_snapshot(
        cls, config: Any, sandbox_id: str, snapshot: ProviderSnapshot
    ) -> SandboxBackend:
        """Provision a new sandbox started from ``snapshot``."""
        raise CapabilityUnsupported.for_provider(cls.provider, "snapshot")

    @classmethod
    async def remove_snapshot(cls, snapshot: ProviderSnapshot) -> None:
        """Free a captured state's storage. Idempotent."""
        raise CapabilityUnsupported.for_provider(cls.provider, "snapshot")

    @classmethod
    async def held_snapshots(cls) -> list[str]:
        """The ids of the captured states this provider holds storage for."""
        return []

    # -- reconciliation (a daemon starting up) ------------------------------------
    @classmethod
    async def discard(cls, sandbox_id: str) -> None:
        """Free whatever a create of ``sandbox_id`` cut short may have left
        (a container, a directory). Idempotent; nothing there is fine."""
        return None

    @classmethod
    async def reap_orphans(cls, known: set[str]) -> list[str]:
        """Free what this provider made under the current hutch home for
        sandboxes whose ids are not in ``known`` (kept on purpose excepted,
        e.g. docker's ``preserve``); return what was freed."""
        return []

    @classmethod
    async def watch_runtimes(cls, report: RuntimeReport) -> None:
        """Until cancelled, ``report`` what happens to this provider's
        sandboxes outside hutch's hands: a runtime that dies (removed, killed,
        OOM-killed), with a message that says what happened, or a process in
        it the OOM killer ended. A death is a hint, checked against
        :meth:`is_alive`: one about a runtime hutch itself ended (a suspend, a
        close) is harmless. Providers with nothing that can die apart from
        hutch have nothing to watch: the default returns at once."""
        return

    async def release_runtime(self) -> None:
        """Its runtime died outside hutch and the sandbox fails: free what
        the runtime held (mounts, loop devices, its network, its cgroup,
        connections to it) and keep the working directory's files on the
        host, where :meth:`close` (the sandbox's deletion) frees them. After
        it, :meth:`describe` says where the files are, and a :meth:`capture`
        takes them (a failed workspace's are kept as its state). Idempotent.
        The default frees nothing early: close frees it all."""
        return None

    @abc.abstractmethod
    async def close(self) -> None:
        """Release everything this sandbox holds. Idempotent."""


class NativeBackend(SandboxBackend, SandboxRuntime):
    """A backend that is its own native runtime (docker exec, a subprocess,
    ssh): both halves in one class. One that can hand its runtime over to
    another (hutch's agent) overrides :attr:`runtime`."""

    @property
    def runtime(self) -> SandboxRuntime:
        return self


def require_regular(mode: int, path: str) -> None:
    """A typed error unless ``mode`` (a POSIX ``st_mode``) is a regular file's:
    a directory is one; a FIFO or a device may never end (or never start), not
    a file to read."""
    if stat.S_ISDIR(mode):
        raise SandboxIsADirectory(f"{path} is a directory")
    if not stat.S_ISREG(mode):
        raise InvalidArgument(f"{path} is not a regular file; read it with exec")


