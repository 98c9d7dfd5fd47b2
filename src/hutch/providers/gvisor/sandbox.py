"""``gvisor``: a sandbox under gVisor's user-space kernel, ``runsc`` driven
directly (not through Docker, whose checkpoint needs an experimental daemon).

Each sandbox is an OCI bundle over a hutch image's root file system: the
host's copy is shared and never written; the sandbox writes to an overlay in
its own memory (``--overlay2=root:memory``), so its working directory and
everything else it writes are its own. hutch's agent, started beside the
keeper, serves exec and files on a socket it makes on the host through gVisor's
gofer (``--host-uds=create``), in a directory of the sandbox's own.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import time
from collections.abc import Mapping
from typing import Annotated, Any, Literal

import anyio.to_thread
from pydantic import ConfigDict, Field

from ..._errors import InvalidArgument, NotFound, ProviderError, SandboxUnavailable
from ..._faults import fault_point
from ..._types import Capabilities, ProviderSnapshot
from .._hostproc import SANDBOX_MARKER
from ..agent import AgentFailure, AgentRuntime, agent_binary
from ..base import ProviderSettings, RuntimeReport, RuntimeState, SandboxBackend, SandboxRuntime
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
from . import bundle, cgroups, checkpoints, deaths, runsc

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
    kernel stops its tasks). Suspend is ``runsc checkpoint`` (memory freed,
    processes kept) and resume ``runsc restore``, under the same bundle,
    flags and build; the agent lets go of its host sockets first (a
    checkpoint refuses them) and listens again after. A command streaming
    through the agent across a suspend loses its connection; processes
    keep running. Snapshots and fork are not offered yet.
    """

    provider = "gvisor"
    # Its runsc sandbox runs apart from the daemon, to outlive it (a restart adopts it).
    runtime_outlives_its_daemon = True
    capabilities = Capabilities(
        processes=True,
        pause=True,
        # runsc checkpoint / restore: processes, memory and the root overlay.
        suspend=True,
        suspend_keeps_processes=True,
        # A checkpoint restored as often as asked: processes and memory too.
        snapshot=True,
        fork=True,
        network_isolation=True,
        resource_limits=True,
        # The agent runs as root in the sandbox's own kernel, able to switch users.
        users=True,
    )
    config_model = GvisorConfig
    # Each branch's restore reads the snapshot's image and writes only its
    # own directory, bundle and container: runsc restores them side by side.
    branches_concurrently = True

    def __init__(self, sandbox_id: str, workdir: str, sandbox_dir: str,
                 container: str | None = None) -> None:
        super().__init__(sandbox_id, workdir)
        self.sandbox_dir = sandbox_dir
        #: runsc's id of the sandbox's container: its own id at first, a new
        #: one at each restore (see :func:`checkpoints.restore`).
        self.container = container or sandbox_id
        #: The container this process checkpointed (stopped for good: ids
        #: are never reused), which runsc may still call running for a while
        #: (its sandbox process not yet reaped).
        self._checkpointed: str | None = None
        self._agent = AgentRuntime(
            sandbox_id, workdir, self.agent_socket, provider_name="gvisor",
            recover=self._recover_agent,
            # Paused by hutch: its processes (its own kernel's, not signalled
            # from here) are ended by the agent once it runs again.
            frozen=lambda: self._paused is True,
            # Another program on the host may have paused it (or resumed it)
            # since: a kill asks runsc, whose word is the truth.
            held_now=self._held_now,
        )
        # Its descriptors are the user-space kernel's, not the host's.
        self._agent.hands_over_fds = False
        # Its processes live through a suspend: one waiting (a server, a
        # REPL) lets the sandbox go idle; one working keeps it awake.
        self._agent.busy_means_running = True
        #: Whether hutch paused it (None: not known, runsc is asked).
        self._paused: bool | None = None

    @property
    def bundle_dir(self) -> str:
        return os.path.join(self.sandbox_dir, "bundle")

    @property
    def checkpoint_dir(self) -> str:
        return os.path.join(self.sandbox_dir, "checkpoint")

    @property
    def container_record(self) -> str:
        """The container id, written before each restore under a new one."""
        return os.path.join(self.sandbox_dir, "container")

    def _next_container(self) -> str:
        """A container id runsc has not seen for this sandbox: ``N+ID``.
        Not ``ID+N``: runsc takes a name it does not know as the prefix of
        one it does, and a call naming a gone container would reach the one
        that followed it (``+`` is in no sandbox id: no sandbox's ids are
        another's)."""
        serial, _, _ = self.container.partition("+")
        following = f"{int(serial) + 1 if serial.isdigit() else 1}+{self.sandbox_id}"
        checkpoints.write_text(self.container_record, following)
        return following

    @property
    def log_path(self) -> str:
        """runsc's output and the sandbox's own (its agent's)."""
        return os.path.join(self.sandbox_dir, "runsc.log")

    @property
    def pid_file(self) -> str:
        """The pid of the running container's sandbox process (runsc's
        ``--pid-file``), rewritten by each restore."""
        return os.path.join(self.sandbox_dir, "sandbox.pid")

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
            cgroups.hold(sandbox_id, sandbox.bundle_dir)
            runsc.start("run", "--bundle", sandbox.bundle_dir, "--pid-file", sandbox.pid_file,
                        sandbox_id, container=sandbox_id,
                        log_path=sandbox.log_path, what=f"starting sandbox {sandbox_id}",
                        ready=lambda: checkpoints.listening(sandbox.agent_socket))

        try:
            await anyio.to_thread.run_sync(provision)
            await sandbox._await_agent()
            sandbox._paused = False
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
            said = await anyio.to_thread.run_sync(
                lambda: deaths.death_reason(self.sandbox_dir, self.container))
            raise SandboxUnavailable(
                f"gvisor sandbox {self.sandbox_id} ended: {said}" if said else
                f"gvisor sandbox {self.sandbox_id}: its agent is gone ({reason}); "
                "the sandbox ended outside hutch"
            )
        if status == "paused":
            raise SandboxUnavailable(f"gvisor sandbox {self.sandbox_id} is paused")
        if status == "running" and not checkpoints.listening(self.agent_socket):
            # Let go for a checkpoint, or restored, by a hutch that died
            # before it asked the agent to listen again, or asked to let go
            # from inside (root there can signal it): it is asked now (its
            # processes were kept throughout).
            await self._wake_agent()
            await self._await_agent()
            return True
        return False

    async def _wake_agent(self) -> None:
        """The agent asked to listen again (a signal)."""
        await anyio.to_thread.run_sync(
            lambda: checkpoints.listen_again(self.container, self.agent_socket)
        )

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "sandbox_dir": self.sandbox_dir,
                "container": self.container}

    @classmethod
    async def reconnect(cls, sandbox_id: str, description: Mapping[str, Any]) -> GvisorSandbox:
        sandbox = cls(sandbox_id, str(description["workdir"]), str(description["sandbox_dir"]),
                      str(description.get("container") or sandbox_id))
        # The record wins: written before a restore the description may not
        # have been saved after (hutch died in between).
        recorded = await anyio.to_thread.run_sync(
            lambda: checkpoints.read_text(sandbox.container_record))
        if recorded:
            sandbox.container = recorded
        return sandbox

    # -- lifecycle --------------------------------------------------------------------
    async def _status(self) -> str | None:
        container = self.container
        if container == self._checkpointed:
            return "stopped"
        found = await anyio.to_thread.run_sync(lambda: runsc.state(container))
        return None if found is None else str(found.get("status", ""))

    def _known_status(self) -> str | None:
        """The container's status as hutch left it, without asking runsc
        (a process, some 20 ms): stopped once checkpointed here, running or
        paused as hutch made it; None where hutch does not know (found
        after a restart, a pause under way). One that died meanwhile is
        found by the runsc call that follows."""
        if self.container == self._checkpointed:
            return "stopped"
        if self._paused is None:
            return None
        return "paused" if self._paused else "running"

    async def _held_now(self) -> bool:
        """Whether runsc holds it paused now, whoever paused it."""
        return await self._status() == "paused"

    async def pause(self) -> None:
        self._agent.drop_connections()
        self._paused = None
        await runsc.run_async("pause", self.container, what=f"pausing {self.sandbox_id}")
        self._paused = True

    async def unpause(self) -> None:
        self._paused = None
        await runsc.run_async("resume", self.container, what=f"unpausing {self.sandbox_id}")
        self._paused = False

    async def suspend(self) -> None:
        if self._paused is not False and await self._status() == "paused":
            await self.unpause()  # the agent lets go of its socket first: it must run
        await self._checkpoint_into(self.checkpoint_dir, fault="suspend.gvisor.checkpointed")

    async def _checkpoint_into(self, directory: str, *, fault: str) -> None:
        """The running sandbox checkpointed into ``directory`` (and stopped);
        on a failure, running on with its agent awake."""
        # Asked on its socket (a runsc kill costs a process or two): where
        # it cannot answer, the checkpoint signals it instead.
        try:
            await self._agent.let_go()
            asked = True
        except (AgentFailure, OSError) as exc:
            log.debug("gvisor %s: the agent did not let go when asked: %s", self.sandbox_id, exc)
            asked = False
        container = self.container
        try:
            await anyio.to_thread.run_sync(
                lambda: checkpoints.checkpoint(
                    container, directory, self.agent_socket, fault=fault, asked=asked,
                    pid_file=self.pid_file,
                )
            )
            self._checkpointed = container
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self._wake_after_failure()
            raise

    async def _wake_after_failure(self) -> None:
        """A checkpoint that failed leaves the sandbox running with its agent
        let go: it listens again (when the sandbox is still there)."""
        if await self._status() != "running":
            return
        with contextlib.suppress(ProviderError):
            await self._wake_agent()
            await self._await_agent()

    async def resume(self) -> None:
        await self._restore_from(self.checkpoint_dir, fault="resume.gvisor.restored")
        await anyio.to_thread.run_sync(
            lambda: checkpoints.discard(self.checkpoint_dir)
        )

    async def _restore_from(
        self, directory: str, fault: str | None = None, *, first: bool = False
    ) -> None:
        """Running from a checkpoint, its agent answering. ``first``: the
        sandbox's first container (a branch's): none ran before it."""
        previous = None if first else self.container

        def restore() -> None:
            following = self._next_container()
            self.container = following
            checkpoints.restore(following, directory, self.bundle_dir, self.log_path,
                                self.agent_socket, pid_file=self.pid_file, previous=previous)

        await anyio.to_thread.run_sync(restore)
        if fault is not None:
            fault_point(fault)
        if checkpoints.listening(self.agent_socket):
            # Woken by its file: it listens (the pid file, removed before
            # the restore, is the restored agent's). Where its version is
            # known (a ping told it) no round trip is needed; a branch's
            # agent is pinged once (a runsc kill would cost a process).
            if self._agent.keeps_exec_connections:
                self._agent.drop_connections()
            else:
                await self._await_agent()
        else:
            # Not woken by its file (an agent of an older build, say): signalled.
            await self._wake_agent()
            await self._await_agent()
        self._paused = False

    # -- snapshots and fork -------------------------------------------------------------
    async def capture(self, snapshot_id: str, *, diff: bool = True) -> ProviderSnapshot:
        """The whole state, processes and memory too (``diff`` is moot: a
        checkpoint is always whole). A running or paused sandbox is
        checkpointed and restored from the same image (Debian's runsc's
        ``--leave-running`` is unreliable), and left as it was."""
        if not _SAFE_ID.match(snapshot_id):
            raise InvalidArgument(f"snapshot id {snapshot_id!r} cannot name a directory")
        target = os.path.join(snapshots_dir(), snapshot_id)
        image = os.path.join(target, "image")
        await anyio.to_thread.run_sync(lambda: _begin_snapshot(target, self.bundle_dir))
        try:
            status = self._known_status() or await self._status()
            if status in (None, "stopped") and checkpoints.held(self.checkpoint_dir):
                # Suspended: its checkpoint is the state, as it is.
                await anyio.to_thread.run_sync(
                    lambda: checkpoints.copy_image(self.checkpoint_dir, image)
                )
            else:
                await self._checkpoint_in_place(image, paused=status == "paused")
        except BaseException:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(lambda: shutil.rmtree(target, ignore_errors=True))
            raise
        size = await anyio.to_thread.run_sync(lambda: checkpoints.size_of(image))
        return ProviderSnapshot(
            snapshot_id=snapshot_id, provider=self.provider, size_bytes=size,
            data={"directory": target, "workdir": self.workdir}, includes_memory=True,
        )

    async def _checkpoint_in_place(self, image: str, *, paused: bool) -> None:
        if paused:
            await self.unpause()
        # Into the sandbox's own checkpoint first, then linked into the
        # snapshot: should hutch die before the origin runs again, its state
        # is where a suspended sandbox's is (found suspended, resumed), not
        # only in a snapshot that may never be recorded.
        await self._checkpoint_into(self.checkpoint_dir, fault="snapshot.gvisor.checkpointed")
        try:
            await anyio.to_thread.run_sync(
                lambda: checkpoints.copy_image(self.checkpoint_dir, image))
        finally:
            # The origin goes on from the state it was captured in.
            await self._restore_from(self.checkpoint_dir)
        await anyio.to_thread.run_sync(
            lambda: checkpoints.discard(self.checkpoint_dir))
        if paused:
            await self.pause()

    @classmethod
    async def create_from_snapshot(
        cls, config: GvisorConfig, sandbox_id: str, snapshot: ProviderSnapshot
    ) -> GvisorSandbox:
        """A restore of the snapshot's checkpoint under a bundle of its own
        (its own agent directory and cgroup; the root overlay, the working
        directory in it, is the checkpoint's copy, never shared): the same
        process tree, going on from where it was captured."""
        if not _SAFE_ID.match(sandbox_id):
            raise InvalidArgument(f"sandbox id {sandbox_id!r} cannot name a directory")
        source = str(snapshot.data.get("directory", ""))
        image = os.path.join(source, "image")
        if not checkpoints.held(image):
            raise NotFound(f"gvisor snapshot {snapshot.snapshot_id}'s checkpoint is gone")
        runsc.runsc_binary()
        sandbox_dir = os.path.join(sandboxes_dir(), sandbox_id)
        if os.path.exists(sandbox_dir):
            raise InvalidArgument(f"sandbox {sandbox_id} already exists")
        sandbox = cls(sandbox_id, str(snapshot.data.get("workdir") or config.workdir),
                      sandbox_dir)

        def provision() -> None:
            with open(os.path.join(source, "config.json")) as found:
                spec = bundle.for_branch(json.load(found), run_dir=sandbox.run_dir,
                                         sandbox_id=sandbox_id)
            os.makedirs(sandbox.run_dir, mode=0o700)
            os.chmod(sandbox.run_dir, 0o700)
            bundle.write(sandbox.bundle_dir, spec)

        try:
            await anyio.to_thread.run_sync(provision)
            await sandbox._restore_from(image, first=True)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(lambda: _discard(sandbox_id))
            raise
        return sandbox

    @classmethod
    async def remove_snapshot(cls, snapshot: ProviderSnapshot) -> None:
        if not _SAFE_ID.match(snapshot.snapshot_id):
            return
        target = os.path.join(snapshots_dir(), snapshot.snapshot_id)
        await anyio.to_thread.run_sync(lambda: shutil.rmtree(target, ignore_errors=True))

    @classmethod
    async def held_snapshots(cls) -> list[str]:
        def held() -> list[str]:
            try:
                names = os.listdir(snapshots_dir())
            except FileNotFoundError:
                return []
            return sorted(n for n in names if _SAFE_ID.match(n) and not n.endswith(".partial")
                          and checkpoints.held(os.path.join(snapshots_dir(), n, "image")))
        return await anyio.to_thread.run_sync(held)

    async def is_alive(self) -> bool:
        return await self._status() in ("running", "paused", "created")

    async def is_suspended(self) -> bool:
        if await self.is_alive():
            return False
        await anyio.to_thread.run_sync(
            lambda: checkpoints.settle(self.container, self.checkpoint_dir))
        return checkpoints.held(self.checkpoint_dir)

    async def observed_state(self) -> RuntimeState:
        """runsc's word, which this handle goes by from here: one found
        paused (after a restart, a takeover, another program's pause) is
        known held, its commands' kills left for the thaw, as one paused here."""
        status = await self._status()
        if status == "running":
            self._paused = False
            return RuntimeState.RUNNING
        if status == "paused":
            self._paused = True
            return RuntimeState.PAUSED
        await anyio.to_thread.run_sync(
            lambda: checkpoints.settle(self.container, self.checkpoint_dir))
        if checkpoints.held(self.checkpoint_dir):
            return RuntimeState.SUSPENDED
        return RuntimeState.GONE

    async def close(self) -> None:
        self._agent.drop_connections()
        await anyio.to_thread.run_sync(lambda: _discard(self.sandbox_id))

    async def release_runtime(self) -> None:
        self._agent.drop_connections()
        container = self.container
        await anyio.to_thread.run_sync(lambda: runsc.remove(container))

    # -- reconciliation ---------------------------------------------------------------
    @classmethod
    async def watch_runtimes(cls, report: RuntimeReport) -> None:
        """Sandboxes whose kernel died (:func:`.deaths.watch_runtimes`)."""
        await deaths.watch_runtimes(report)

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


def snapshots_dir() -> str:
    return os.path.join(runsc.gvisor_home(), "snapshots")


def _begin_snapshot(target: str, bundle_dir: str) -> None:
    """A snapshot's directory, holding the bundle its checkpoint restores
    under (a branch's is made from it)."""
    if os.path.exists(target):
        raise InvalidArgument(f"snapshot {os.path.basename(target)} already exists")
    os.makedirs(target)
    shutil.copy2(os.path.join(bundle_dir, "config.json"), os.path.join(target, "config.json"))


def _discard(sandbox_id: str) -> None:
    """The sandbox's containers (each restore's) and its directory gone
    (blocking, idempotent)."""
    with contextlib.suppress(InvalidArgument):
        for container in runsc.list_ids():
            if container == sandbox_id or container.endswith("+" + sandbox_id):
                runsc.remove(container)
    cgroups.release(sandbox_id)
    shutil.rmtree(os.path.join(sandboxes_dir(), sandbox_id), ignore_errors=True)
