"""A docker sandbox's container: the state a sandbox keeps, its image, its
spec (binds, limits, labels), creating, starting and removing it, and the agent
that runs in it as its keeper (:class:`DockerProvisioning`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import time
from collections.abc import Mapping
from typing import Any

import anyio
import anyio.to_thread

from ..._errors import HutchError, InvalidArgument, NotFound, ProviderError, SandboxUnavailable
from ..._paths import hutch_home
from .. import layers
from .._diskcap import image_for, mount_capped_workdir, unmount_capped
from .._docker_engine import call as _call
from .._docker_engine import engine
from .._docker_engine import explanation as _explanation
from .._docker_engine import status_of as _status
from .._hostproc import SANDBOX_MARKER
from ..agent import AgentFailure, AgentRuntime, AgentUnavailable, agent_binary
from ..agent import workload as _workload
from ..base import NativeBackend, RuntimeLost, RuntimeNotice, RuntimeReport, SandboxRuntime
from ..policy import parse_bytes
from . import netguard
from .cgroups import cgroup_dir, frozen
from .config import DockerConfig
from .freeze import FreezeGuard, freeze_guard
from .labels import HOME_LABEL, MANAGED_LABEL, PRESERVE_LABEL, SANDBOX_LABEL, SUSPENDED_REPOSITORY
from .watch import TELLING, WATCHERS, death_reason, suspended_state_removed

log = logging.getLogger("hutch.docker")


#: Where the agent's executable and its socket's directory are mounted.
AGENT_BINARY_PATH = "/.hutch/bin/hutch-agent"
AGENT_DIR_PATH = "/.hutch/run"
AGENT_SOCKET_NAME = "agent.sock"
#: How long a fresh container's agent has to answer (a loaded engine is slow
#: to start containers), and a restarted one's after a failure.
AGENT_START_TIMEOUT = 15.0
AGENT_RECOVER_TIMEOUT = 4.0


def configured_image(config: DockerConfig) -> str:
    """The Docker image ``config.image`` names: this home's hutch image of that
    name (its tag is scoped to the home), else Docker's own."""
    from ..images import docker_reference

    return docker_reference(config.image)


def _pull(api: Any, image: str) -> None:
    """Pull ``image``. The engine reports some failures inside a 200 stream,
    so the stream is read to its end and its errors raised."""
    import docker.errors

    failure = ""
    try:
        for event in api.pull(image, stream=True, decode=True):
            if isinstance(event, dict) and event.get("error"):
                failure = str(event["error"])
    except docker.errors.APIError as exc:
        failure = _explanation(exc)
    if failure:
        raise NotFound(
            f"image {image!r} is not on this Docker Engine and pulling it failed: {failure}"
        )


def _image_user(image: str, pull: bool) -> str:
    """The user an image's commands run as (its USER), pulling it if asked."""
    import docker.errors

    api = engine()
    try:
        details = api.inspect_image(image)
    except docker.errors.ImageNotFound:
        if not pull:
            raise NotFound(f"image {image!r} is not on this Docker Engine") from None
        _pull(api, image)
        details = api.inspect_image(image)
    return str((details.get("Config") or {}).get("User") or "")


def _own_network_namespace(network_mode: str) -> bool:
    """Whether a container in ``network_mode`` has a namespace of its own to police
    (not the host's, not another container's, not none)."""
    return network_mode not in ("host", "none") and not network_mode.startswith("container:")


def disk_cap(config: DockerConfig) -> int | None:
    return int(parse_bytes(config.disk)) if config.disk is not None else None


def _parse_mount(spec: str) -> tuple[str, dict[str, str]]:
    parts = spec.split(":")
    if len(parts) not in (2, 3) or not parts[0] or not parts[1]:
        raise InvalidArgument(f"mount {spec!r} is not host:container[:ro]")
    mode = parts[2] if len(parts) == 3 else "rw"
    if mode not in ("ro", "rw"):
        raise InvalidArgument(f"mount {spec!r}: mode must be ro or rw")
    return os.path.abspath(parts[0]), {"bind": parts[1], "mode": mode}


class DockerProvisioning(NativeBackend):
    """The container and its runtime, beneath what a docker sandbox does with them."""

    #: Its runtime is found again from its description by any daemon that
    #: reaches the same Docker Engine (a fleet's takes it over when its daemon dies).
    reachable_from_any_host = True

    def __init__(
        self,
        sandbox_id: str,
        config: DockerConfig,
        host_workdir: str,
        owns_workdir: bool,
        container_id: str | None,
        suspended_image: str | None = None,
        agent: Mapping[str, Any] | None = None,
        base_image: str | None = None,
        branch: bool = False,
        chain: list[str] | None = None,
        layered: bool = False,
    ) -> None:
        super().__init__(sandbox_id, config.mount_point)
        self.config = config
        self.host_workdir = host_workdir
        self.owns_workdir = owns_workdir
        self.container_id = container_id
        #: The container's freeze guard, held so that it keeps what it knows
        #: (whose pause the container's is) between calls.
        self._freeze_guard: FreezeGuard | None = None
        self.container_name = f"hutch-{sandbox_id}"
        self.suspended_image = suspended_image
        #: The image the container started from: the configured one, or a snapshot's.
        self.base_image = base_image or configured_image(config)
        #: Started from a snapshot: the working directory is a branch mounted
        #: on ``chain`` (see ``layers``), never shared with another sandbox.
        self.branch = branch
        self.chain = chain
        #: The working directory is layered (``layers.prepare``): the
        #: container binds its anchor, its overlay reaches it by propagation,
        #: and a snapshot moves what changed instead of copying it.
        self.layered = layered
        self._closed = False
        #: The agent's host directory (its socket) and the image's own user,
        #: when the agent is this sandbox's runtime; None for the native one.
        self.agent_dir: str | None = None
        self.default_user = ""
        self._agent: AgentRuntime | None = None
        self._agent_binary: str | None = None
        self._recovering: asyncio.Lock | None = None  # made on first use, on its loop
        if agent is not None:
            self._use_agent(str(agent["dir"]), str(agent.get("default_user") or ""))

    # -- the agent -------------------------------------------------------------------
    def _use_agent(self, agent_dir: str, default_user: str) -> None:
        self.agent_dir = agent_dir
        self.default_user = default_user
        self._agent = AgentRuntime(
            self.sandbox_id, self.workdir, self._agent_link(),
            provider_name=self.provider, recover=self._recover_agent,
            default_user=default_user or None, on_oom=self._workload_oom,
            # Its cgroup read here (the engine local): only root reads its
            # processes' environments, to find a command's.
            frozen=self._container_frozen, signals_here=os.geteuid() == 0,
            cgroup=self._container_cgroup,
        )

    def _container_frozen(self) -> bool:
        container = self.container_id
        return container is not None and frozen(container)

    def _container_cgroup(self) -> str | None:
        container = self.container_id
        return None if container is None else cgroup_dir(container, "pids")

    def _agent_link(self) -> str:
        """Where hutch reaches the agent's socket: a hard link made in a host
        directory the sandbox cannot reach, while only the agent ran in it, so
        that a socket the sandbox later plants in its own directory leads
        nowhere."""
        assert self.agent_dir is not None
        return os.path.join(os.path.dirname(self.agent_dir), "agent-link", AGENT_SOCKET_NAME)

    def _relink_agent(self) -> None:
        assert self.agent_dir is not None
        link = self._agent_link()
        os.makedirs(os.path.dirname(link), mode=0o700, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(link)
        with contextlib.suppress(FileNotFoundError):
            os.link(os.path.join(self.agent_dir, AGENT_SOCKET_NAME), link)

    @property
    def runtime(self) -> SandboxRuntime:
        return self._agent if self._agent is not None else self

    def _agent_wanted(self) -> str | None:
        """The agent executable to run as the keeper, or None for the native runtime."""
        if self.config.runtime == "native":
            return None
        try:
            return str(agent_binary())
        except AgentUnavailable as exc:
            if self.config.runtime == "agent":
                raise
            log.warning("docker sandbox %s: native runtime (%s)", self.sandbox_id, exc)
            return None

    def _workload_oom(self) -> None:
        """The OOM killer ended a command in the workload's cgroup: Docker's
        events do not say so (cgroup v1 tells the cgroup it happened in, not
        the container's), so it is told to the watchers here."""
        limit = parse_bytes(self.config.memory) if self.config.memory is not None else 0
        within = f" of {int(limit)} bytes" if limit else ""
        notice = RuntimeNotice(
            self.sandbox_id,
            f"the OOM killer killed a process in it: it reached its memory limit{within}",
            may_have_died=False,
        )
        for loop, report in list(WATCHERS):
            def tell(report: RuntimeReport = report) -> None:
                task = asyncio.ensure_future(report(notice))
                TELLING.add(task)
                task.add_done_callback(TELLING.discard)

            with contextlib.suppress(RuntimeError):  # that loop is closed
                loop.call_soon_threadsafe(tell)

    def _split_workload(self) -> bool:
        """Whether what the agent runs gets a cgroup of its own below the
        container's (see :mod:`.agent.workload`): with the agent, on cgroup v1."""
        return self._agent is not None and _workload.splittable()

    async def _place_workload(self) -> None:
        """Make the workload's cgroups below the just-started container's,
        with the caller's limits, and have the agent start commands in them."""
        assert self._agent is not None and self.container_id is not None
        container_id = self.container_id
        cfg = self.config

        def make() -> dict[str, str]:
            dirs = {c: cgroup_dir(container_id, c) for c in _workload.CONTROLLERS}
            found = {c: d for c, d in dirs.items() if d is not None}
            if len(found) != len(dirs):
                raise ProviderError(f"docker sandbox {self.sandbox_id}: the cgroups of "
                                    f"container {container_id[:12]} are not where expected")
            return _workload.make_workload(
                found, pids=cfg.pids_limit,
                memory=int(parse_bytes(cfg.memory)) if cfg.memory is not None else None,
            )

        await self._agent.place_workload(await anyio.to_thread.run_sync(make))

    async def _await_agent(self, timeout: float = AGENT_START_TIMEOUT) -> None:
        """Until the agent in a just-started container answers (nothing else
        runs in it yet: this is when hutch's link to its socket is made, and
        the workload's cgroup)."""
        assert self._agent is not None
        deadline = time.monotonic() + timeout
        while True:
            try:
                self._relink_agent()
                await self._agent.ping(timeout=max(0.5, deadline - time.monotonic()))
                if self._split_workload():
                    await self._place_workload()
                return
            except AgentFailure as exc:
                if time.monotonic() >= deadline:
                    raise ProviderError(
                        f"docker sandbox {self.sandbox_id}: its agent did not start: {exc}"
                    ) from None
            await asyncio.sleep(0.005)

    async def _start_container(self, image: str) -> None:
        """Run the container; with the agent, wait for it to answer, and where
        it cannot run in this image fall back to the native runtime."""
        self.container_id = await self._run_container(image)
        if self._agent is None:
            return
        self._agent.drop_connections()
        try:
            await self._await_agent()
        except ProviderError as exc:
            with contextlib.suppress(HutchError):
                await _call(engine().remove_container, self.container_id, force=True)
            self.container_id = None
            if self.config.runtime == "agent":
                raise
            log.warning("docker sandbox %s: %s; falling back to the native runtime",
                        self.sandbox_id, exc)
            self._agent = None
            await anyio.to_thread.run_sync(self._remove_agent_dir)
            self.container_id = await self._run_container(image)

    async def _recover_agent(self, reason: str) -> bool:
        """The agent failed a request (``reason``): find out why and bring it
        back, within a few seconds, or raise what makes the sandbox lost.

        A paused container's agent is frozen, not dead: nothing to do. A
        running container whose agent does not answer a ping is restarted; a
        stopped one (its keeper was killed) is started again, unless the OOM
        killer stopped it (then the sandbox is lost, and fails). Files survive
        both; processes do not, and the caller's error says so.
        """
        if self._recovering is None:
            self._recovering = asyncio.Lock()
        async with self._recovering:
            container = self._container()
            assert self._agent is not None

            async def state_now() -> dict[str, Any]:
                try:
                    details = await _call(engine().inspect_container, container)
                except HutchError as exc:
                    raise SandboxUnavailable(
                        f"docker sandbox {self.sandbox_id}: its agent failed ({reason}) and "
                        f"its container is gone: {exc}"
                    ) from None
                return dict(details.get("State") or {})

            state = await state_now()
            if state.get("Paused"):
                raise SandboxUnavailable(f"docker sandbox {self.sandbox_id} is paused")
            if state.get("Running"):
                with contextlib.suppress(AgentFailure):
                    await self._agent.ping(timeout=0.5)
                    return False  # it answers: the failure was the request's
                # A keeper that died takes its container down within moments
                # (its init exits): not wedged, gone, and told apart below.
                for _ in range(10):
                    await asyncio.sleep(0.1)
                    state = await state_now()
                    if not state.get("Running"):
                        break
            if state.get("Running"):
                log.warning("docker sandbox %s: its agent is wedged (%s); restarting it",
                            self.sandbox_id, reason)
                action: Any = lambda: engine().restart(container, timeout=0)  # noqa: E731
            elif state.get("OOMKilled"):
                # The OOM killer ended its keeper: the runtime died, and saying
                # so (the sandbox fails) is the truth; a restart would hide it.
                raise SandboxUnavailable(
                    f"docker sandbox {self.sandbox_id}: "
                    f"{await death_reason(container, 'die')}"
                )
            else:
                log.warning("docker sandbox %s: its agent is gone (%s, exit code %s); "
                            "starting its container again", self.sandbox_id, reason,
                            state.get("ExitCode"))
                action = lambda: engine().start(container)  # noqa: E731
            try:
                await _call(action)
                await self._await_agent(AGENT_RECOVER_TIMEOUT)
            except HutchError as exc:
                raise SandboxUnavailable(
                    f"docker sandbox {self.sandbox_id}: its agent failed ({reason}) and could "
                    f"not be brought back: {exc}"
                ) from None
            return True

    # -- provisioning -------------------------------------------------------------

    async def _launch(self, image: str) -> None:
        """Start this new sandbox's container from ``image``, its runtime with it."""
        binary = self._agent_wanted()
        if binary is not None:
            self._agent_binary = binary
            # The image first: a create that fails on it leaves no directory.
            default_user = await _call(_image_user, image, self.config.pull_if_missing)
            agent_dir = os.path.join(hutch_home(), "sandboxes", self.sandbox_id, "agent")
            os.makedirs(agent_dir, mode=0o700, exist_ok=True)
            self._use_agent(agent_dir, default_user)
        await self._start_container(image)

    def _container_spec(self, image: str) -> dict[str, Any]:
        api = engine()
        cfg = self.config
        # A layered working directory's anchor is bound as a slave, so that
        # the overlay mounted on it (and unmounted) reaches the container.
        mode = "rw,rslave" if self.layered else "rw"
        binds = {self.host_workdir: {"bind": cfg.mount_point, "mode": mode}}
        binds.update(dict(_parse_mount(m) for m in cfg.mounts))
        command = ["sleep", "infinity"]
        extra: dict[str, Any] = {}
        if self._agent is not None and self.agent_dir is not None:
            # The agent is the keeper, as root (it runs commands as the image's
            # user, or the one asked for), bind-mounted read-only; its socket
            # is in a host directory of its own, so no network is needed.
            binary = self._agent_binary or str(agent_binary())
            self._agent_binary = binary
            binds[binary] = {"bind": AGENT_BINARY_PATH, "mode": "ro"}
            binds[self.agent_dir] = {"bind": AGENT_DIR_PATH, "mode": "rw"}
            command = [AGENT_BINARY_PATH, "serve", f"{AGENT_DIR_PATH}/{AGENT_SOCKET_NAME}"]
            extra["user"] = "0"
        mem_limit: int | str | None = cfg.memory
        pids_limit = cfg.pids_limit
        if self._split_workload():
            # The caller's limits hold the workload's cgroup (made once the
            # agent answers); the container's leave the agent a reserve.
            pids_limit += _workload.PIDS_RESERVE
            if cfg.memory is not None:
                mem_limit = int(parse_bytes(cfg.memory)) + _workload.MEMORY_RESERVE
        host_config = api.create_host_config(
            binds=binds,
            network_mode="none" if cfg.network == "none" else cfg.network_mode,
            mem_limit=mem_limit,
            nano_cpus=int(cfg.cpus * 1e9) if cfg.cpus else None,
            pids_limit=pids_limit,
            init=cfg.init,
            security_opt=["no-new-privileges"] if cfg.no_new_privileges else [],
            cap_drop=cfg.cap_drop,
        )
        labels = {**cfg.labels, MANAGED_LABEL: "1", SANDBOX_LABEL: self.sandbox_id,
                  HOME_LABEL: hutch_home()}
        if cfg.preserve:
            labels[PRESERVE_LABEL] = "1"
        return {
            **extra,
            "image": image,
            "command": command,
            "entrypoint": [],
            "name": self.container_name,
            "labels": labels,
            "environment": {**cfg.env, SANDBOX_MARKER: self.sandbox_id},
            "working_dir": cfg.mount_point,
            "host_config": host_config,
            "detach": True,
        }

    async def _run_container(self, image: str) -> str:
        """Create and start this sandbox's container from ``image``: two API
        calls on the happy path, as the raw SDK would make."""
        import docker.errors

        api = engine()
        cfg = self.config

        def create(spec: dict[str, Any]) -> str:
            try:
                return str(api.create_container(**spec)["Id"])
            except docker.errors.ImageNotFound:
                if image == self.suspended_image:
                    # Its state, which no registry has: never a pull.
                    raise RuntimeLost(
                        suspended_state_removed(image, self.sandbox_id)
                    ) from None
                if not cfg.pull_if_missing or image.startswith(SUSPENDED_REPOSITORY):
                    raise NotFound(f"image {image!r} is not on this Docker Engine") from None
                _pull(api, image)
                return str(api.create_container(**spec)["Id"])
            except docker.errors.APIError as exc:
                if _status(exc) != 409 or not self._remove_stale_namesake():
                    raise
                return str(api.create_container(**spec)["Id"])

        def run() -> str:
            self._cap_workdir()
            if self.layered:
                layers.before_start(self.sandbox_id)
            container = create(self._container_spec(image))
            try:
                api.start(container)
                if self.layered:
                    layers.after_start(self.sandbox_id)
                self._enforce_network_policy(api, container)
            except BaseException:
                api.remove_container(container, force=True)
                self._release_network_policy()
                raise
            return container

        result: str = await _call(run)
        return result

    def _cap_workdir(self) -> None:
        """Mount the working directory hutch made at its size cap, if it has one
        (again after a reboot: its image keeps the files). A layered one's
        store is ``layers``'; a branch copied where overlayfs cannot be
        mounted was capped as it was copied (``layers.start_branch``), one
        copied before branches were has no image and stays as it is."""
        if self.config.disk is None or not self.owns_workdir or self.layered:
            return
        if self.branch and not os.path.exists(image_for(self.host_workdir)):
            return
        try:
            mount_capped_workdir(self.host_workdir, int(parse_bytes(self.config.disk)))
        except OSError as exc:
            raise ProviderError(
                f"cannot cap the working directory of sandbox {self.sandbox_id} at "
                f"{self.config.disk} (a loop mount, which needs root): {exc}"
            ) from None

    def _polices_network(self) -> bool:
        """Whether hutch enforces a policy on this sandbox's network: it has one,
        in a namespace of its own (another is the operator's choice)."""
        cfg = self.config
        return cfg.network != "none" and _own_network_namespace(cfg.network_mode)

    def _enforce_network_policy(self, api: Any, container: str) -> None:
        """Install the sandbox's network policy in its container's namespace and
        on the host, from the host: the sandbox (no CAP_NET_ADMIN) cannot change it."""
        if self._polices_network():
            netguard.enforce(api, container, self.sandbox_id, self.config.network)

    def _release_network_policy(self) -> None:
        """Remove the host's rules of a container gone: its address goes to
        another container. Said, not raised: the container is gone already."""
        if not self._polices_network():
            return
        try:
            netguard.release(self.sandbox_id)
        except ProviderError as exc:
            log.warning("docker sandbox %s: %s", self.sandbox_id, exc)

    def _remove_stale_namesake(self) -> bool:
        """Remove a container left under this sandbox's name (a crash between
        a resume's create and its record); never one that is not ours."""
        import docker.errors

        api = engine()
        try:
            labels = api.inspect_container(self.container_name)["Config"]["Labels"] or {}
        except docker.errors.NotFound:
            return True  # gone meanwhile: the retry will tell
        if labels.get(SANDBOX_LABEL) != self.sandbox_id:
            return False
        api.remove_container(self.container_name, force=True)
        return True

    def _container(self) -> str:
        if self.container_id is None:
            raise SandboxUnavailable(f"docker sandbox {self.sandbox_id} has no container")
        self._freeze_guard = freeze_guard(self.container_id)
        return self.container_id

    def _remove_agent_dir(self) -> None:
        """Free the agent's directory (and the sandbox's own, if now empty)."""
        agent_dir, self.agent_dir = self.agent_dir, None
        if agent_dir is None:
            return
        shutil.rmtree(agent_dir, ignore_errors=True)
        shutil.rmtree(os.path.join(os.path.dirname(agent_dir), "agent-link"), ignore_errors=True)
        with contextlib.suppress(OSError):
            os.rmdir(os.path.dirname(agent_dir))  # the sandbox's own, if now empty

    def _remove_workdir(self) -> None:
        """Free the working directory hutch made (a layered one, a branch's,
        or a plain one); a given one is the caller's and stays."""
        if self.branch or self.layered:
            layers.end_branch(self.sandbox_id)
            return
        if not self.owns_workdir:
            return
        with contextlib.suppress(OSError):
            unmount_capped(self.host_workdir)  # first: rmtree would empty the mount, not end it
        shutil.rmtree(os.path.dirname(self.host_workdir), ignore_errors=True)
