"""Each builder of a wire body answers what its hutch.wire model says: the same
keys, in the model's order, each of the model's type (the routes declare the
models; the builders make the bytes, so the two are held together here)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import BaseModel

from hutch import wire
from hutch._errors import SetupFailed
from hutch._refwire import attachment_json
from hutch._types import (
    Capabilities,
    ExecResult,
    ExitStatus,
    FileInfo,
    FileType,
    OutputChunk,
    Snapshot,
    SnapshotDependent,
)
from hutch.definitions.ensure import Step
from hutch.server.asgi import render_json
from hutch.server.errors import error_json
from hutch.server.streaming import event_line, exec_json, exec_json_pieces, file_json


def conforms(model: type[BaseModel], body: Any) -> None:
    """``body`` is one ``model`` describes, no key more, in its order."""
    parsed = model.model_validate(body)
    assert list(body) == [k for k in model.model_fields if k in body]
    assert parsed.model_dump(include=set(body)) == body


@pytest.mark.parametrize("result", [
    ExecResult(0, b"out\n", b""),
    ExecResult(1, b"\xff\xfe", b"err", oom_killed=True),
])
def test_exec_answers(result: ExecResult) -> None:
    conforms(wire.ExecAnswer, exec_json(result))


def test_stream_lines() -> None:
    for event in (OutputChunk("stdout", b"hi"), OutputChunk("stderr", b"\xff"),
                  ExitStatus(3), ExitStatus(137, oom_killed=True)):
        conforms(wire.StreamLine, json.loads(event_line(event)))


def test_files_snapshots_attachments_steps() -> None:
    conforms(wire.FileStat, file_json(FileInfo("a/b", FileType.FILE, 3, 0o644, 1.5)))
    snapshot = Snapshot("snap-1", None, "sb-1", None, 10, 2.0, "local")
    conforms(wire.SnapshotInfo, snapshot.as_dict())
    conforms(wire.Dependent, SnapshotDependent("workspace", "w").as_dict())

    class Ref:
        id = "ref-1"
        expires_at_unix = None

    conforms(wire.Attachment, attachment_json("s", Ref(), 1.0, None))
    conforms(wire.EnsureStep, Step("setup", 0.123456).as_dict())
    conforms(wire.SandboxInfo, {**_sandbox_info(), "capabilities": Capabilities().as_dict()})


def test_errors() -> None:
    conforms(wire.ErrorBody, error_json(SetupFailed("no", step="make", exit_code=2,
                                                    output_tail="x")))


def _sandbox_info() -> dict[str, Any]:
    return {"id": "sb", "provider": "local", "state": "running", "reason": None,
            "workdir": "/w", "capabilities": {}, "created_at_unix": 1.0,
            "last_active_unix": 1.0, "idle_seconds": 0.0, "deadline_unix": None,
            "meter": {}, "memory_bytes": None, "open_operations": 0, "attachments": [],
            "refs": [], "workspace": None, "ended_at_unix": None}


def test_a_large_exec_answer_in_pieces_is_the_whole() -> None:
    result = ExecResult(0, b"x" * 10, b"\xff")

    class Output:
        exit_code, oom_killed = 0, False

        def is_utf8(self, stream: str) -> bool:
            return stream == "stdout"

        def pieces(self, stream: str) -> list[bytes]:
            return [result.stdout_bytes if stream == "stdout" else result.stderr_bytes]

    whole = b"".join(exec_json_pieces(Output()))  # type: ignore[arg-type]
    assert whole == render_json(exec_json(result))
    conforms(wire.ExecAnswer, json.loads(whole))


def test_the_client_decodes_answers_through_the_wire_models() -> None:
    from hutch._errors import HutchError
    from hutch.client._answers import decode_exec, decode_file, decode_snapshots

    assert decode_exec({"exit_code": 3, "stdout": "é", "stderr_b64": "/w=="}) == ExecResult(
        3, "é".encode(), b"\xff")
    snapshot = Snapshot("snap-1", "l", "sb-1", None, 10, 2.0, "local")
    assert decode_snapshots({"snapshots": [snapshot.as_dict()]}) == [snapshot]
    # A body that is not its model's is the daemon's fault, said with a typed error.
    for bad in ({"exit_code": "three"}, {"stdout": "no exit code"}):
        with pytest.raises(HutchError, match="does not fit ExecAnswer"):
            decode_exec(bad)
    with pytest.raises(HutchError, match="does not fit FileStat"):
        decode_file({"path": "a"})
