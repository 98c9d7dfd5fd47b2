"""``docker``: one container per sandbox, kept alive by ``sleep infinity``,
its working directory bind-mounted from the host at the mount point.

Transport: the Engine's exec API over a hijacked socket (stdin written then
half-closed, output demultiplexed here) and its archive API for files. The
docker SDK is imported lazily, so importing this module (for its config
model) costs nothing when docker is not used.

Suspend commits the container's changes to an image and removes the
container: memory is freed, files survive (the working directory never left
the host), processes do not, and the capabilities say so.

:class:`DockerSandbox` ties the package's parts together (its mixins, one
module each: provisioning, process, files, snapshots) and keeps what spans
them: creation, reconnection, the lifecycle primitives and close.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from collections.abc import Mapping
from typing import Any

import anyio
import anyio.to_thread

from ..._errors import HutchError, ProviderError
from ..._faults import fault_point
from ..._paths import sandbox_workdir
from ..._types import Capabilities, ProviderSnapshot
from .. import layers
from .._diskcap import keep_growing
from .._docker_engine import ContainerGone, engine, engine_available
from .._docker_engine import call as _call
from ..base import RuntimeReport, RuntimeState
from .config import DockerConfig
from .disk import DiskMeter
from .files import DockerFiles
from .freeze import drop_start_locks, freeze_guard
from .labels import (
    SANDBOX_LABEL,
    SUSPENDED_REPOSITORY,
    list_managed_containers,
    snapshot_repository,
)
from .outside import kept_for_preserved_container
from .provisioning import configured_image, disk_cap
from .snapshots import SNAPSHOT_REMOVAL_TIMEOUT, DockerSnapshots, free_untagged_images
from .watch import watch_runtimes

log = logging.getLogger("hutch.docker")


class DockerSandbox(DockerSnapshots, DockerFiles):
    provider = "docker"
    capabilities = Capabilities(
        processes=True,
        pause=True,
        suspend=True,
        suspend_keeps_processes=False,
        snapshot=True,
        fork=True,
        resource_limits=True,
        disk_limit=True,
        network_policy=True,
        users=True,
        preview_url=True,
    )
    config_model = DockerConfig
    #: Its disk figure's measurer (made on first use).
    _disk: DiskMeter | None = None

    @classmethod
    def answers_here(cls) -> bool:
        try:
            return bool(engine().ping())
        except Exception:  # no engine, no socket, no permission: not here
            return False

    @classmethod
    async def create(cls, config: DockerConfig, sandbox_id: str) -> DockerSandbox:
        layered = False
        chain: list[str] | None = None
        if config.host_workdir:
            host_workdir, owns = os.path.abspath(config.host_workdir), False
            os.makedirs(host_workdir, exist_ok=True)
        elif await anyio.to_thread.run_sync(layers.overlay_available):
            # Layered from the start, so that its first snapshot moves the
            # tree instead of copying it.
            host_workdir, chain = await anyio.to_thread.run_sync(
                functools.partial(layers.prepare, sandbox_id, None, cap=disk_cap(config))
            )
            owns = layered = True
        else:
            host_workdir, owns = sandbox_workdir(sandbox_id), True
            os.makedirs(host_workdir, exist_ok=True)
        sandbox = cls(sandbox_id, config, host_workdir, owns, None, chain=chain, layered=layered)
        try:
            await sandbox._launch(configured_image(config))
        except BaseException:
            await anyio.to_thread.run_sync(sandbox._remove_agent_dir)
            await anyio.to_thread.run_sync(sandbox._remove_workdir)
            raise
        return sandbox

    def describe(self) -> dict[str, Any]:
        return {
            **super().describe(),
            "config": self.config.model_dump(),
            "host_workdir": self.host_workdir,
            "owns_workdir": self.owns_workdir,
            "container_id": self.container_id,
            "container_name": self.container_name,
            "suspended_image": self.suspended_image,
            "base_image": self.base_image,
            "branch": self.branch,
            "chain": self.chain,
            "layered": self.layered,
            "agent": (
                {"dir": self.agent_dir, "default_user": self.default_user}
                if self._agent is not None else None
            ),
        }

    @classmethod
    async def reconnect(cls, sandbox_id: str, description: Mapping[str, Any]) -> DockerSandbox:
        """Rebuild the backend of a sandbox made earlier (by a daemon now gone)."""
        sandbox = cls(
            sandbox_id,
            DockerConfig.model_validate(description["config"]),
            str(description["host_workdir"]),
            bool(description.get("owns_workdir", False)),
            description.get("container_id"),
            description.get("suspended_image"),
            description.get("agent"),
            description.get("base_image"),
            bool(description.get("branch")),
            description.get("chain"),
            bool(description.get("layered")),
        )
        # Its capped store, mounted by the daemon before, is given room as it fills.
        await anyio.to_thread.run_sync(keep_growing)
        try:
            await sandbox._find_again()
        except HutchError as exc:
            if isinstance(exc, ContainerGone) or await anyio.to_thread.run_sync(
                    engine_available):
                raise
            # The Engine does not answer (restarting, say): the record stands,
            # and observed_state says it cannot tell.
            log.warning("sandbox %s: found again as recorded; the Docker Engine does not "
                        "answer (%s)", sandbox_id, exc)
        return sandbox

    async def _find_again(self) -> None:
        """What a sandbox found again after a restart is on the Engine: its
        container (or one the record missed), its suspend image, and what a
        program that died in the middle of a step left (a capture, a freeze)."""
        sandbox, sandbox_id = self, self.sandbox_id
        if not await sandbox.is_alive():
            # The container on record is gone (or none is), but the sandbox
            # may have one under its name that the record missed (a suspend
            # undone because the store could not keep it, a resume cut short
            # after its container started)...
            try:
                details = await _call(engine().inspect_container, sandbox.container_name)
            except ContainerGone:
                details = None
            labels = ((details or {}).get("Config") or {}).get("Labels") or {}
            state = (details or {}).get("State") or {}
            up = bool(state.get("Running") or state.get("Paused"))
            if details is not None and labels.get(SANDBOX_LABEL) == sandbox_id and (
                up or sandbox.container_id is not None
            ):
                sandbox.container_id = str(details["Id"])
            elif sandbox.container_id is not None:
                # ... or none, and its state in its suspend image (suspended
                # by a program whose suspend the record missed).
                suspended = await sandbox._own_suspend_image()
                if suspended is not None:
                    sandbox.container_id = None
                    sandbox.suspended_image = suspended
        if sandbox.layered:
            await sandbox._mend_capture_cut_short()
        if sandbox.container_id is not None and await sandbox._container_exists():
            # A freeze of hutch's own (a commit, a capture) that its program
            # died inside is undone: the container was never the user's to pause.
            await _call(freeze_guard(sandbox.container_id).thaw_left_freeze, engine(),
                        sandbox.container_id)

    async def observed_state(self) -> RuntimeState:
        """The container's own state: paused, running, or gone (stopped or
        removed), or suspended in its suspend image."""
        if self.container_id is not None:
            try:
                details = await _call(engine().inspect_container, self.container_id)
            except ContainerGone:
                details = None  # no such container
            if details is not None:
                state = details.get("State") or {}
                if state.get("Paused"):
                    return RuntimeState.PAUSED
                return RuntimeState.RUNNING if state.get("Running") else RuntimeState.GONE
        if await self.is_suspended():
            return RuntimeState.SUSPENDED
        return RuntimeState.GONE

    async def _own_suspend_image(self) -> str | None:
        """The id of this sandbox's suspend image, if the engine has one."""
        try:
            details = await _call(
                engine().inspect_image, f"{SUSPENDED_REPOSITORY}:{self.sandbox_id}"
            )
        except HutchError:
            return None
        labels = (details.get("Config") or {}).get("Labels") or {}
        return str(details["Id"]) if labels.get(SANDBOX_LABEL) == self.sandbox_id else None

    async def is_suspended(self) -> bool:
        return (
            self.container_id is None and self.suspended_image is not None
            and await self._own_suspend_image() == self.suspended_image
        )

    async def preview_url(self, port: int) -> str:
        details = await _call(engine().inspect_container, self._container())
        networks = details["NetworkSettings"].get("Networks") or {}
        for network in networks.values():
            if network.get("IPAddress"):
                return f"http://{network['IPAddress']}:{port}"
        raise ProviderError(f"sandbox {self.sandbox_id} has no IP address (network_mode none?)")

    # -- lifecycle primitives ---------------------------------------------------------
    async def pause(self) -> None:
        container = self._container()
        await _call(freeze_guard(container).pause, engine(), container)

    async def unpause(self) -> None:
        container = self._container()
        await _call(freeze_guard(container).unpause, engine(), container)

    async def resume(self) -> None:
        if self.container_id is not None:
            return
        image = self.suspended_image or configured_image(self.config)
        await self._start_container(image)
        fault_point("resume.docker.started")

    async def memory_bytes(self) -> int | None:
        if self.container_id is None:
            return 0  # suspended: nothing in memory
        # cgroup v1 with the cgroupfs driver: a file read, not a stats call.
        for path in (
            f"/sys/fs/cgroup/memory/docker/{self.container_id}/memory.usage_in_bytes",
            f"/sys/fs/cgroup/system.slice/docker-{self.container_id}.scope/memory.current",
            f"/sys/fs/cgroup/docker/{self.container_id}/memory.current",
        ):
            try:
                with open(path) as fh:  # noqa: ASYNC230 - a cgroup file, microseconds
                    return int(fh.read().strip())
            except (OSError, ValueError):
                continue
        return None

    async def disk_bytes(self) -> int | None:
        if self._disk is None:
            self._disk = DiskMeter()
        own = ([layers.upper_dir(self.sandbox_id)] if self.layered
               else [self.host_workdir] if self.owns_workdir else [])
        # The image it runs from: a suspend's commit, over the one it started from.
        return await self._disk.measure(
            self.container_id, self.suspended_image, self.base_image, own)

    async def is_alive(self) -> bool:
        if self.container_id is None:
            return False
        try:
            details = await _call(engine().inspect_container, self.container_id)
        except ContainerGone:
            return False  # no such container
        state = details.get("State", {})
        return bool(state.get("Running") or state.get("Paused"))

    @classmethod
    async def create_from_snapshot(
        cls, config: DockerConfig, sandbox_id: str, snapshot: ProviderSnapshot
    ) -> DockerSandbox:
        image = str(snapshot.data.get("image") or f"{snapshot_repository()}:"
                    f"{snapshot.snapshot_id}")
        # Its own working directory always: a branch never shares the origin's.
        # Layered where overlayfs mounts; a copy of the snapshot's where not.
        layered = await anyio.to_thread.run_sync(layers.overlay_available)
        start = (
            functools.partial(layers.prepare, cap=disk_cap(config)) if layered
            else functools.partial(layers.start_branch, cap=disk_cap(config))
        )
        workdir, chain = await anyio.to_thread.run_sync(start, sandbox_id, snapshot.snapshot_id)
        config = config.model_copy(update={"host_workdir": None})
        sandbox = cls(sandbox_id, config, workdir, True, None, base_image=image,
                      branch=True, chain=chain, layered=layered)
        try:
            await sandbox._launch(image)
        except BaseException:
            await anyio.to_thread.run_sync(sandbox._remove_agent_dir)
            await anyio.to_thread.run_sync(layers.end_branch, sandbox_id)
            raise
        return sandbox

    @classmethod
    async def watch_runtimes(cls, report: RuntimeReport) -> None:
        """Docker's event stream (:func:`.watch.watch_runtimes`)."""
        await watch_runtimes(report)

    async def release_runtime(self) -> None:
        """Its container is gone (or dead): connections to it dropped, the
        record of it too if it is gone. The working directory stays, and is
        readable on the host whatever state the sandbox failed in (a layered
        one at rest, a suspended sandbox's, is mounted again), and a dead
        container that is still there stays too, until :meth:`close` frees both."""
        if self._agent is not None:
            self._agent.drop_connections()
        if self.container_id is None:
            if self.layered:
                try:
                    await anyio.to_thread.run_sync(layers.after_start, self.sandbox_id)
                except (OSError, HutchError) as exc:  # kept at rest: its files are still there
                    log.warning("sandbox %s: its working directory stays at rest: %s",
                                self.sandbox_id, exc)
            return
        try:
            state = (await _call(engine().inspect_container, self.container_id))["State"]
        except ContainerGone:
            state = {"Dead": True}  # no such container
        if state.get("Dead") or state.get("Status") == "removing":
            # Gone, or going (``docker rm -f``): nothing of it to keep or commit.
            drop_start_locks(self.container_id)
            self.container_id = None

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        api = engine()
        if self.config.preserve and (
            self.container_id is not None or self.suspended_image is not None
        ):  # (one whose container is gone has nothing left to keep)
            # Said loudly: the user asked to keep it and needs to know how to reach it.
            if self.container_id is not None:
                kept_for_preserved_container(self.sandbox_id)
                log.warning(
                    "sandbox %s kept (preserve): docker exec -it %s bash",
                    self.sandbox_id, self.container_name,
                )
            elif self.suspended_image is not None:
                if self.layered:  # at rest while suspended: mounted again, to be bound
                    await anyio.to_thread.run_sync(layers.after_start, self.sandbox_id)
                log.warning(
                    "sandbox %s kept suspended (preserve): docker run -it --rm -v %s:%s %s bash",
                    self.sandbox_id, self.host_workdir, self.config.mount_point,
                    f"{SUSPENDED_REPOSITORY}:{self.sandbox_id}",
                )
            return
        if self.container_id is not None:
            with contextlib.suppress(HutchError):
                await _call(api.remove_container, self.container_id, force=True, v=True)
                drop_start_locks(self.container_id)
            self.container_id = None
            await anyio.to_thread.run_sync(self._release_network_policy)
        # Its suspend image goes with it, whether or not the record names one:
        # a suspend undone after its commit (the store could not keep it) runs
        # on from that image while the record still says the container before.
        # By its tag, not by id: a snapshot of the suspended sandbox may name
        # the same image, and keeps it.
        with contextlib.suppress(HutchError):
            await _call(api.remove_image, f"{SUSPENDED_REPOSITORY}:{self.sandbox_id}")
        self.suspended_image = None
        if self.branch or self.base_image.startswith(snapshot_repository()):
            # It ran on a snapshot's image, which may have been removed
            # (untagged) while it ran: now nothing stands on it.
            with anyio.move_on_after(SNAPSHOT_REMOVAL_TIMEOUT), contextlib.suppress(HutchError):
                await _call(free_untagged_images, api)
        if self._agent is not None:
            self._agent.drop_connections()
        await anyio.to_thread.run_sync(self._remove_agent_dir)
        await anyio.to_thread.run_sync(self._remove_workdir)


__all__ = ["DockerConfig", "DockerSandbox", "list_managed_containers"]
