"""``gvisor``: a sandbox under gVisor's user-space kernel, ``runsc`` driven
directly (not through Docker, whose checkpoint needs an experimental daemon).

Each sandbox is an OCI bundle over a hutch image's root file system: the
host's copy is shared and never written; the sandbox writes to an overlay in
its own memory (``--overlay2=root:memory``), so its working directory and
everything else it writes are its own. hutch's agent is the keeper (pid 1),
serving exec and files on a socket it makes on the host through gVisor's
gofer (``--host-uds=create``), in a directory of the sandbox's own.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import time
from collections.abc import Mapping
from typing import Annotated, Any, Literal

import anyio.to_thread
from pydantic import ConfigDict, Field

from ..._errors import InvalidArgument, ProviderError, SandboxUnavailable
from ..._types import Capabilities
from .._hostproc import SANDBOX_MARKER
from ..agent import AgentFailure, AgentRuntime, agent_binary
from ..base import ProviderSettings, RuntimeState, SandboxBackend, SandboxRuntime
from ..images import hutch_image_rootfs
from ..images.exported import docker_image_rootfs
from ..policy import (
    ImageName,
    Limit,
    MemorySize,
    NotBool,
    SandboxDirectory,
    format_bytes,
    parse_bytes,
)
from . import bundle, runsc

DEFAULT_IMAGE = "hutch-test:bookworm"
AGENT_START_TIMEOUT = 15.0
log = logging.getLogger("hutch.gvisor")
_SAFE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


class GvisorConfig(ProviderSettings):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    type: Literal["gvisor"] = "gvisor"
    #: A hutch image (``hutch image build``); the test image when unset.
    image: ImageName | None = None
    #: The working directory inside (made if missing), in the sandbox's own
    #: in-memory overlay: never shared with another sandbox.
    workdir: SandboxDirectory = "/workspace"
    memory: Annotated[MemorySize | None, Limit("memory", parse_bytes, format_bytes)] = None
    pids_limit: Annotated[int, Limit("pids", int, int), NotBool] = Field(
        default=1024, gt=0, le=4_194_304
    )
    cpus: Annotated[float | None, Limit("cpus"), NotBool] = Field(default=None, gt=0, le=1024)
    #: Only ``none``: Debian's runsc (2022) cannot set up its network stack on
    #: this kind of kernel (see the class's docs).
    network: Literal["none"] = "none"
    env: dict[str, str] = {}
    hostname: str = Field(default="hutch", pattern=r"^[A-Za-z0-9][A-Za-z0-9.-]{0,62}$")


def sandboxes_dir() -> str:
    return os.path.join(runsc.gvisor_home(), "sandboxes")


def _resolve_image(image: str) -> str:
    """A hutch image's root, or a Docker image's exported once and cached."""
    root = hutch_image_rootfs(image) or docker_image_rootfs(image)
    if not os.path.lexists(os.path.join(root, "bin/sh")):
        raise InvalidArgument(f"image {image!r} has no /bin/sh")
    return root


class GvisorSandbox(SandboxBackend):
    """A sandbox under gVisor (``runsc``).

    Network: none, always. Debian's runsc build (2022) fails to bring up its
    own network stack (``--network=sandbox``) on this kind of kernel, and
    ``--network=host`` would hand the sandbox the host's; a newer runsc
    (``HUTCH_RUNSC``) would add it. Pause is runsc's own (the sandbox's
    kernel stops its tasks). Suspend, snapshots and fork are not offered
    yet: ``runsc checkpoint`` refuses a sandbox holding a host socket, which
    the agent's listening socket is (see the README).
    """

    provider = "gvisor"
    capabilities = Capabilities(
        processes=True,
        pause=True,
        network_isolation=True,
        resource_limits=True,
        # The agent runs as root in the sandbox's own kernel, able to switch users.
        users=True,
    )
    config_model = GvisorConfig

    def __init__(self, sandbox_id: str, workdir: str, sandbox_dir: str) -> None:
        super().__init__(sandbox_id, workdir)
        self.sandbox_dir = sandbox_dir
        self._agent = AgentRuntime(
            sandbox_id, workdir, self.agent_socket, provider_name="gvisor",
            recover=self._recover_agent,
        )
        # Its descriptors are the user-space kernel's, not the host's.
        self._agent.hands_over_fds = False

    @property
    def bundle_dir(self) -> str:
        return os.path.join(self.sandbox_dir, "bundle")

    @property
    def run_dir(self) -> str:
        """Host side of the agent's socket directory (root's, mode 0700)."""
        return os.path.join(self.sandbox_dir, "run")

    @property
    def agent_socket(self) -> str:
        return os.path.join(self.run_dir, bundle.AGENT_SOCKET)

    @property
    def runtime(self) -> SandboxRuntime:
        return self._agent

    @classmethod
    def answers_here(cls) -> bool:
        try:
            runsc.runsc_binary()
        except InvalidArgument:
            return False
        return True

    # -- provisioning ---------------------------------------------------------------
    @classmethod
    async def create(cls, config: GvisorConfig, sandbox_id: str) -> GvisorSandbox:
        if not _SAFE_ID.match(sandbox_id):
            raise InvalidArgument(f"sandbox id {sandbox_id!r} cannot name a directory")
        if not config.workdir.startswith("/"):
            raise InvalidArgument(f"workdir {config.workdir!r} must be an absolute path")
        runsc.runsc_binary()
        image = config.image or DEFAULT_IMAGE
        rootfs = await anyio.to_thread.run_sync(lambda: _resolve_image(image))
        agent = str(await anyio.to_thread.run_sync(agent_binary))
        sandbox_dir = os.path.join(sandboxes_dir(), sandbox_id)
        if os.path.exists(sandbox_dir):
            raise InvalidArgument(f"sandbox {sandbox_id} already exists")
        sandbox = cls(sandbox_id, config.workdir, sandbox_dir)
        memory = None if config.memory is None else int(parse_bytes(config.memory))
        spec = bundle.spec(
            rootfs=rootfs, agent=agent, run_dir=sandbox.run_dir,
            env={SANDBOX_MARKER: sandbox_id, **config.env}, hostname=config.hostname,
            sandbox_id=sandbox_id, memory=memory, pids=config.pids_limit, cpus=config.cpus,
        )

        def provision() -> None:
            os.makedirs(sandbox.run_dir, mode=0o700)
            os.chmod(sandbox.run_dir, 0o700)
            bundle.write(sandbox.bundle_dir, spec)
            runsc.run("run", "--detach", "--bundle", sandbox.bundle_dir, sandbox_id,
                      what=f"starting sandbox {sandbox_id}")

        try:
            await anyio.to_thread.run_sync(provision)
            await sandbox._await_agent()
            await sandbox._agent.make_dir(config.workdir, True)
        except BaseException:
            await anyio.to_thread.run_sync(lambda: _discard(sandbox_id))
            raise
        return sandbox

    async def _await_agent(self, timeout: float = AGENT_START_TIMEOUT) -> None:
        """Until the agent answers: its socket appears once it listens."""
        self._agent.drop_connections()
        deadline = time.monotonic() + timeout
        while True:
            try:
                await self._agent.ping(timeout=min(1.0, max(0.1, deadline - time.monotonic())))
                return
            except AgentFailure as exc:
                if time.monotonic() >= deadline or not await self.is_alive():
                    raise ProviderError(
                        f"gvisor sandbox {self.sandbox_id}: its agent did not start: {exc}"
                    ) from None
                await anyio.sleep(0.02)

    async def _recover_agent(self, reason: str) -> bool:
        status = await self._status()
        if status is None or status == "stopped":
            raise SandboxUnavailable(
                f"gvisor sandbox {self.sandbox_id}: its agent is gone ({reason}); "
                "the sandbox ended outside hutch"
            )
        if status == "paused":
            raise SandboxUnavailable(f"gvisor sandbox {self.sandbox_id} is paused")
        return False

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "sandbox_dir": self.sandbox_dir}

    @classmethod
    async def reconnect(cls, sandbox_id: str, description: Mapping[str, Any]) -> GvisorSandbox:
        return cls(sandbox_id, str(description["workdir"]), str(description["sandbox_dir"]))

    # -- lifecycle --------------------------------------------------------------------
    async def _status(self) -> str | None:
        found = await anyio.to_thread.run_sync(lambda: runsc.state(self.sandbox_id))
        return None if found is None else str(found.get("status", ""))

    async def pause(self) -> None:
        self._agent.drop_connections()
        await runsc.run_async("pause", self.sandbox_id, what=f"pausing {self.sandbox_id}")

    async def unpause(self) -> None:
        await runsc.run_async("resume", self.sandbox_id, what=f"unpausing {self.sandbox_id}")

    async def is_alive(self) -> bool:
        return await self._status() in ("running", "paused", "created")

    async def observed_state(self) -> RuntimeState:
        status = await self._status()
        if status == "running":
            return RuntimeState.RUNNING
        if status == "paused":
            return RuntimeState.PAUSED
        return RuntimeState.GONE

    async def close(self) -> None:
        self._agent.drop_connections()
        await anyio.to_thread.run_sync(lambda: _discard(self.sandbox_id))

    async def release_runtime(self) -> None:
        self._agent.drop_connections()
        await anyio.to_thread.run_sync(lambda: runsc.remove(self.sandbox_id))

    # -- reconciliation ---------------------------------------------------------------
    @classmethod
    async def discard(cls, sandbox_id: str) -> None:
        if _SAFE_ID.match(sandbox_id):
            await anyio.to_thread.run_sync(lambda: _discard(sandbox_id))

    @classmethod
    async def reap_orphans(cls, known: set[str]) -> list[str]:
        def reap() -> list[str]:
            try:
                names = sorted(os.listdir(sandboxes_dir()))
            except FileNotFoundError:
                return []
            freed = [n for n in names if n not in known and _SAFE_ID.match(n)]
            for name in freed:
                _discard(name)
            return freed
        return await anyio.to_thread.run_sync(reap)


def _discard(sandbox_id: str) -> None:
    """The container and the sandbox's directory gone (blocking, idempotent)."""
    with contextlib.suppress(InvalidArgument):
        runsc.remove(sandbox_id)
    shutil.rmtree(os.path.join(sandboxes_dir(), sandbox_id), ignore_errors=True)
