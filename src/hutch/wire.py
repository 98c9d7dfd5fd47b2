"""The bodies of hutch's HTTP API (docs/wire.md), as pydantic models.

A leaf: it imports nothing of hutch but the other leaves. The routes declare
these as their response models, so the OpenAPI document describes every
answer; the server builds its answers to them (``model_construct``, no
validation of values it made itself), and a test holds each builder to its
model.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field


class ErrorDetail(BaseModel):
    """``code`` and ``message``, and the details of errors that carry some
    (``setup_failed``: the step, its exit code and the end of its output)."""

    code: str
    message: str
    step: str | None = Field(default=None, description="setup_failed: the failing step")
    exit_code: int | None = Field(default=None, description="setup_failed: its exit code")
    output_tail: str | None = Field(
        default=None, description="setup_failed: the end of its output"
    )


class ErrorBody(BaseModel):
    """Every error's body: ``{"error": {"code", "message", ...details}}``."""

    error: ErrorDetail


# -- sandboxes --------------------------------------------------------------------------------


class Attachment(BaseModel):
    """A session working in a sandbox through a ref."""

    session: str
    ref_id: str
    attached_at_unix: float
    last_used_unix: float | None
    expires_at_unix: float | None


class RefInfo(BaseModel):
    """A ref of a sandbox that still works (its secret is never listed)."""

    ref_id: str
    created_at_unix: float
    expires_at_unix: float | None
    last_used_unix: float | None
    workspace: str | None


class SandboxInfo(BaseModel):
    """What a sandbox is and how it is; an ended one's while on record."""

    id: str
    provider: str
    state: str = Field(description="running, paused, suspended, terminated or failed")
    reason: str | None
    workdir: str | None
    capabilities: dict[str, bool | str]
    created_at_unix: float | None
    last_active_unix: float | None
    idle_seconds: float | None
    deadline_unix: float | None
    meter: dict[str, float]
    memory_bytes: int | None
    disk_bytes: int | None = Field(
        default=None, description="disk its own files take (what it wrote over its image), "
        "where its provider can tell")
    open_operations: int
    attachments: list[Attachment]
    refs: list[RefInfo]
    workspace: str | None = None
    ended_at_unix: float | None = None
    origin_snapshot_id: str | None = Field(
        default=None, description="the snapshot it was started from (a fork's, an attach's)")


class SandboxList(BaseModel):
    sandboxes: list[SandboxInfo]


class MeterSample(BaseModel):
    """A running sandbox's figures at one moment (None: its provider cannot tell)."""

    at_unix: float
    memory_bytes: int | None
    disk_bytes: int | None


class MeterHistory(BaseModel):
    """A sandbox's memory and disk over time, as the daemon sampled them:
    a running sandbox every ``interval_seconds``, the last hour kept, oldest
    first (none while it was paused or suspended; none once it ended)."""

    id: str
    interval_seconds: float
    samples: list[MeterSample]


class Deadline(BaseModel):
    deadline_unix: float | None


class RefHandedOut(BaseModel):
    """A new ref: ``ref`` is the credential, shown this once."""

    ref: str
    ref_id: str
    sandbox_id: str
    expires_at_unix: float | None


# -- exec and processes -----------------------------------------------------------------------


class ExecAnswer(BaseModel):
    """An exec's (or a wait's) outcome: each stream as text, or as base64
    (``*_b64``) when it is not UTF-8."""

    exit_code: int
    stdout: str | None = None
    stdout_b64: str | None = None
    stderr: str | None = None
    stderr_b64: str | None = None
    oom_killed: bool | None = Field(default=None, description="present (true) only when so")


class StreamLine(BaseModel):
    """One NDJSON line of a process's stream: output, then its exit (or an error)."""

    stream: str | None = Field(default=None, description="stdout or stderr")
    data: str | None = None
    data_b64: str | None = None
    exit_code: int | None = None
    oom_killed: bool | None = None
    error: ErrorDetail | None = None


class ProcessInfo(BaseModel):
    id: str
    running: bool
    exit_code: int | None
    command: str
    stdin_open: bool = Field(
        default=False, description="its stdin was kept open at its start, and still is")


class ProcessList(BaseModel):
    processes: list[ProcessInfo]


# -- files ------------------------------------------------------------------------------------


class FileStat(BaseModel):
    path: str
    type: str = Field(description="file, directory, symlink or other")
    size: int
    mode: int
    mtime: float


class FileList(BaseModel):
    entries: list[FileStat]


class WatcherInfo(BaseModel):
    """A directory watched: its id (for its events and its close), how it
    learns of changes (``inotify`` or ``poll``), and whether it still watches."""

    id: str
    path: str
    recursive: bool
    kind: str = Field(description="inotify or poll")
    active: bool


class FileEventLine(BaseModel):
    """One change: ``path`` created, written, removed, or renamed to ``new_path``."""

    type: str = Field(description="created, written, removed or renamed")
    path: str
    new_path: str | None = None


class WatchEvents(BaseModel):
    """The events since the last look, and whether the watch still watches."""

    events: list[FileEventLine]
    active: bool


class WatchLine(BaseModel):
    """One NDJSON line of a watch's stream: first the watch (``watching``),
    then its events, one a line, and an error as its last line if it fails."""

    watching: WatcherInfo | None = None
    type: str | None = None
    path: str | None = None
    new_path: str | None = None
    error: ErrorDetail | None = None


class GrepLine(BaseModel):
    path: str
    line_number: int
    line: str


class GrepAnswer(BaseModel):
    matches: list[GrepLine]


class GlobAnswer(BaseModel):
    paths: list[str]


class PreviewUrl(BaseModel):
    url: str


# -- snapshots, forks, workspaces -------------------------------------------------------------


class SnapshotInfo(BaseModel):
    id: str
    label: str | None
    sandbox_id: str | None
    parent_id: str | None
    size_bytes: int
    created_at_unix: float
    provider: str


class SnapshotList(BaseModel):
    snapshots: list[SnapshotInfo]


class ForkAnswer(BaseModel):
    snapshot: SnapshotInfo
    sandboxes: list[SandboxInfo]


class Dependent(BaseModel):
    """Something that needed a snapshot: a snapshot, a workspace or a sandbox."""

    kind: str
    id: str


class ForcedRemoval(BaseModel):
    """A snapshot removed by force from under what needed it."""

    id: str
    broken: list[Dependent]


class WorkspaceInfo(BaseModel):
    name: str
    status: str
    provider: str
    live_sandbox_id: str | None
    state_snapshot_id: str | None
    source_snapshot_id: str | None
    created_at_unix: float
    last_active_unix: float


class WorkspaceList(BaseModel):
    workspaces: list[WorkspaceInfo]


# -- definitions ------------------------------------------------------------------------------


class DefinitionList(BaseModel):
    definitions: list[dict[str, Any]] = Field(
        description="each as PUT /v1/definitions/{id} answers"
    )


class EnsureStep(BaseModel):
    name: str
    seconds: float


class EnsureAnswer(BaseModel):
    sandbox: SandboxInfo
    path: str = Field(description="resumed, restored or created")
    steps: list[EnsureStep]
    snapshot_id: str | None


class EnsureLine(BaseModel):
    """One NDJSON line of a streamed ensure: a step, setup output, the result or an error."""

    step: str | None = None
    output: str | None = None
    result: EnsureAnswer | None = None
    error: ErrorDetail | None = None


class Completed(BaseModel):
    destroyed: bool


# -- the daemon -------------------------------------------------------------------------------


class Event(BaseModel):
    seq: int
    at_unix: float
    subject: str
    kind: str
    message: str


class EventList(BaseModel):
    events: list[Event]


class Health(BaseModel):
    status: str


class Pool(BaseModel):
    name: str
    provider: str
    settings: dict[str, Any] = Field(description="the create request's settings it makes")
    size: int = Field(description="how many it keeps ready")
    ready: int = Field(description="how many are ready now")
    hits: int = Field(description="creates that took one of its sandboxes")


class PoolList(BaseModel):
    pools: list[Pool]


class PoolBody(BaseModel):
    model_config = {"extra": "forbid"}

    settings: dict[str, Any] = Field(
        default_factory=dict,
        description="a create request's provider and settings (POST /v1/sandboxes' body)")
    size: int = Field(ge=0, le=1000)
