"""``docker``: one container per sandbox, kept alive by ``sleep infinity``,
its working directory bind-mounted from the host at the mount point.

Transport: the Engine's exec API over a hijacked socket (stdin written then
half-closed, output demultiplexed here) and its archive API for files. The
docker SDK is imported lazily, so importing this module (for its config
model) costs nothing when docker is not used.

Suspend commits the container's changes to an image and removes the
container: memory is freed, files survive (the working directory never left
the host), processes do not, and the capabilities say so.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import json
import logging
import os
import re
import shutil
import socket
import struct
import tarfile
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import anyio.to_thread
from pydantic import BaseModel, ConfigDict, Field

from .._errors import (
    HutchError,
    InvalidArgument,
    NotFound,
    OutputLimitExceeded,
    ProviderError,
    SandboxFileNotFound,
    SandboxIsADirectory,
    SandboxPermissionDenied,
    SandboxUnavailable,
)
from .._globmatch import compile_glob
from .._types import Capabilities, FileInfo, FileType, GrepMatch, OutputChunk
from ._hostproc import EXEC_MARKER, SANDBOX_MARKER
from .base import BackendProcess, SandboxBackend

log = logging.getLogger("hutch.docker")

#: Capabilities agents have no use for, dropped on top of Docker's defaults.
#: Package managers (apt, pip) and useradd still work as root without them.
DEFAULT_CAP_DROP = ["NET_RAW", "MKNOD", "AUDIT_WRITE", "SYS_CHROOT", "SETFCAP"]

MANAGED_LABEL = "hutch.managed"
SANDBOX_LABEL = "hutch.sandbox_id"
SUSPENDED_REPOSITORY = "hutch-suspended"
#: Go's os.ModeDir and os.ModeSymlink bits, as the archive stat header uses them.
_GO_MODE_DIR = 1 << 31
_GO_MODE_SYMLINK = 1 << 27


class DockerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["docker"] = "docker"
    image: str = "hutch-test:bookworm"
    #: Where the sandbox's working directory is mounted inside the container.
    mount_point: str = "/workspace"
    #: Host directory bound at the mount point; a fresh one under hutch's data
    #: directory when unset (and then removed with the sandbox).
    host_workdir: str | None = None
    network_mode: str = "bridge"
    #: Extra bind mounts, ``host:container[:ro]``.
    mounts: list[str] = []
    #: Memory limit, as Docker takes it (``512m``, ``2g``).
    memory: str | None = None
    #: CPU quota in CPUs (``1.5``).
    cpus: float | None = Field(default=None, gt=0)
    pids_limit: int = Field(default=1024, gt=0)
    pull_if_missing: bool = True
    env: dict[str, str] = {}
    labels: dict[str, str] = {}
    #: Keep the container after the sandbox closes (and log how to reach it).
    preserve: bool = False
    cap_drop: list[str] = Field(default_factory=lambda: list(DEFAULT_CAP_DROP))


# -- the engine connection ------------------------------------------------------

_api_lock = threading.Lock()
_api_client: Any = None


def engine() -> Any:
    """One low-level docker API client per process (it pools connections)."""
    global _api_client
    with _api_lock:
        if _api_client is None:
            import docker

            try:
                _api_client = docker.APIClient(version="auto", timeout=600)
            except docker.errors.DockerException as exc:
                raise SandboxUnavailable(
                    f"cannot reach the Docker Engine: {exc} (scripts/ensure-docker.sh starts one)"
                ) from None
        return _api_client


def _status(exc: BaseException) -> int | None:
    response = getattr(exc, "response", None)
    return getattr(response, "status_code", None)


def _explanation(exc: BaseException) -> str:
    return str(getattr(exc, "explanation", None) or exc)


def _map_engine_error(exc: BaseException, path: str | None = None) -> HutchError:
    text = _explanation(exc)
    lowered = text.lower()
    if path is not None:
        if _status(exc) == 404 or "no such file" in lowered or "not a directory" in lowered:
            return SandboxFileNotFound(f"no such file or directory: {path}")
        if "permission denied" in lowered or "operation not permitted" in lowered:
            return SandboxPermissionDenied(f"permission denied: {path}")
        if "read-only" in lowered:
            return SandboxPermissionDenied(f"read-only file system: {path}")
    return ProviderError(f"docker: {text}")


async def _call(fn: Any, *args: Any, path: str | None = None, **kwargs: Any) -> Any:
    """Run a blocking SDK call in a thread, mapping engine errors to ours."""
    import docker.errors

    def run() -> Any:
        try:
            return fn(*args, **kwargs)
        except docker.errors.APIError as exc:
            raise _map_engine_error(exc, path) from None
        except (docker.errors.DockerException, OSError) as exc:
            if isinstance(exc, HutchError):
                raise
            raise ProviderError(f"docker: {exc}") from None

    return await anyio.to_thread.run_sync(run)


def list_managed_containers(*, with_labels: bool = False) -> list[tuple[str, str, Any]]:
    """(sandbox_id, container_id, status) of every container hutch made;
    with ``with_labels`` the third item is the container's labels instead."""
    containers = engine().containers(all=True, filters={"label": f"{MANAGED_LABEL}=1"})
    return [
        (c["Labels"].get(SANDBOX_LABEL, ""), c["Id"], c["Labels"] if with_labels else c["State"])
        for c in containers
    ]


def hutch_home() -> str:
    return os.environ.get("HUTCH_HOME") or os.path.expanduser("~/.local/share/hutch")


# -- processes ------------------------------------------------------------------

# Kills every process whose environment carries the exec's marker: SIGTERM,
# up to $2 seconds of grace, then SIGKILL. Children that ignore SIGTERM or
# left the process group still carry the marker, so none escapes.
_KILL_SCRIPT = r"""
m="$1"; grace="$2"
marked() {
  for d in /proc/[0-9]*; do
    p=${d#/proc/}
    [ "$p" = "$$" ] && continue
    tr '\0' '\n' < "$d/environ" 2>/dev/null | grep -qxF "$m" && echo "$p"
  done
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

_OCI_FAILURE = b"OCI runtime exec failed"


def _oci_error(message: str, argv: Sequence[str], cwd: str) -> HutchError:
    if "chdir to cwd" in message:
        return SandboxFileNotFound(f"working directory {cwd} does not exist")
    if "permission denied" in message:
        return SandboxPermissionDenied(f"cannot execute {argv[0]}: permission denied")
    if "not found" in message or "no such file" in message:
        return SandboxFileNotFound(f"command not found: {argv[0]}")
    return ProviderError(f"docker exec failed: {message.strip()}")


class DockerProcess(BackendProcess):
    """One exec: a reader thread demultiplexes the hijacked socket into a queue."""

    def __init__(
        self,
        sandbox: DockerSandbox,
        exec_id: str,
        marker: str,
        sock: socket.socket,
        stdin: bytes | None,
        argv: Sequence[str],
        cwd: str,
    ) -> None:
        self._sandbox = sandbox
        self._exec_id = exec_id
        self._marker = marker
        self._sock = sock
        self._argv = list(argv)
        self._cwd = cwd
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[OutputChunk | BaseException | None] = asyncio.Queue()
        self._exit_code: int | None = None
        self._exit = self._loop.create_future()
        self._first = True
        self._held: bytes | None = None
        self._eof = False
        if stdin is not None:
            threading.Thread(target=self._feed, args=(stdin,), daemon=True).start()
        threading.Thread(target=self._pump, daemon=True).start()

    def _feed(self, data: bytes) -> None:
        try:
            view = memoryview(data)
            while view:
                sent = self._sock.send(view[: 1 << 20])
                view = view[sent:]
        except OSError:
            pass  # the command exited without reading all of its stdin
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_WR)

    def _post(self, item: OutputChunk | BaseException | None) -> None:
        self._loop.call_soon_threadsafe(self._queue.put_nowait, item)

    def _recv_exact(self, size: int) -> bytes | None:
        parts = []
        while size:
            chunk = self._sock.recv(min(size, 1 << 20))
            if not chunk:
                return None
            parts.append(chunk)
            size -= len(chunk)
        return b"".join(parts)

    def _pump(self) -> None:
        try:
            while True:
                header = self._recv_exact(8)
                if header is None:
                    break
                kind, size = header[0], struct.unpack(">I", header[4:])[0]
                payload = self._recv_exact(size)
                if payload is None:
                    break
                self._post(OutputChunk("stderr" if kind == 2 else "stdout", payload))
            code = self._inspect_exit_code()
            self._loop.call_soon_threadsafe(self._set_exit, code)
        except BaseException as exc:  # handed to the reader on the loop
            self._post(exc)
            self._loop.call_soon_threadsafe(self._set_exit, -1)
        finally:
            with contextlib.suppress(OSError):
                self._sock.close()
            self._post(None)

    def _inspect_exit_code(self) -> int:
        api = engine()
        # The stream ends a moment before the engine records the exit.
        for _ in range(500):
            info = api.exec_inspect(self._exec_id)
            if not info["Running"] and info["ExitCode"] is not None:
                return int(info["ExitCode"])
            time.sleep(0.002)
        return -1

    def _set_exit(self, code: int) -> None:
        self._exit_code = code
        if not self._exit.done():
            self._exit.set_result(code)

    async def read(self) -> OutputChunk | None:
        while not self._eof:
            item = await self._queue.get()
            if isinstance(item, BaseException):
                raise item
            if item is None:
                self._eof = True
                break
            if self._first:
                self._first = False
                # The runtime reports a failed start as output plus exit 126:
                # hold that first chunk until the exit code says which it is.
                if item.stream == "stdout" and item.data.startswith(_OCI_FAILURE):
                    self._held = item.data
                    continue
            return item
        if self._held is not None:
            held, self._held = self._held, None
            if await asyncio.shield(self._exit) == 126:
                raise _oci_error(held.decode("utf-8", "replace"), self._argv, self._cwd)
            return OutputChunk("stdout", held)
        return None

    async def wait(self) -> int:
        return int(await asyncio.shield(self._exit))

    @property
    def returncode(self) -> int | None:
        return self._exit_code

    async def kill(self, grace: float) -> None:
        if self._exit.done():
            return
        with contextlib.suppress(HutchError):
            await self._sandbox.run_quiet(
                ["sh", "-c", _KILL_SCRIPT, "hutch-kill", f"{EXEC_MARKER}={self._marker}",
                 str(max(1, int(grace * 10)))]
            )
        # Closing the socket ends the reader even if an orphan kept a pipe open.
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(self._exit), 5)
        if not self._exit.done():
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_RDWR)


# -- the sandbox ------------------------------------------------------------------


def _parse_mount(spec: str) -> tuple[str, dict[str, str]]:
    parts = spec.split(":")
    if len(parts) not in (2, 3) or not parts[0] or not parts[1]:
        raise InvalidArgument(f"mount {spec!r} is not host:container[:ro]")
    mode = parts[2] if len(parts) == 3 else "rw"
    if mode not in ("ro", "rw"):
        raise InvalidArgument(f"mount {spec!r}: mode must be ro or rw")
    return os.path.abspath(parts[0]), {"bind": parts[1], "mode": mode}


class DockerSandbox(SandboxBackend):
    provider = "docker"
    capabilities = Capabilities(
        processes=True,
        pause=True,
        suspend=True,
        suspend_keeps_processes=False,
        resource_limits=True,
        users=True,
        preview_url=True,
    )
    config_model = DockerConfig

    def __init__(
        self,
        sandbox_id: str,
        config: DockerConfig,
        host_workdir: str,
        owns_workdir: bool,
        container_id: str | None,
        suspended_image: str | None = None,
    ) -> None:
        super().__init__(sandbox_id, config.mount_point)
        self.config = config
        self.host_workdir = host_workdir
        self.owns_workdir = owns_workdir
        self.container_id = container_id
        self.container_name = f"hutch-{sandbox_id}"
        self.suspended_image = suspended_image
        self._closed = False

    # -- provisioning -------------------------------------------------------------
    @classmethod
    async def create(cls, config: DockerConfig, sandbox_id: str) -> DockerSandbox:
        if config.host_workdir:
            host_workdir, owns = os.path.abspath(config.host_workdir), False
        else:
            host_workdir = os.path.join(hutch_home(), "sandboxes", sandbox_id, "workspace")
            owns = True
        os.makedirs(host_workdir, exist_ok=True)
        sandbox = cls(sandbox_id, config, host_workdir, owns, None)
        try:
            sandbox.container_id = await sandbox._run_container(config.image)
        except BaseException:
            if owns:
                shutil.rmtree(os.path.dirname(host_workdir), ignore_errors=True)
            raise
        return sandbox

    def _container_spec(self, image: str) -> dict[str, Any]:
        api = engine()
        cfg = self.config
        binds = {self.host_workdir: {"bind": cfg.mount_point, "mode": "rw"}}
        binds.update(dict(_parse_mount(m) for m in cfg.mounts))
        host_config = api.create_host_config(
            binds=binds,
            network_mode=cfg.network_mode,
            mem_limit=cfg.memory,
            nano_cpus=int(cfg.cpus * 1e9) if cfg.cpus else None,
            pids_limit=cfg.pids_limit,
            security_opt=["no-new-privileges"],
            cap_drop=cfg.cap_drop,
        )
        labels = {**cfg.labels, MANAGED_LABEL: "1", SANDBOX_LABEL: self.sandbox_id}
        return {
            "image": image,
            "command": ["sleep", "infinity"],
            "entrypoint": [],
            "name": self.container_name,
            "labels": labels,
            "environment": {**cfg.env, SANDBOX_MARKER: self.sandbox_id},
            "working_dir": cfg.mount_point,
            "host_config": host_config,
            "detach": True,
        }

    async def _run_container(self, image: str) -> str:
        import docker.errors

        api = engine()
        cfg = self.config

        def run() -> str:
            spec = self._container_spec(image)
            try:
                created = api.create_container(**spec)
            except docker.errors.ImageNotFound:
                if not cfg.pull_if_missing or image.startswith(SUSPENDED_REPOSITORY):
                    raise NotFound(f"image {image!r} is not on this Docker Engine") from None
                try:
                    api.pull(image)
                except docker.errors.APIError as exc:
                    raise ProviderError(
                        f"image {image!r} is not on this Docker Engine and pulling it "
                        f"failed: {_explanation(exc)}"
                    ) from None
                created = api.create_container(**spec)
            try:
                api.start(created["Id"])
            except BaseException:
                api.remove_container(created["Id"], force=True)
                raise
            return str(created["Id"])

        result: str = await _call(run)
        return result

    def describe(self) -> dict[str, Any]:
        return {
            **super().describe(),
            "config": self.config.model_dump(),
            "host_workdir": self.host_workdir,
            "owns_workdir": self.owns_workdir,
            "container_id": self.container_id,
            "container_name": self.container_name,
            "suspended_image": self.suspended_image,
        }

    @classmethod
    async def reconnect(cls, sandbox_id: str, description: Mapping[str, Any]) -> DockerSandbox:
        """Rebuild the backend of a sandbox made earlier (by a daemon now gone)."""
        return cls(
            sandbox_id,
            DockerConfig.model_validate(description["config"]),
            str(description["host_workdir"]),
            bool(description.get("owns_workdir", False)),
            description.get("container_id"),
            description.get("suspended_image"),
        )

    def _container(self) -> str:
        if self.container_id is None:
            raise SandboxUnavailable(f"docker sandbox {self.sandbox_id} has no container")
        return self.container_id

    # -- processes -----------------------------------------------------------------
    def shell_argv(self, command: str) -> list[str]:
        return ["/bin/sh", "-c", _SHELL_SHIM, "sh", command]

    async def start_process(
        self,
        argv: Sequence[str],
        *,
        cwd: str,
        env: Mapping[str, str],
        stdin: bytes | None,
        user: str | None,
    ) -> DockerProcess:
        api = engine()
        container = self._container()
        marker = uuid.uuid4().hex
        full_env = {**env, EXEC_MARKER: marker, SANDBOX_MARKER: self.sandbox_id}

        def start() -> tuple[str, socket.socket]:
            created = api.exec_create(
                container, list(argv), stdin=stdin is not None, environment=full_env,
                workdir=cwd, user=user or "",
            )
            sock = api.exec_start(created["Id"], socket=True)
            return created["Id"], getattr(sock, "_sock", sock)

        exec_id, sock = await _call(start)
        return DockerProcess(self, exec_id, marker, sock, stdin, argv, cwd)

    async def run_quiet(self, argv: Sequence[str], stdin: bytes | None = None) -> tuple[int, bytes]:
        """Run a helper command to completion: (exit code, stdout + stderr)."""
        proc = await self.start_process(argv, cwd="/", env={}, stdin=stdin, user=None)
        out = []
        while (chunk := await proc.read()) is not None:
            out.append(chunk.data)
        return await proc.wait(), b"".join(out)

    async def count_busy_processes(self) -> int:
        # A failure propagates: the lifecycle engine takes "cannot tell" as busy.
        top = await _call(engine().top, self._container(), ps_args="-e -o pid")
        return max(0, len(top.get("Processes") or []) - 1)

    # -- files -----------------------------------------------------------------------
    async def _stat_header(self, path: str) -> dict[str, Any]:
        api = engine()
        container = self._container()

        def head() -> dict[str, Any]:
            response = api.head(
                api._url("/containers/{0}/archive", container), params={"path": path}
            )
            if response.status_code == 404:
                raise SandboxFileNotFound(f"no such file or directory: {path}")
            api._raise_for_status(response)
            header = response.headers.get("X-Docker-Container-Path-Stat", "")
            result: dict[str, Any] = json.loads(base64.b64decode(header))
            return result

        result: dict[str, Any] = await _call(head, path=path)
        return result

    @staticmethod
    def _info(path: str, header: Mapping[str, Any]) -> FileInfo:
        mode = int(header.get("mode", 0))
        if mode & _GO_MODE_DIR:
            kind = FileType.DIRECTORY
        elif mode & _GO_MODE_SYMLINK:
            kind = FileType.SYMLINK
        elif mode >> 16 == 0:
            kind = FileType.FILE
        else:
            kind = FileType.OTHER
        mtime = header.get("mtime", "")
        try:
            from datetime import datetime

            ts = datetime.fromisoformat(re.sub(r"(\.\d{6})\d*", r"\1", mtime)).timestamp()
        except (TypeError, ValueError):
            ts = 0.0
        return FileInfo(path, kind, int(header.get("size", 0)), mode & 0o7777, ts)

    async def stat(self, path: str) -> FileInfo:
        return self._info(path, await self._stat_header(path))

    async def read_file(self, path: str, limit: int) -> bytes:
        api = engine()
        container = self._container()

        def get() -> bytes:
            stream, header = api.get_archive(container, path, chunk_size=1 << 20)
            if int(header.get("mode", 0)) & _GO_MODE_DIR:
                stream.close()
                raise SandboxIsADirectory(f"{path} is a directory")
            size = int(header.get("size", 0))
            if size > limit:
                stream.close()
                raise OutputLimitExceeded(
                    f"{path} is {size} bytes, over the read limit of {limit} bytes"
                )
            raw = b"".join(stream)
            with tarfile.open(fileobj=io.BytesIO(raw)) as tar:
                member = tar.next()
                if member is None:
                    raise ProviderError(f"docker returned an empty archive for {path}")
                if member.issym() or member.islnk():
                    target = member.linkname
                    raise _FollowLink(target)
                extracted = tar.extractfile(member)
                return extracted.read() if extracted is not None else b""

        try:
            data: bytes = await _call(get, path=path)
        except _FollowLink as link:
            target = link.args[0]
            if not target.startswith("/"):
                target = os.path.join(os.path.dirname(path), target)
            resolved = target
            return await self.read_file(os.path.normpath(resolved), limit)
        return data

    async def write_file(self, path: str, data: bytes) -> None:
        api = engine()
        container = self._container()
        try:
            info = await self.stat(path)
        except FileNotFoundError:
            pass
        else:
            # Untarring a file over a directory would replace the whole tree.
            if info.type == FileType.DIRECTORY:
                raise SandboxIsADirectory(f"{path} is a directory")
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
            member = tarfile.TarInfo(path.lstrip("/"))
            member.size = len(data)
            member.mode = 0o644
            member.mtime = int(time.time())
            tar.addfile(member, io.BytesIO(data))
        payload = buffer.getvalue()

        def put() -> None:
            if not api.put_archive(container, "/", payload):
                raise ProviderError(f"docker refused to write {path}")

        await _call(put, path=path)

    async def list_dir(self, path: str) -> list[FileInfo]:
        info = await self.stat(path)
        if info.type != FileType.DIRECTORY:
            raise InvalidArgument(f"{path} is not a directory")
        code, out = await self.run_quiet(
            ["find", path, "-mindepth", "1", "-maxdepth", "1",
             "-printf", "%y\\t%s\\t%m\\t%T@\\t%f\\0"]
        )
        if code != 0:
            raise ProviderError(f"listing {path} failed: {out.decode('utf-8', 'replace')}")
        kinds = {"f": FileType.FILE, "d": FileType.DIRECTORY, "l": FileType.SYMLINK}
        entries = []
        for record in out.split(b"\0"):
            if not record:
                continue
            kind, size, mode, mtime, name = record.decode("utf-8", "surrogateescape").split(
                "\t", 4
            )
            entries.append(
                FileInfo(
                    path.rstrip("/") + "/" + name, kinds.get(kind, FileType.OTHER),
                    int(size), int(mode, 8), float(mtime),
                )
            )
        return sorted(entries, key=lambda e: e.path)

    async def remove(self, path: str, recursive: bool) -> None:
        info = await self.stat(path)
        if info.type == FileType.DIRECTORY:
            argv = ["rm", "-rf", "--", path] if recursive else ["rmdir", "--", path]
        else:
            argv = ["rm", "-f", "--", path]
        code, out = await self.run_quiet(argv)
        if code != 0:
            message = out.decode("utf-8", "replace")
            if "not empty" in message:
                raise SandboxIsADirectory(f"{path} is a non-empty directory; pass recursive=True")
            if "ermission denied" in message or "not permitted" in message:
                raise SandboxPermissionDenied(f"permission denied: {path}")
            raise ProviderError(f"removing {path} failed: {message.strip()}")

    async def walk_files(self, root: str) -> list[str]:
        await self.stat(root)  # FileNotFoundError for a missing root
        code, out = await self.run_quiet(["find", root, "-type", "f", "-print0"])
        if code != 0 and not out:
            raise ProviderError(f"walking {root} failed")
        return [p.decode("utf-8", "surrogateescape") for p in out.split(b"\0") if p]

    async def grep(
        self, pattern: re.Pattern[str], root: str, glob: str | None, limit: int
    ) -> list[GrepMatch]:
        info = await self.stat(root)
        flags = ["-i"] if pattern.flags & re.IGNORECASE else []
        # grep -P finds candidates fast in the container; Python's re re-checks
        # each line so the answer is exactly what every other provider gives.
        code, out = await self.run_quiet(
            ["grep", "-rnIZP", *flags, "-e", pattern.pattern, "--", root]
        )
        if code == 2:  # PCRE unavailable or a pattern PCRE reads differently
            code, out = await self.run_quiet(["grep", "-rnIZ", "-e", "", "--", root])
        matcher = compile_glob(glob) if glob and info.type == FileType.DIRECTORY else None
        prefix = root.rstrip("/") + "/"
        matches: list[GrepMatch] = []
        pos = 0
        while pos < len(out):
            nul = out.find(b"\0", pos)
            if nul < 0:
                break
            path = out[pos:nul].decode("utf-8", "surrogateescape")
            end = out.find(b"\n", nul)
            end = len(out) if end < 0 else end
            number, _, text = out[nul + 1:end].partition(b":")
            pos = end + 1
            if info.type != FileType.DIRECTORY:
                path = root
            if matcher is not None and not matcher.match(path[len(prefix):]):
                continue
            line = text.decode("utf-8", "replace")
            if pattern.search(line):
                matches.append(GrepMatch(path, int(number), line))
        return sorted(matches, key=lambda m: (m.path, m.line_number))

    async def preview_url(self, port: int) -> str:
        details = await _call(engine().inspect_container, self._container())
        networks = details["NetworkSettings"].get("Networks") or {}
        for network in networks.values():
            if network.get("IPAddress"):
                return f"http://{network['IPAddress']}:{port}"
        raise ProviderError(f"sandbox {self.sandbox_id} has no IP address (network_mode none?)")

    # -- lifecycle primitives ---------------------------------------------------------
    async def pause(self) -> None:
        await _call(engine().pause, self._container())

    async def unpause(self) -> None:
        await _call(engine().unpause, self._container())

    async def suspend(self) -> None:
        """Commit the container's changes to an image and remove the container."""
        api = engine()
        container = self._container()
        previous = self.suspended_image

        def commit() -> str:
            image = api.commit(
                container, repository=SUSPENDED_REPOSITORY, tag=self.sandbox_id,
                conf={"Labels": {MANAGED_LABEL: "1", SANDBOX_LABEL: self.sandbox_id}},
            )
            return str(image["Id"])

        image_id = await _call(commit)
        self.suspended_image = image_id
        await _call(api.remove_container, container, force=True)
        self.container_id = None
        if previous and previous != image_id:
            # Still a parent layer of the new image: docker keeps what it needs.
            with contextlib.suppress(HutchError):
                await _call(api.remove_image, previous, noprune=True)

    async def resume(self) -> None:
        if self.container_id is not None:
            return
        image = self.suspended_image or self.config.image
        self.container_id = await self._run_container(image)

    async def memory_bytes(self) -> int | None:
        if self.container_id is None:
            return 0  # suspended: nothing in memory
        # cgroup v1 with the cgroupfs driver: a file read, not a stats call.
        for path in (
            f"/sys/fs/cgroup/memory/docker/{self.container_id}/memory.usage_in_bytes",
            f"/sys/fs/cgroup/system.slice/docker-{self.container_id}.scope/memory.current",
        ):
            try:
                with open(path) as fh:  # noqa: ASYNC230 - a cgroup file, microseconds
                    return int(fh.read().strip())
            except (OSError, ValueError):
                continue
        return None

    async def is_alive(self) -> bool:
        if self.container_id is None:
            return False
        try:
            details = await _call(engine().inspect_container, self.container_id)
        except HutchError:
            return False
        state = details.get("State", {})
        return bool(state.get("Running") or state.get("Paused"))

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        api = engine()
        if self.config.preserve and self.container_id is not None:
            # Said loudly: the user asked to keep it and needs to know how to reach it.
            log.warning(
                "sandbox %s kept (preserve): docker exec -it %s bash",
                self.sandbox_id, self.container_name,
            )
            return
        if self.container_id is not None:
            with contextlib.suppress(HutchError):
                await _call(api.remove_container, self.container_id, force=True, v=True)
            self.container_id = None
        if self.suspended_image is not None:
            with contextlib.suppress(HutchError):
                await _call(api.remove_image, self.suspended_image, force=True)
            self.suspended_image = None
        if self.owns_workdir:
            await anyio.to_thread.run_sync(
                lambda: shutil.rmtree(os.path.dirname(self.host_workdir), ignore_errors=True)
            )


class _FollowLink(Exception):
    """A read hit a symlink: read its target instead."""


__all__ = ["DockerConfig", "DockerSandbox", "list_managed_containers"]
