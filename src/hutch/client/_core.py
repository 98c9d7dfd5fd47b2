"""The SDK's I/O-free core: every operation written once, as a generator.

An operation yields :class:`Call` objects (what to send) and receives the
decoded answer; it returns the value the caller gets. A *driver* does the I/O:
the async one over ``httpx.AsyncClient``, the sync one over ``httpx.Client``.
``scripts/gen_sync.py`` writes the async and the sync classes from this one
table of operations (:mod:`hutch.client._generated_async` and
:mod:`hutch.client._generated_sync`), so the two faces have the same methods
with the same signatures, typed, and there is one place where a request is
built or an answer decoded."""

from __future__ import annotations

import base64
from collections.abc import Generator, Mapping, Sequence
from typing import IO, TYPE_CHECKING, Any, TypeVar

from .._errors import (
    CapabilityUnsupported,
    HutchError,
    InvalidArgument,
    SandboxUnavailable,
)
from .._limits import DEFAULT_SEARCH_TIMEOUT
from .._refwire import check_ref_lifetime, decode_ref
from ._answers import (
    EnsuredRef,
    EnsureProgress,
    decode_broken,
    decode_completed,
    decode_deadline,
    decode_exec,
    decode_file,
    decode_files,
    decode_fork,
    decode_matches,
    decode_paths,
    decode_ref_token,
    decode_snapshot,
    decode_snapshots,
    decode_status,
    decode_url,
    ensured_ref,
)
from ._http import Call
from ._refs import (
    ForkRef,
    ProcessRef,
    SandboxRef,
    WatcherRef,
    op,
    stream_op,
    terminal_op,
)

if TYPE_CHECKING:
    # The values operations hand back are built where an answer is decoded
    # (._answers): importing their classes is left to the first that needs one.
    from .._types import (
        Capabilities,
        ExecResult,
        ExitStatus,
        FileInfo,
        GrepMatch,
        OutputChunk,
        Snapshot,
        SnapshotDependent,
    )
    from ..states import SandboxState, SandboxStatus

#: Headroom on top of a command's own timeout before the HTTP call gives up.
HTTP_GRACE_SECONDS = 30.0

T = TypeVar("T")

#: An operation whose caller gets a T (a ``*Ref`` becomes the face's own
#: object): what ``scripts/gen_sync.py`` types the faces' methods with.
Op = Generator[Call, Any, T]
#: A streamed operation: it yields its one call, and its caller iterates Ts
#: (what the generator itself returns is never read).
Events = Generator[Call, Any, T | Any]


def _write_params(path: str, overwrite: bool) -> dict[str, str]:
    """A write's query: ``overwrite`` lets it replace a file this session has not read."""
    return {"path": path, "overwrite": "true"} if overwrite else {"path": path}


# -- requests ----------------------------------------------------------------------------


def exec_body(
    cmd: str | Sequence[str], cwd: str | None, env: Mapping[str, str] | None,
    stdin: bytes | str | None, user: str | None, timeout: float | None,
    output_limit: int | None,
) -> dict[str, Any]:
    body: dict[str, Any] = {"cmd": cmd if isinstance(cmd, str) else list(cmd)}
    for key, value in (("cwd", cwd), ("env", dict(env) if env else None), ("user", user),
                       ("timeout", timeout), ("output_limit", output_limit)):
        if value is not None:
            body[key] = value
    if isinstance(stdin, str):
        body["stdin"] = stdin
    elif stdin is not None:
        body["stdin_b64"] = base64.b64encode(bytes(stdin)).decode()
    return body


def http_timeout(timeout: float | None) -> float | None:
    return None if timeout is None else timeout + HTTP_GRACE_SECONDS


class ClientOps:
    """Operations of the client itself (sandboxes by id, workspaces)."""

    @op
    def create_sandbox(self, provider: str | None = None, **settings: Any) -> Op[SandboxRef]:
        body = dict(settings)
        if provider is not None:
            body["provider"] = provider
        return SandboxRef((yield Call("POST", "/v1/sandboxes", json=body, timeout=600)))

    @op
    def get_sandbox(self, sandbox_id: str) -> Op[SandboxRef]:
        return SandboxRef((yield Call("GET", f"/v1/sandboxes/{sandbox_id}")))

    @op
    def list_sandboxes(self, *, include_ended: bool = False) -> Op[list[dict[str, Any]]]:
        """Live sandboxes; with ``include_ended`` also those that ended within
        the daemon's retention period (state and reason say how)."""
        params = {"all": "true"} if include_ended else None
        value: list[dict[str, Any]] = (yield Call(
            "GET", "/v1/sandboxes", params=params
        ))["sandboxes"]
        return value

    @op
    def delete_sandbox(self, sandbox_id: str) -> Op[None]:
        yield Call("DELETE", f"/v1/sandboxes/{sandbox_id}", timeout=120)

    @op
    def pause(self, sandbox_id: str) -> Op[dict[str, Any]]:
        value: dict[str, Any] = (yield Call(
            "POST", "/v1/pause", json={"sandbox": sandbox_id}, timeout=120
        ))
        return value

    @op
    def resume(self, sandbox_id: str) -> Op[dict[str, Any]]:
        value: dict[str, Any] = (yield Call(
            "POST", "/v1/resume", json={"sandbox": sandbox_id}, timeout=600
        ))
        return value

    @op
    def suspend(self, sandbox_id: str) -> Op[dict[str, Any]]:
        value: dict[str, Any] = (yield Call(
            "POST", f"/v1/sandboxes/{sandbox_id}/suspend", timeout=600
        ))
        return value

    @op
    def set_timeout(self, sandbox_id: str, seconds: float) -> Op[float]:
        answer = yield Call("POST", "/v1/set_timeout",
                            json={"sandbox": sandbox_id, "timeout_seconds": seconds})
        return decode_deadline(answer)

    @op
    def snapshots(self) -> Op[list[Snapshot]]:
        """Every snapshot the daemon holds (the lineage tree, by ``parent_id``)."""
        answer = yield Call("GET", "/v1/snapshots")
        return decode_snapshots(answer)

    @op
    def get_snapshot(self, snapshot_id: str) -> Op[Snapshot]:
        return decode_snapshot((yield Call("GET", f"/v1/snapshots/{snapshot_id}")))

    @op
    def delete_snapshot(
        self, snapshot_id: str, *, force: bool = False
    ) -> Op[list[SnapshotDependent]]:
        """Remove a snapshot; refused while something needs it unless
        ``force``. Returns what a forced removal broke (empty: nothing)."""
        answer = yield Call("DELETE", f"/v1/snapshots/{snapshot_id}",
                            params={"force": "true"} if force else None, timeout=600)
        return decode_broken(answer)

    @op
    def put_definition(self, definition: Mapping[str, Any]) -> Op[dict[str, Any]]:
        """Register (or replace) a sandbox definition; its id is ``definition["id"]``."""
        if not isinstance(definition, Mapping) or not isinstance(definition.get("id"), str):
            raise InvalidArgument("a definition is a mapping with an \"id\" string")
        value: dict[str, Any] = (yield Call(
            "PUT", f"/v1/definitions/{definition['id']}", json=dict(definition)
        ))
        return value

    @op
    def definitions(self) -> Op[list[dict[str, Any]]]:
        value: list[dict[str, Any]] = (yield Call("GET", "/v1/definitions"))["definitions"]
        return value

    @op
    def ensure(
        self, definition_id: str, thread_id: str, *, tenant: str | None = None
    ) -> Op[EnsuredRef]:
        """The sandbox of ``thread_id`` for a definition: resumed, restored from
        its setup snapshot, or created (setup run); see SPEC §6."""
        answer = yield Call("POST", f"/v1/definitions/{definition_id}/ensure",
                            json={"thread_id": thread_id, "tenant": tenant}, timeout=None)
        return ensured_ref(answer)

    @stream_op
    def ensure_stream(
        self, definition_id: str, thread_id: str, *, tenant: str | None = None
    ) -> Events[EnsureProgress | EnsuredRef]:
        """As :meth:`ensure`, told as it goes: ``EnsureProgress`` events (each
        step, setup's output), then the ensured sandbox as the last event."""
        return (yield Call("POST", f"/v1/definitions/{definition_id}/ensure/stream",
                           json={"thread_id": thread_id, "tenant": tenant}, stream=True,
                           timeout=None))

    @op
    def complete(
        self, definition_id: str, thread_id: str, *, tenant: str | None = None
    ) -> Op[bool]:
        """The thread's run ended: honour destroy_on_complete and keep_alive.
        Whether its sandbox was destroyed."""
        answer = yield Call("POST", f"/v1/definitions/{definition_id}/complete",
                            json={"thread_id": thread_id, "tenant": tenant}, timeout=600)
        return decode_completed(answer)

    @op
    def create_workspace(
        self, name: str, *, image: str | None = None, snapshot_tag: str | None = None,
        **settings: Any,
    ) -> Op[dict[str, Any]]:
        """A workspace from a snapshot (``snapshot_tag``: its id) or fresh from
        sandbox settings; with ``image`` and no ``provider``, the daemon's
        configuration says which provider (see :func:`hutch.config.resolve_spec`)."""
        body = {"name": name, **settings}
        if image is not None:
            body["image"] = image
        if snapshot_tag is not None:
            body["snapshot_tag"] = snapshot_tag
        value: dict[str, Any] = (yield Call("POST", "/v1/workspaces", json=body, timeout=600))
        return value

    @op
    def get_workspace(self, name: str) -> Op[dict[str, Any]]:
        value: dict[str, Any] = (yield Call("GET", f"/v1/workspaces/{name}"))
        return value

    @op
    def list_workspaces(self) -> Op[list[dict[str, Any]]]:
        value: list[dict[str, Any]] = (yield Call("GET", "/v1/workspaces"))["workspaces"]
        return value

    @op
    def suspend_workspace(self, name: str, *, diff: bool = False) -> Op[dict[str, Any]]:
        value: dict[str, Any] = yield Call(
            "POST", f"/v1/workspaces/{name}/suspend", json={"diff": diff}, timeout=600
        )
        return value

    @op
    def resume_workspace(self, name: str) -> Op[dict[str, Any]]:
        value: dict[str, Any] = (yield Call("POST", f"/v1/workspaces/{name}/resume", timeout=600))
        return value

    @op
    def delete_workspace(self, name: str) -> Op[None]:
        yield Call("DELETE", f"/v1/workspaces/{name}", timeout=600)

    @op
    def events(self, subject: str | None = None, limit: int = 100) -> Op[list[dict[str, Any]]]:
        params: dict[str, Any] = {"limit": limit}
        if subject is not None:
            params["subject"] = subject
        value: list[dict[str, Any]] = (yield Call("GET", "/v1/events", params=params))["events"]
        return value

    @op
    def meter_history(self, sandbox_id: str) -> Op[list[dict[str, Any]]]:
        """A sandbox's memory and disk over the last hour, as the daemon
        sampled them while it ran: ``{"at_unix", "memory_bytes",
        "disk_bytes"}``, oldest first (none once it ended). The daemon's
        record, as its events are; reading it is not activity."""
        answer: dict[str, Any] = yield Call("GET", f"/v1/sandboxes/{sandbox_id}/meters")
        samples: list[dict[str, Any]] = answer["samples"]
        return samples

    @op
    def list_pools(self) -> Op[list[dict[str, Any]]]:
        """The daemon's warm pools: name, provider, settings, size, ready, hits."""
        value: list[dict[str, Any]] = (yield Call("GET", "/v1/pools"))["pools"]
        return value

    @op
    def set_pool(
        self, name: str, size: int, settings: dict[str, Any] | None = None
    ) -> Op[dict[str, Any]]:
        """Make or resize a warm pool of ``size`` sandboxes made with
        ``settings`` (a create's: ``{"provider": "docker", "image": ...}``);
        a create with the same provider settings takes one of them."""
        value: dict[str, Any] = yield Call(
            "PUT", f"/v1/pools/{name}", json={"size": size, "settings": settings or {}},
            timeout=600)
        return value

    @op
    def remove_pool(self, name: str) -> Op[None]:
        """Remove a warm pool and the sandboxes it kept ready."""
        yield Call("DELETE", f"/v1/pools/{name}", timeout=600)

    @stream_op
    def follow_events(
        self, subject: str | None = None, limit: int = 10
    ) -> Events[dict[str, Any]]:
        """The newest ``limit`` events (of ``subject``, a sandbox id or
        workspace name, or all), then each as it happens, until the caller
        stops iterating."""
        params: dict[str, Any] = {"limit": limit}
        if subject is not None:
            params["subject"] = subject
        return (yield Call("GET", "/v1/events/follow", params=params, stream=True,
                           timeout=None))


class SandboxOps:
    """Operations on one sandbox; the same names and results as hutch.Sandbox."""

    id: str

    def _path(self, suffix: str) -> str:
        if self._detached:
            raise SandboxUnavailable(
                f"this session detached from sandbox {self.id}; attach again with a ref"
            )
        return f"/v1/sandboxes/{self.id}{suffix}"

    @op
    def info(self) -> Op[dict[str, Any]]:
        """What the sandbox is and how it is now (the daemon's description)."""
        info: dict[str, Any] = yield Call("GET", self._path(""))
        self._absorb(info)
        return info

    @op
    def status(self) -> Op[SandboxStatus]:
        """State, reason, deadline, idle time and meter. Reading it is not activity."""
        info = yield Call("GET", self._path(""))
        self._absorb(info)
        return decode_status(info)

    @op
    def exec(
        self, cmd: str | Sequence[str], *, cwd: str | None = None,
        env: Mapping[str, str] | None = None, stdin: bytes | str | None = None,
        user: str | None = None, timeout: float | None = None, output_limit: int | None = None,
    ) -> Op[ExecResult]:
        body = exec_body(cmd, cwd, env, stdin, user, timeout, output_limit)
        return decode_exec((yield Call("POST", self._path("/exec"), json=body,
                                       timeout=http_timeout(timeout))))

    @stream_op
    def exec_stream(
        self, cmd: str | Sequence[str], *, cwd: str | None = None,
        env: Mapping[str, str] | None = None, stdin: bytes | str | None = None,
        user: str | None = None, timeout: float | None = None, output_limit: int | None = None,
    ) -> Events[OutputChunk | ExitStatus]:
        body = exec_body(cmd, cwd, env, stdin, user, timeout, output_limit)
        return (yield Call("POST", self._path("/exec/stream"), json=body, stream=True,
                           timeout=None))

    @terminal_op
    def pty(
        self, cmd: str | Sequence[str] | None = None, *, rows: int = 24, cols: int = 80,
        cwd: str | None = None, env: Mapping[str, str] | None = None, user: str | None = None,
    ) -> dict[str, Any]:
        """An interactive command (a shell by default) on a PTY in the sandbox,
        through the daemon's websocket route: a context manager (``async with``
        on the async face) whose terminal reads, writes, resizes and waits."""
        from ._shell import pty_start

        command = cmd if cmd is None or isinstance(cmd, str) else list(cmd)
        return pty_start(command, rows, cols, cwd, env, user)

    @op
    def start(
        self, cmd: str | Sequence[str], *, cwd: str | None = None,
        env: Mapping[str, str] | None = None, stdin: bytes | str | None = None,
        user: str | None = None, output_limit: int | None = None, keep_stdin: bool = False,
    ) -> Op[ProcessRef]:
        body = exec_body(cmd, cwd, env, stdin, user, None, output_limit)
        if not isinstance(keep_stdin, bool):
            raise InvalidArgument(f"keep_stdin must be true or false, not {keep_stdin!r}")
        if keep_stdin:
            body["keep_stdin"] = True
        return ProcessRef(self.id, (yield Call("POST", self._path("/processes"), json=body)))

    @op
    def processes(self) -> Op[list[ProcessRef]]:
        answer = yield Call("GET", self._path("/processes"))
        return [ProcessRef(self.id, p) for p in answer["processes"]]

    @op
    def process(self, process_id: str) -> Op[ProcessRef]:
        return ProcessRef(self.id, (yield Call("GET", self._path(f"/processes/{process_id}"))))

    @op
    def preview_url(self, port: int) -> Op[str]:
        if not 0 < port < 65536:
            raise InvalidArgument(f"port must be 1..65535, got {port}")
        self.require("preview_url")
        answer = yield Call("GET", self._path("/preview_url"), params={"port": port},
                            timeout=600)
        return decode_url(answer)

    @op
    def read_bytes(self, path: str, *, limit: int = 256 * 1024 * 1024) -> Op[bytes]:
        data: bytes = yield Call("GET", self._path("/files"),
                                 params={"path": path, "limit": limit}, raw=True, timeout=600)
        return data

    @stream_op
    def read_pieces(self, path: str, *, limit: int = 256 * 1024 * 1024) -> Events[bytes]:
        """The bytes of ``path`` in pieces as they arrive, never whole in memory."""
        return (yield Call("GET", self._path("/files"), params={"path": path, "limit": limit},
                           raw=True, stream=True, timeout=600))

    @op
    def read_text(
        self, path: str, *, limit: int = 256 * 1024 * 1024, encoding: str = "utf-8"
    ) -> Op[str]:
        data = yield Call("GET", self._path("/files"), params={"path": path, "limit": limit},
                          raw=True, timeout=600)
        return bytes(data).decode(encoding)

    @op
    def write_bytes(self, path: str, data: bytes, *, overwrite: bool = False) -> Op[None]:
        if not isinstance(data, bytes | bytearray | memoryview):
            raise InvalidArgument(f"data must be bytes, not {type(data).__name__}")
        yield Call("PUT", self._path("/files"), params=_write_params(path, overwrite),
                   content=bytes(data), timeout=600)

    @op
    def write_from(self, path: str, source: IO[bytes], *, overwrite: bool = False) -> Op[None]:
        """Write what the binary file ``source`` holds, from its position on, to
        ``path``: sent a piece at a time, never whole in memory."""
        yield Call("PUT", self._path("/files"), params=_write_params(path, overwrite),
                   content=source, timeout=600)

    @op
    def write_text(
        self, path: str, text: str, *, encoding: str = "utf-8", overwrite: bool = False
    ) -> Op[None]:
        yield Call("PUT", self._path("/files"), params=_write_params(path, overwrite),
                   content=text.encode(encoding), timeout=600)

    @op
    def stat(self, path: str) -> Op[FileInfo]:
        return decode_file((yield Call("GET", self._path("/stat"), params={"path": path})))

    @op
    def exists(self, path: str) -> Op[bool]:
        try:
            yield Call("GET", self._path("/stat"), params={"path": path})
        except FileNotFoundError:
            return False
        return True

    @op
    def list_dir(self, path: str = ".") -> Op[list[FileInfo]]:
        answer = yield Call("GET", self._path("/list"), params={"path": path})
        return decode_files(answer)

    @op
    def remove(self, path: str, *, recursive: bool = False) -> Op[None]:
        yield Call("DELETE", self._path("/files"),
                   params={"path": path, "recursive": str(recursive).lower()})

    @op
    def mkdir(self, path: str, *, parents: bool = False, exist_ok: bool = False) -> Op[None]:
        yield Call("POST", self._path("/mkdir"),
                   json={"path": path, "parents": parents, "exist_ok": exist_ok}, timeout=120)

    @op
    def rename(self, source: str, destination: str, *, overwrite: bool = False) -> Op[None]:
        yield Call("POST", self._path("/rename"), json={
            "source": source, "destination": destination, "overwrite": overwrite,
        }, timeout=600)

    @op
    def watch(self, path: str = ".", *, recursive: bool = False) -> Op[WatcherRef]:
        """Watch the directory ``path`` from now on (the daemon holds the
        watch): the watcher's ``events(wait=...)`` are those since the last
        look, and iterating it gives them as they come."""
        if not isinstance(recursive, bool):
            raise InvalidArgument(f"recursive must be true or false, not {recursive!r}")
        info = yield Call("POST", self._path("/watchers"),
                          json={"path": path, "recursive": recursive}, timeout=120)
        return WatcherRef(self.id, info)

    @op
    def watcher(self, watcher_id: str) -> Op[WatcherRef]:
        """A watch of this sandbox by its id (NotFound once closed), as
        :meth:`watch` made it, here or in another session."""
        info = yield Call("GET", self._path(f"/watchers/{watcher_id}"))
        return WatcherRef(self.id, info)

    @op
    def grep(
        self, pattern: str, path: str = ".", *, glob: str | None = None,
        ignore_case: bool = False, limit: int = 256 * 1024 * 1024,
        timeout: float = DEFAULT_SEARCH_TIMEOUT,
    ) -> Op[list[GrepMatch]]:
        answer = yield Call("POST", self._path("/grep"), json={
            "pattern": pattern, "path": path, "glob": glob, "ignore_case": ignore_case,
            "timeout": timeout,
        }, timeout=timeout + HTTP_GRACE_SECONDS)
        return decode_matches(answer)

    @op
    def glob(
        self, pattern: str, path: str = ".", *, timeout: float = DEFAULT_SEARCH_TIMEOUT
    ) -> Op[list[str]]:
        answer = yield Call(
            "POST", self._path("/glob"),
            json={"pattern": pattern, "path": path, "timeout": timeout},
            timeout=timeout + HTTP_GRACE_SECONDS,
        )
        return decode_paths(answer)

    @op
    def pause(self) -> Op[None]:
        self._absorb((yield Call("POST", self._path("/pause"), timeout=120)))

    @op
    def suspend(self) -> Op[None]:
        self._absorb((yield Call("POST", self._path("/suspend"), timeout=600)))

    @op
    def resume(self) -> Op[None]:
        self._absorb((yield Call("POST", self._path("/resume"), timeout=600)))

    @op
    def set_timeout(self, seconds: float) -> Op[float]:
        answer = yield Call("POST", self._path("/set_timeout"), json={"timeout_seconds": seconds})
        return decode_deadline(answer)

    @op
    def snapshot(self, label: str | None = None, *, diff: bool = True) -> Op[Snapshot]:
        self._require("snapshot")
        answer = yield Call("POST", self._path("/snapshots"),
                            json={"label": label, "diff": diff}, timeout=600)
        return decode_snapshot(answer)

    @op
    def fork(self, label: str | None = None, *, count: int = 0) -> Op[ForkRef]:
        """Snapshot + a handle whose ``attach()`` starts branches; ``count``
        branches are started at once (``fork.branches``)."""
        self._require("fork")
        answer = yield Call("POST", self._path("/fork"),
                            json={"label": label, "count": count}, timeout=600)
        return ForkRef(*decode_fork(answer))

    def _require(self, capability: str) -> None:
        if not self.capabilities.supports(capability):
            raise CapabilityUnsupported.for_provider(self.provider, capability)

    @op
    def ref(self, *, expires_in: float | None = None) -> Op[str]:
        """A ref to this sandbox for ``hutch.attach``: it carries the daemon's
        address and is a credential for this sandbox alone. Only the owner
        (a client with the daemon's token) hands them out."""
        if expires_in is not None:
            check_ref_lifetime(expires_in)  # as in-process; JSON could not carry some
        answer = yield Call("POST", self._path("/refs"), json={"expires_in": expires_in})
        return decode_ref_token(answer)

    @op
    def revoke_ref(self, ref: str) -> Op[None]:
        """End a ref this sandbox handed out (the ref itself, or its id). Idempotent."""
        decoded = decode_ref(ref)
        ref_id = decoded.ref_id if decoded is not None else ref
        yield Call("DELETE", self._path(f"/refs/{ref_id}"))

    @op
    def close(self) -> Op[None]:
        if self._detached:
            return
        if self._attached:
            # Through a ref, closing leaves the sandbox to its owner.
            yield Call("DELETE", self._path(""), timeout=120)
            self._detached = True
            return
        try:
            yield Call("DELETE", self._path(""), timeout=120)
        except HutchError as exc:
            # Closing what is already gone is not an error.
            if exc.code not in ("not_found", "sandbox_unavailable", "idle_timeout",
                                "max_lifetime_exceeded", "timeout_expired"):
                raise
        self._closed = True

    def _absorb(self, info: dict[str, Any]) -> None:
        self._info = info

    # -- checks made here, as the in-process sandbox makes them ----------------------------
    def path(self, path: str) -> str:
        """The absolute path inside the sandbox that ``path`` names."""
        from .._sandbox_paths import sandbox_path  # its checks load only with a path op

        return sandbox_path(self.workdir, path)

    def require(self, capability: str) -> None:
        if not self.capabilities.supports(capability):
            raise CapabilityUnsupported.for_provider(self.provider, capability)

    # -- what the daemon answered last (info() and status() ask afresh) -----------------
    _info: dict[str, Any]
    _closed: bool = False
    #: Opened with a ref: a non-owning session, whose close only detaches it.
    _attached: bool = False
    _detached: bool = False

    @property
    def provider(self) -> str:
        return str(self._info["provider"])

    @property
    def workdir(self) -> str:
        return str(self._info["workdir"])

    @property
    def capabilities(self) -> Capabilities:
        from .._types import Capabilities

        caps = self._info.get("capabilities", {})
        known: dict[str, Any] = {
            k: bool(v) for k, v in caps.items()
            if k in Capabilities.__dataclass_fields__ and k not in ("extra", "runtime", "watch")
        }
        extra = frozenset(k for k, v in caps.items() if k not in known and v is True)
        return Capabilities(**known, runtime=str(caps.get("runtime", "native")),
                            watch=str(caps.get("watch", "poll")), extra=extra)

    @property
    def state(self) -> SandboxState:
        """The state at the last answer; ``status()`` asks afresh."""
        from ..states import SandboxState

        return SandboxState(self._info["state"])

    @property
    def meter(self) -> dict[str, float]:
        """Seconds spent running, paused and suspended, at the last answer."""
        return {str(k): float(v) for k, v in dict(self._info.get("meter") or {}).items()}

    @property
    def open_operations(self) -> int:
        """Execs, streams and background commands open, at the last answer."""
        return int(self._info.get("open_operations") or 0)

    @property
    def closed(self) -> bool:
        """Closed (or detached) through this handle, or ended, as far as the last
        answer knows."""
        from ..states import FINAL

        return self._closed or self._detached or self.state in FINAL
