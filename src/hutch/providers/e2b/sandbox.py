"""``e2b``: sandboxes on E2B's service (or anything speaking its wire, such as
another ``hutch serve``), through the ``e2b`` SDK.

hutch's lifecycle over E2B's: suspend is E2B's pause (memory and processes
kept), resume its connect; snapshots are E2B's snapshots (a snapshot's ID is
a template), and so forks. Files move through the SDK's ``files``; commands
through its envd process client (:mod:`.process`), which keeps their output
as bytes.
"""

from __future__ import annotations

import hashlib
import os
from typing import TYPE_CHECKING, Any, ClassVar

from ..._errors import (
    HutchError,
    InvalidArgument,
    OutputLimitExceeded,
    ProviderError,
    SandboxFileNotFound,
    SandboxIsADirectory,
    SandboxUnavailable,
)
from ..._lazy import lazy_module
from ..._paths import hutch_home
from ..._types import Capabilities, FileInfo, FileType, ProviderSnapshot
from ..base import BackendProcess, NativeBackend, ProcessRequest, RuntimeState
from .config import E2BConfig
from .errors import E2BSandboxGone, mapped

if TYPE_CHECKING:
    import e2b as e2b_sdk
    from e2b.sandbox.filesystem import filesystem as e2b_filesystem

    from .process import Envd
else:  # the SDK (envd's client, protobuf, Connect: half a second) at its first use
    e2b_sdk = lazy_module("e2b")
    e2b_filesystem = lazy_module("e2b.sandbox.filesystem.filesystem")

#: How deep a walk of the file tree goes (envd lists to a depth).
WALK_DEPTH = 64
#: The metadata key that names the hutch sandbox an E2B sandbox serves.
SANDBOX_KEY = "hutch_sandbox"


def _connection(config: E2BConfig) -> dict[str, Any]:
    """The SDK's connection options the settings give (the rest from its environment)."""
    given = {"api_key": config.api_key, "api_url": config.api_url,
             "sandbox_url": config.sandbox_url, "domain": config.domain}
    return {k: v for k, v in given.items() if v}


def home_tag() -> str:
    """Names this hutch home's snapshots on E2B (an account may serve several)."""
    home = os.path.realpath(hutch_home()).encode()
    return "hutch-" + hashlib.sha256(home).hexdigest()[:12]


def _envd(e2b: Any) -> Envd:
    from .process import Envd

    return Envd(e2b)


def _file_info(entry: Any) -> FileInfo:
    kind = entry.type
    e2b_types = e2b_filesystem.FileType
    if getattr(entry, "symlink_target", None):
        file_type = FileType.SYMLINK
    elif kind == e2b_types.DIR:
        file_type = FileType.DIRECTORY
    elif kind == e2b_types.FILE:
        file_type = FileType.FILE
    else:
        file_type = FileType.OTHER
    return FileInfo(entry.path, file_type, int(entry.size or 0), int(entry.mode or 0),
                    entry.modified_time.timestamp())


class E2BSandbox(NativeBackend):
    provider = "e2b"
    capabilities = Capabilities(
        processes=True, suspend=True, suspend_keeps_processes=True, snapshot=True, fork=True,
        users=True, preview_url=True,
    )
    config_model = E2BConfig
    # E2B's service is reached by its address and key, from any host that has
    # them (a fleet's daemons share their environment): a live daemon finds a
    # dead one's sandboxes again from their description.
    reachable_from_any_host = True
    #: The E2B connections (settings given) this process has used.
    _reached: ClassVar[set[tuple[tuple[str, Any], ...]]] = set()

    def __init__(self, sandbox_id: str, config: E2BConfig, e2b_id: str,
                 e2b: Any | None) -> None:
        super().__init__(sandbox_id, config.workdir)
        self.config = config
        self.e2b_id = e2b_id
        #: The SDK's sandbox, once reached: a sandbox found paused after a
        #: restart is reached by its resume (the SDK's connect resumes).
        self._e2b = e2b
        self._envd = None if e2b is None else _envd(e2b)
        #: Found again while E2B did not answer (its state unknown, running
        #: on record): reached by the first call that needs it.
        self._reach_later = False

    async def _sdk_sandbox(self) -> Any:
        """The SDK's sandbox, reached now if it was found again unreached."""
        if self._e2b is None and self._reach_later:
            await self._connect()
            self._reach_later = False
        if self._e2b is None:
            raise SandboxUnavailable(f"E2B sandbox {self.e2b_id} is paused: resume it first")
        return self._e2b

    async def _envd_client(self) -> Envd:
        await self._sdk_sandbox()
        assert self._envd is not None  # set with the SDK's sandbox
        return self._envd

    @classmethod
    async def _start(cls, config: E2BConfig, sandbox_id: str, template: str) -> E2BSandbox:
        with mapped(f"create an E2B sandbox from {template}"):
            e2b = await e2b_sdk.AsyncSandbox.create(
                template=template, timeout=config.e2b_timeout,
                metadata={**config.metadata, SANDBOX_KEY: sandbox_id}, envs=config.env,
                **cls._reach(config),
            )
        sandbox = cls(sandbox_id, config, e2b.sandbox_id, e2b)
        try:
            await sandbox.make_dir(config.workdir, parents=True)
        except OSError:
            pass  # it is there already
        return sandbox

    @classmethod
    async def create(cls, config: E2BConfig, sandbox_id: str) -> E2BSandbox:
        return await cls._start(config, sandbox_id, config.template)

    def describe(self) -> dict[str, Any]:
        return {"e2b_id": self.e2b_id, "config": self.config.model_dump(),
                "workdir": self.workdir}

    @classmethod
    async def reconnect(cls, sandbox_id: str, description: Any) -> E2BSandbox:
        """Find the sandbox again; a paused one stays paused (the SDK's
        connect would resume it) until hutch resumes it."""
        config = E2BConfig.model_validate(description["config"])
        sandbox = cls(sandbox_id, config, str(description["e2b_id"]), None)
        try:
            state = await sandbox._e2b_state()
        except HutchError:
            # E2B does not answer: the record stands (observed_state says it
            # cannot tell), and the first call reaches the sandbox.
            sandbox._reach_later = True
            return sandbox
        if state == "running":
            await sandbox._connect()
        return sandbox

    async def _e2b_state(self) -> str:
        """E2B's state of the sandbox: ``running``, ``paused`` or ``gone``."""
        try:
            with mapped(f"E2B sandbox {self.e2b_id}"):
                info = await e2b_sdk.AsyncSandbox.get_info(self.e2b_id, **self._reach(self.config))
        except (E2BSandboxGone, FileNotFoundError):
            return "gone"
        return str(getattr(info.state, "value", info.state))

    async def _connect(self) -> None:
        with mapped(f"reach E2B sandbox {self.e2b_id}"):
            e2b = await e2b_sdk.AsyncSandbox.connect(self.e2b_id, timeout=self.config.e2b_timeout,
                                       **self._reach(self.config))
        self._e2b, self._envd = e2b, _envd(e2b)

    async def preview_url(self, port: int) -> str:
        scheme = "http" if (self.config.sandbox_url or "").startswith("http:") else "https"
        return f"{scheme}://{(await self._sdk_sandbox()).get_host(port)}"

    # -- lifecycle: E2B's pause keeps memory; connect resumes ---------------------------
    async def suspend(self) -> None:
        with mapped(f"pause E2B sandbox {self.e2b_id}"):
            await (await self._sdk_sandbox()).pause()

    async def resume(self) -> None:
        await self._connect()

    async def is_alive(self) -> bool:
        return await self._e2b_state() == "running"

    async def is_suspended(self) -> bool:
        return await self._e2b_state() == "paused"

    async def observed_state(self) -> RuntimeState:
        state = await self._e2b_state()
        if state == "running":
            return RuntimeState.RUNNING
        return RuntimeState.SUSPENDED if state == "paused" else RuntimeState.GONE

    async def close(self) -> None:
        with mapped(f"kill E2B sandbox {self.e2b_id}"):
            await e2b_sdk.AsyncSandbox.kill(self.e2b_id, **self._reach(self.config))

    # -- snapshots ------------------------------------------------------------------------
    async def capture(self, snapshot_id: str, *, diff: bool = True) -> ProviderSnapshot:
        e2b = await self._sdk_sandbox()
        with mapped(f"snapshot E2B sandbox {e2b.sandbox_id}"):
            info = await e2b.create_snapshot(name=f"{home_tag()}-{snapshot_id}")
        return ProviderSnapshot(snapshot_id, self.provider, await self._workdir_bytes(),
                                {"e2b_snapshot": info.snapshot_id, "config":
                                 self.config.model_dump()})

    async def _workdir_bytes(self) -> int:
        """What the working directory holds, bytes: E2B says nothing of a
        snapshot's size, and this is the part of it that is the caller's."""
        try:
            result = await self.runtime.start_process(ProcessRequest(
                ["du", "-sb", "--", self.workdir], cwd="/"))
            out = []
            while (chunk := await result.read()) is not None:
                if chunk.stream == "stdout":
                    out.append(chunk.data)
            await result.wait()
            return int(b"".join(out).split()[0])
        except (HutchError, ValueError, IndexError):
            return 0

    @classmethod
    async def create_from_snapshot(
        cls, config: Any, sandbox_id: str, snapshot: ProviderSnapshot
    ) -> E2BSandbox:
        settings = config if isinstance(config, E2BConfig) else E2BConfig.model_validate(
            snapshot.data.get("config") or {})
        return await cls._start(settings, sandbox_id, str(snapshot.data["e2b_snapshot"]))

    @classmethod
    async def remove_snapshot(cls, snapshot: ProviderSnapshot) -> None:
        if "e2b_snapshot" not in snapshot.data:
            return  # nothing of E2B's is known by that id
        settings = E2BConfig.model_validate(snapshot.data.get("config") or {})
        with mapped(f"remove E2B snapshot {snapshot.data.get('e2b_snapshot')}"):
            await e2b_sdk.AsyncSandbox.delete_snapshot(str(snapshot.data["e2b_snapshot"]),
                                         **cls._reach(settings))

    @classmethod
    async def held_snapshots(cls) -> list[str]:
        """This hutch home's snapshots on every E2B account this process has
        reached (and the SDK environment's): those named with its tag."""
        connections = set(cls._reached)
        if os.environ.get("E2B_API_KEY"):
            connections.add(())
        if not connections:
            raise ProviderError("no E2B account reached yet: its snapshots cannot be listed")
        prefix = home_tag() + "-"
        held: set[str] = set()
        for connection in sorted(connections):
            with mapped("list E2B snapshots"):
                pages = e2b_sdk.AsyncSandbox.list_snapshots(**dict(connection))
                while pages.has_next:
                    for info in await pages.next_items():
                        held.update(n[len(prefix):] for n in info.names if n.startswith(prefix))
        return sorted(held)

    @classmethod
    def _reach(cls, config: E2BConfig) -> dict[str, Any]:
        """The connection options of ``config``, remembered for held_snapshots."""
        connection = _connection(config)
        cls._reached.add(tuple(sorted(connection.items())))
        return connection

    # -- processes ------------------------------------------------------------------------
    async def start_process(self, request: ProcessRequest) -> BackendProcess:
        return await (await self._envd_client()).start(request)

    async def count_busy_processes(self) -> int:
        return await (await self._envd_client()).count()

    # -- files ----------------------------------------------------------------------------
    async def stat(self, path: str) -> FileInfo:
        with mapped(f"stat {path}"):
            return _file_info(await (await self._sdk_sandbox()).files.get_info(path))

    async def read_file(self, path: str, limit: int) -> bytes:
        info = await self.stat(path)
        if info.type == FileType.DIRECTORY:
            raise SandboxIsADirectory(f"{path} is a directory")
        if info.size > limit:
            raise OutputLimitExceeded(
                f"{path} is {info.size} bytes, over the read limit of {limit} bytes")
        with mapped(f"read {path}"):
            data: bytes = bytes(await (await self._sdk_sandbox()).files.read(path, format="bytes"))
        if len(data) > limit:
            raise OutputLimitExceeded(f"{path} is over the read limit of {limit} bytes")
        return data

    async def write_file(self, path: str, data: bytes) -> None:
        try:
            if (await self.stat(path)).type == FileType.DIRECTORY:
                raise SandboxIsADirectory(f"{path} is a directory")
        except FileNotFoundError:
            pass
        with mapped(f"write {path}"):
            await (await self._sdk_sandbox()).files.write(path, data)

    async def list_dir(self, path: str) -> list[FileInfo]:
        info = await self.stat(path)
        if info.type != FileType.DIRECTORY:
            raise InvalidArgument(f"{path} is not a directory")
        with mapped(f"list {path}"):
            entries = await (await self._sdk_sandbox()).files.list(path, depth=1)
        return [_file_info(e) for e in entries]

    async def remove(self, path: str, recursive: bool) -> None:
        info = await self.stat(path)  # a missing path is file_not_found, not E2B's no-op
        if info.type == FileType.DIRECTORY and not recursive and await self.list_dir(path):
            raise SandboxIsADirectory(f"{path} is a non-empty directory; pass recursive=True")
        with mapped(f"remove {path}"):
            await (await self._sdk_sandbox()).files.remove(path)

    async def walk_files(self, root: str) -> list[str]:
        info = await self.stat(root)
        if info.type != FileType.DIRECTORY:
            return [root]
        with mapped(f"walk {root}"):
            entries = await (await self._sdk_sandbox()).files.list(root, depth=WALK_DEPTH)
        return sorted(e.path for e in entries if e.type == e2b_filesystem.FileType.FILE)

    async def exists(self, path: str) -> bool:
        try:
            await self.stat(path)
        except SandboxFileNotFound:
            return False
        return True
