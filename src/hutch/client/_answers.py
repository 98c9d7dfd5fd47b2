"""The daemon's answers, decoded through the :mod:`hutch.wire` models its
routes answer with (one definition of each body, for the server and the
client), into the values the client's callers get.

:mod:`hutch.wire` (pydantic) is imported by the first answer decoded, not by
``import hutch.client``: a command that decodes no model (``hutch ls``
prints the sandboxes' JSON as it came) never loads it. So are the values
built of them (:mod:`hutch._types`' and :mod:`hutch.states`' data classes,
a few milliseconds of class building that such a command would pay for
nothing): each decoder imports what it builds.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

from .._errors import HutchError, error_from_wire

if TYPE_CHECKING:
    from pydantic import BaseModel

    from .. import wire
    from .._types import (
        ExecResult,
        ExitStatus,
        FileInfo,
        GrepMatch,
        OutputChunk,
        Snapshot,
        SnapshotDependent,
    )
    from ..states import SandboxStatus

Model = TypeVar("Model", bound="BaseModel")


def valid(model: type[Model], data: Any) -> Model:
    """``data`` as ``model`` (a :mod:`hutch.wire` class); an answer that is
    not one is the daemon's fault, said as such."""
    try:
        return model.model_validate(data)
    except ValueError as exc:  # pydantic's ValidationError
        raise HutchError(
            f"daemon answered a body that does not fit {model.__name__}: {exc}"
        ) from None


def _wire() -> Any:
    from .. import wire

    return wire


def _bytes_of(text: str | None, b64: str | None) -> bytes:
    """A stream as the wire carries it: text, or base64 where it is not UTF-8."""
    if b64 is not None:
        return base64.b64decode(b64)
    return (text or "").encode()


def decode_exec(data: Mapping[str, Any]) -> ExecResult:
    from .._types import ExecResult

    answer: wire.ExecAnswer = valid(_wire().ExecAnswer, data)
    return ExecResult(answer.exit_code, _bytes_of(answer.stdout, answer.stdout_b64),
                      _bytes_of(answer.stderr, answer.stderr_b64),
                      oom_killed=bool(answer.oom_killed))


@dataclass(frozen=True)
class EnsureProgress:
    """A streamed ensure's progress: ``kind`` is ``step`` (a step starts: its
    name) or ``output`` (what setup printed)."""

    kind: str
    text: str


class EnsuredRef(NamedTuple):
    """A definition's ``ensure`` answer: the sandbox, the path, the steps
    (for the driver to wrap, as :mod:`._refs`' are)."""

    sandbox: dict[str, Any]
    path: str
    steps: list[dict[str, Any]]


def ensured_ref(data: Mapping[str, Any]) -> EnsuredRef:
    answer: wire.EnsureAnswer = valid(_wire().EnsureAnswer, data)
    # The sandbox's info as it came: the handle made of it keeps what it says.
    return EnsuredRef(dict(data["sandbox"]), answer.path,
                      [step.model_dump() for step in answer.steps])


def decode_event(
    data: Mapping[str, Any],
) -> OutputChunk | ExitStatus | EnsureProgress | EnsuredRef | dict[str, Any]:
    """One NDJSON line: a process's output or exit, an ensure's progress
    or result (either may be an error), or an entry of the event log."""
    if "error" in data:
        raise error_from_wire(data["error"])
    if "seq" in data and "subject" in data:  # the event log, as /v1/events lists it
        return dict(valid(_wire().Event, data).model_dump())
    if "result" in data:
        return ensured_ref(data["result"])
    for kind in ("step", "output"):
        if kind in data:
            return EnsureProgress(kind, str(data[kind]))
    from .._types import ExitStatus, OutputChunk

    line: wire.StreamLine = valid(_wire().StreamLine, data)
    if line.exit_code is not None:
        return ExitStatus(line.exit_code, oom_killed=bool(line.oom_killed))
    chunk = _bytes_of(line.data, line.data_b64)
    return OutputChunk("stderr", chunk) if line.stream == "stderr" else OutputChunk("stdout", chunk)


def _file(stat: wire.FileStat) -> FileInfo:
    from .._types import FileInfo, FileType

    return FileInfo(stat.path, FileType(stat.type), stat.size, stat.mode, stat.mtime)


def decode_file(data: Mapping[str, Any]) -> FileInfo:
    return _file(valid(_wire().FileStat, data))


def decode_files(data: Mapping[str, Any]) -> list[FileInfo]:
    answer: wire.FileList = valid(_wire().FileList, data)
    return [_file(entry) for entry in answer.entries]


def decode_status(data: Mapping[str, Any]) -> SandboxStatus:
    from ..states import SandboxState, SandboxStatus

    info: wire.SandboxInfo = valid(_wire().SandboxInfo, data)
    if info.created_at_unix is None or info.last_active_unix is None:
        raise HutchError(f"daemon answered no status for sandbox {info.id}")
    return SandboxStatus(
        id=info.id, state=SandboxState(info.state), reason=info.reason,
        created_at_unix=info.created_at_unix, last_active_unix=info.last_active_unix,
        idle_seconds=info.idle_seconds, deadline_unix=info.deadline_unix, meter=info.meter,
    )


def decode_deadline(data: Mapping[str, Any]) -> float:
    answer: wire.Deadline = valid(_wire().Deadline, data)
    if answer.deadline_unix is None:
        raise HutchError("daemon answered a set_timeout with no deadline")
    return answer.deadline_unix


def _snapshot(info: wire.SnapshotInfo) -> Snapshot:
    from .._types import Snapshot

    return Snapshot(id=info.id, label=info.label, sandbox_id=info.sandbox_id,
                    parent_id=info.parent_id, size_bytes=info.size_bytes,
                    created_at_unix=info.created_at_unix, provider=info.provider)


def decode_snapshot(data: Mapping[str, Any]) -> Snapshot:
    return _snapshot(valid(_wire().SnapshotInfo, data))


def decode_snapshots(data: Mapping[str, Any]) -> list[Snapshot]:
    answer: wire.SnapshotList = valid(_wire().SnapshotList, data)
    return [_snapshot(info) for info in answer.snapshots]


def decode_fork(data: Mapping[str, Any]) -> tuple[Snapshot, list[dict[str, Any]]]:
    """The fork's snapshot, and its branches' infos as they came."""
    answer: wire.ForkAnswer = valid(_wire().ForkAnswer, data)
    return _snapshot(answer.snapshot), list(data["sandboxes"])


def decode_matches(data: Mapping[str, Any]) -> list[GrepMatch]:
    from .._types import GrepMatch

    answer: wire.GrepAnswer = valid(_wire().GrepAnswer, data)
    return [GrepMatch(m.path, m.line_number, m.line) for m in answer.matches]


def decode_paths(data: Mapping[str, Any]) -> list[str]:
    answer: wire.GlobAnswer = valid(_wire().GlobAnswer, data)
    return answer.paths


def decode_url(data: Mapping[str, Any]) -> str:
    answer: wire.PreviewUrl = valid(_wire().PreviewUrl, data)
    return answer.url


def decode_ref_token(data: Mapping[str, Any]) -> str:
    answer: wire.RefHandedOut = valid(_wire().RefHandedOut, data)
    return answer.ref


def decode_completed(data: Mapping[str, Any]) -> bool:
    answer: wire.Completed = valid(_wire().Completed, data)
    return answer.destroyed


def decode_broken(data: Mapping[str, Any] | None) -> list[SnapshotDependent]:
    """What a forced snapshot removal broke (no body: nothing)."""
    from .._types import SnapshotDependent

    if not data:
        return []
    answer: wire.ForcedRemoval = valid(_wire().ForcedRemoval, data)
    return [SnapshotDependent(kind=d.kind, id=d.id) for d in answer.broken]
