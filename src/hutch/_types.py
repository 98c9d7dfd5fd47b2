"""Plain data that crosses the sandbox interface (and the wire)."""

from __future__ import annotations

import enum
import stat
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

# The limits are read here too, where they were first written; their home is
# hutch._limits (constants only: the client reads them without these classes).
from ._limits import DEFAULT_OUTPUT_LIMIT as DEFAULT_OUTPUT_LIMIT
from ._limits import DEFAULT_READ_LIMIT as DEFAULT_READ_LIMIT
from ._limits import DEFAULT_SEARCH_TIMEOUT as DEFAULT_SEARCH_TIMEOUT
from ._limits import KILL_GRACE_SECONDS as KILL_GRACE_SECONDS
from ._limits import MAX_DURATION as MAX_DURATION
from ._limits import MAX_OUTPUT_LIMIT as MAX_OUTPUT_LIMIT
from ._limits import MAX_READ_LIMIT as MAX_READ_LIMIT

#: A command: an argv list run as is, or a string run by ``bash -c`` (``sh -c``
#: where the sandbox has no bash).
Command = str | Sequence[str]


@dataclass(frozen=True, slots=True)
class ExecResult:
    """The outcome of a command. A non-zero exit is data, not an error."""

    exit_code: int
    stdout_bytes: bytes
    stderr_bytes: bytes
    #: The kernel's OOM killer ended the command (its exit code is then 137):
    #: the sandbox's memory limit, not the command, decided.
    oom_killed: bool = False

    @property
    def stdout(self) -> str:
        return self.stdout_bytes.decode("utf-8", errors="replace")

    @property
    def stderr(self) -> str:
        return self.stderr_bytes.decode("utf-8", errors="replace")

    @property
    def success(self) -> bool:
        return self.exit_code == 0


@dataclass(frozen=True, slots=True)
class OutputChunk:
    """A piece of live output from a running command."""

    stream: Literal["stdout", "stderr"]
    data: bytes


class FileType(enum.StrEnum):
    FILE = "file"
    DIRECTORY = "directory"
    SYMLINK = "symlink"
    OTHER = "other"

    @classmethod
    def of_mode(cls, mode: int) -> FileType:
        """The type a POSIX ``st_mode`` says (a FIFO, socket or device: other)."""
        if stat.S_ISDIR(mode):
            return cls.DIRECTORY
        if stat.S_ISREG(mode):
            return cls.FILE
        if stat.S_ISLNK(mode):
            return cls.SYMLINK
        return cls.OTHER


@dataclass(frozen=True, slots=True)
class FileInfo:
    path: str
    type: FileType
    size: int
    mode: int
    mtime: float

    @property
    def name(self) -> str:
        return self.path.rstrip("/").rsplit("/", 1)[-1]


#: What a watch tells of a change below the directory it watches.
FileEventType = Literal["created", "written", "removed", "renamed"]


@dataclass(frozen=True, slots=True)
class FileEvent:
    """One change a watch saw: ``path`` (absolute, in the sandbox) was
    created, written, removed, or renamed to ``new_path`` (both below the
    watched directory; a move out of it is a removal, into it a creation)."""

    type: FileEventType
    path: str
    new_path: str | None = None


@dataclass(frozen=True, slots=True)
class GrepMatch:
    path: str
    line_number: int
    line: str


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What a provider can do. Callers ask before they act.

    ``processes``: runs real processes (exec, background commands).
    ``pause``: holds processes and memory in place (freezer, docker pause).
    ``suspend``: frees memory, keeps state on disk, resumes later.
    ``suspend_keeps_processes``: whether processes survive a suspend (honest:
    a container commit keeps files, not processes).
    ``snapshot`` / ``fork``: capture state and start new sandboxes from it.
    ``network_isolation``: the sandbox has no network unless asked.
    ``resource_limits``: memory, CPU and pids limits are enforced.
    ``network_policy``: ``network`` takes "none", "all" or an allow list,
    enforced by hutch (see hutch.providers.network).
    ``disk_limit``: the ``disk`` setting caps what the sandbox writes (docker:
    the working directory hutch makes; bubblewrap: its upper layer); where
    False, a sandbox can fill the host's disk.
    ``users``: ``exec(user=...)`` can switch user.
    ``preview_url``: ports inside are reachable at a URL.
    ``runs_on_host``: commands run on a real host as a user of it, not in a
    sandbox of their own (``local``: the daemon's host, as its user; ``ssh``:
    a host reached with the daemon user's keys). Through the daemon such a
    provider is the operator's to hand out (``hutch serve --allow-provider``).
    ``runtime``: what executes and moves files in this sandbox: ``native``
    (the provider's own transport: docker exec, a subprocess, ssh) or
    ``agent`` (hutch's agent inside the sandbox, on a kept connection).
    ``watch``: how ``Sandbox.watch`` learns of changes: ``inotify`` (the
    kernel tells each change as it is made: every event, renames paired) or
    ``poll`` (the directory is looked at again and again and compared: a
    change undone between two looks is missed, a rename is guessed from a
    removal and a creation alike).
    """

    processes: bool = True
    pause: bool = False
    suspend: bool = False
    suspend_keeps_processes: bool = False
    snapshot: bool = False
    fork: bool = False
    network_isolation: bool = False
    resource_limits: bool = False
    disk_limit: bool = False
    network_policy: bool = False
    users: bool = False
    preview_url: bool = False
    runs_on_host: bool = False
    runtime: str = "native"
    watch: str = "poll"
    extra: frozenset[str] = field(default_factory=frozenset)

    def supports(self, capability: str) -> bool:
        value = getattr(self, capability, None)
        if isinstance(value, bool):
            return value
        return capability in self.extra

    def as_dict(self) -> dict[str, bool | str]:
        names = [
            "processes", "pause", "suspend", "suspend_keeps_processes", "snapshot",
            "fork", "network_isolation", "network_policy", "resource_limits", "disk_limit", "users",
            "preview_url", "runs_on_host",
        ]
        out: dict[str, bool | str] = {n: bool(getattr(self, n)) for n in names}
        out.update({n: True for n in self.extra})
        out["runtime"] = self.runtime
        out["watch"] = self.watch
        return out


@dataclass(frozen=True, slots=True)
class ExitStatus:
    """The last event of a stream: the command has ended."""

    exit_code: int
    #: As ``ExecResult.oom_killed``.
    oom_killed: bool = False


# -- snapshots: the provider's handle, and hutch's record of one captured state ----------


@dataclass(frozen=True, slots=True)
class ProviderSnapshot:
    """A captured sandbox state, as the provider that holds it knows it.

    ``snapshot_id`` is hutch's id for it (the provider names its storage by
    it, so that :meth:`SandboxBackend.held_snapshots` can answer in those
    ids); ``data`` is whatever the provider needs to start a sandbox from the
    state or to remove it, JSON-serialisable (the daemon stores it verbatim);
    ``size_bytes`` what the state costs the provider on disk (or in memory);
    ``includes_memory`` whether processes and memory were captured too, or
    only the file system.
    """

    snapshot_id: str
    provider: str
    size_bytes: int
    data: Mapping[str, Any] = field(default_factory=dict)
    includes_memory: bool = False

    def as_dict(self) -> dict[str, Any]:
        return {
            "snapshot_id": self.snapshot_id, "provider": self.provider,
            "size_bytes": self.size_bytes, "data": dict(self.data),
            "includes_memory": self.includes_memory,
        }

    @classmethod
    def from_dict(cls, value: Mapping[str, Any]) -> ProviderSnapshot:
        return cls(
            snapshot_id=str(value["snapshot_id"]), provider=str(value["provider"]),
            size_bytes=int(value.get("size_bytes") or 0), data=dict(value.get("data") or {}),
            includes_memory=bool(value.get("includes_memory", False)),
        )


@dataclass(frozen=True)
class Snapshot:
    """One captured state and its place in the lineage tree."""

    id: str
    label: str | None
    sandbox_id: str | None
    parent_id: str | None
    size_bytes: int
    created_at_unix: float
    provider: str
    #: The provider's handle: what an attach and a removal need (in-process
    #: only; a snapshot the daemon holds is named by its id alone).
    handle: ProviderSnapshot | None = field(default=None, repr=False)
    #: The settings (a ``SandboxSpec`` dump) of the sandbox it came from.
    spec: Mapping[str, Any] = field(default_factory=dict, repr=False)

    def as_dict(self) -> dict[str, Any]:
        """The wire form (``GET /v1/snapshots/{id}``)."""
        return {
            "id": self.id,
            "label": self.label,
            "sandbox_id": self.sandbox_id,
            "parent_id": self.parent_id,
            "size_bytes": self.size_bytes,
            "created_at_unix": self.created_at_unix,
            "provider": self.provider,
        }


@dataclass(frozen=True)
class SnapshotDependent:
    """Something that needs a snapshot: a ``snapshot`` (a child), a
    ``workspace`` (made from it or kept in it) or a ``sandbox`` (started from
    it, with no state of its own captured since). A forced removal answers
    with the ones it broke."""

    kind: str
    id: str

    def __str__(self) -> str:
        return f"{self.kind} {self.id}"

    def as_dict(self) -> dict[str, str]:
        return {"kind": self.kind, "id": self.id}
