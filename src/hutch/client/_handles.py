"""Operations on what a sandbox hands out, written once as I/O-free
generators like :mod:`._core`'s: a fork's (its branches, its snapshot), a
background command's (its output, stdin, exit) and a watch's (its events).
``scripts/gen_sync.py`` writes their async and sync faces into
:mod:`hutch.client._generated_handles`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .._errors import (
    HutchError,
    InvalidArgument,
    StdinClosed,
)
from ._answers import (
    decode_exec,
)
from ._core import HTTP_GRACE_SECONDS, Events, Op, SandboxOps, http_timeout
from ._http import Call
from ._refs import (
    BranchRef,
    op,
    stream_op,
)

if TYPE_CHECKING:
    from .._types import ExecResult, ExitStatus, FileEvent, OutputChunk, Snapshot


class ForkOps:
    """A fork through the daemon; the same as hutch.Fork."""

    snapshot: Snapshot
    branches: list[Any]

    @op
    def attach(self, **options: Any) -> Op[BranchRef]:
        body = {"from_snapshot": self.snapshot.id, **options}
        info = yield Call("POST", "/v1/sandboxes", json=body, timeout=600)
        return BranchRef(self, info)

    @op
    def close(self) -> Op[None]:
        """End every branch this handle started, then remove its snapshot
        (refused while something else needs it, as ``delete_snapshot`` is).
        Idempotent."""
        while self.branches:
            yield from SandboxOps.close(self.branches.pop())
        try:
            yield Call("DELETE", f"/v1/snapshots/{self.snapshot.id}", timeout=600)
        except HutchError as exc:
            if exc.code != "not_found":
                raise


class ProcessOps:
    """Operations on a background command; the same as hutch.Process."""

    id: str
    sandbox_id: str
    command: str
    _running: bool
    _exit_code: int | None
    _stdin_open: bool

    def _path(self, suffix: str = "") -> str:
        return f"/v1/sandboxes/{self.sandbox_id}/processes/{self.id}{suffix}"

    @property
    def running(self) -> bool:
        return self._running

    @property
    def exit_code(self) -> int | None:
        return self._exit_code

    @op
    def wait(self, timeout: float | None = None) -> Op[ExecResult]:
        answer = yield Call("POST", self._path("/wait"), json={"timeout": timeout},
                            timeout=http_timeout(timeout))
        result = decode_exec(answer)
        self._running, self._exit_code = False, result.exit_code
        return result

    @stream_op
    def stream(self) -> Events[OutputChunk | ExitStatus]:
        return (yield Call("GET", self._path("/stream"), stream=True, timeout=None))

    @op
    def kill(self) -> Op[None]:
        yield Call("POST", self._path("/kill"), timeout=60)
        self._running = False

    @property
    def stdin_open(self) -> bool:
        """Whether its stdin was kept open and is (as last seen; the daemon
        has the last word: a write to a closed one raises ``StdinClosed``)."""
        return self._stdin_open and self._running

    @op
    def write_stdin(self, data: bytes | str) -> Op[None]:
        """Write ``data`` (text as UTF-8) to the command's stdin; returns once
        its pipe took them. ``StdinClosed`` unless it was started with
        ``keep_stdin`` and its stdin is still open."""
        if isinstance(data, str):
            data = data.encode()
        elif not isinstance(data, bytes | bytearray | memoryview):
            raise InvalidArgument(f"stdin must be bytes or text, not {type(data).__name__}")
        try:
            yield Call("POST", self._path("/stdin"), content=bytes(data), timeout=None)
        except StdinClosed:
            self._stdin_open = False
            raise

    @op
    def close_stdin(self) -> Op[None]:
        """Close the command's stdin: it reads its end of file."""
        yield Call("DELETE", self._path("/stdin"), timeout=60)
        self._stdin_open = False


#: The longest one look at a watcher's events waits on the daemon (its bound).
WATCH_LOOK_SECONDS = 30.0


class WatcherOps:
    """Operations on a watch the daemon holds; the same as hutch.Watcher."""

    id: str
    sandbox_id: str
    path: str
    recursive: bool
    kind: str
    _active: bool

    def _path(self, suffix: str = "") -> str:
        return f"/v1/sandboxes/{self.sandbox_id}/watchers/{self.id}{suffix}"

    @property
    def active(self) -> bool:
        """Still watching, as of the last answer."""
        return self._active

    @op
    def events(self, wait: float | None = 0.0) -> Op[list[FileEvent]]:
        """The events since the last call, waiting up to ``wait`` seconds
        (None: as long as it takes) for the first when there are none yet."""
        if wait is not None and (isinstance(wait, bool) or not wait >= 0):
            raise InvalidArgument(f"wait must be a number of seconds >= 0, got {wait!r}")
        from .._types import FileEvent

        left = wait
        while True:
            look = WATCH_LOOK_SECONDS if left is None else min(left, WATCH_LOOK_SECONDS)
            try:
                answer = yield Call("GET", self._path("/events"), params={"wait": look},
                                    timeout=look + HTTP_GRACE_SECONDS)
            except HutchError as exc:
                self._active = False
                if exc.code == "not_found":
                    return []  # closed
                raise
            self._active = bool(answer["active"])
            events = [FileEvent(e["type"], str(e["path"]), e.get("new_path"))
                      for e in answer["events"]]
            if left is not None:
                left -= look
            if events or not self._active or (left is not None and left <= 0):
                return events

    @op
    def close(self) -> Op[None]:
        """Stop watching. Idempotent."""
        self._active = False
        try:
            yield Call("DELETE", self._path(), timeout=60)
        except HutchError as exc:
            if exc.code != "not_found":
                raise


def note_exit(owner: object, event: object) -> None:
    """A stream's exit status, told to the background command's handle the
    stream came from (so that its ``running`` and ``exit_code`` agree)."""
    from .._types import ExitStatus

    if isinstance(owner, ProcessOps) and isinstance(event, ExitStatus):
        owner._running, owner._exit_code = False, event.exit_code
