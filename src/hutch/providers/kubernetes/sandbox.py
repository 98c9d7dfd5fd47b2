"""``kubernetes``: one Pod per sandbox, reached through the API server.

hutch's agent is the pod's keeper and serves exec, files, grep, glob and
processes on one kept ``pods/exec`` (:mod:`.agentpod`); with
``runtime = "native"`` (or no agent built here) each command is a
``pods/exec`` of its own and files go through commands (:mod:`.execruntime`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from typing import Any

from lightkube import ApiError
from lightkube.resources.core_v1 import Pod

from ..._errors import ProviderError, SandboxUnavailable
from ..._types import Capabilities
from ..agent import AgentUnavailable, agent_binary
from ..base import RuntimeState, SandboxBackend, SandboxRuntime
from .agentpod import PodAgent, keeper_command
from .api import Cluster, pod_name
from .config import KubernetesConfig
from .execruntime import PodExecRuntime
from .podspec import sandbox_pod

log = logging.getLogger("hutch.kubernetes")
#: The keeper without the agent: it waits, commands come through exec.
_PLAIN_KEEPER = ["sh", "-c", "trap 'exit 0' TERM; while :; do sleep 3600 & wait; done"]


def _wants_agent(config: KubernetesConfig) -> bool:
    if config.runtime == "native":
        return False
    try:
        agent_binary()
    except AgentUnavailable as exc:
        if config.runtime == "agent":
            raise
        log.warning("kubernetes: a pods/exec per command (%s)", exc)
        return False
    return True


class KubernetesSandbox(SandboxBackend):
    provider = "kubernetes"
    capabilities = Capabilities(processes=True, users=True)
    config_model = KubernetesConfig

    def __init__(self, sandbox_id: str, config: KubernetesConfig, cluster: Cluster,
                 name: str, uid: str | None, *, agent: bool) -> None:
        super().__init__(sandbox_id, config.workdir)
        self.config = config
        self.cluster = cluster
        self.pod = name
        self.uid = uid
        self.pod_exec = PodExecRuntime(sandbox_id, config.workdir, cluster, name)
        #: The agent in the pod, when it serves the sandbox.
        self.agent = (PodAgent(sandbox_id, config.workdir, self.pod_exec, self._still_running)
                      if agent else None)

    @property
    def runtime(self) -> SandboxRuntime:
        return self.agent.runtime if self.agent is not None else self.pod_exec

    async def _still_running(self, reason: str) -> None:
        """Returns while the pod runs; else the sandbox is lost, and says why."""
        phase, _, _ = await self._phase()
        if phase != "Running":
            raise SandboxUnavailable(
                f"kubernetes sandbox {self.sandbox_id}: its pod {self.pod} is {phase} "
                f"({reason})")

    # -- provisioning -------------------------------------------------------------------
    @classmethod
    async def create(cls, config: KubernetesConfig, sandbox_id: str) -> KubernetesSandbox:
        cluster = Cluster(config)
        name = pod_name(sandbox_id)
        agent = await asyncio.to_thread(_wants_agent, config)
        pod = sandbox_pod(config, sandbox_id, name,
                          keeper_command() if agent else _PLAIN_KEEPER)
        try:
            made = await cluster.client.create(pod)
        except ApiError as exc:
            await cluster.close()
            raise ProviderError(f"creating pod {name} failed: {exc.status.message}") from exc
        except BaseException:
            # The server may have made it (the answer was lost or unreadable):
            # the name is this sandbox's alone, so it goes.
            try:
                await cluster.delete_pod(name, None)
            finally:
                await cluster.close()
            raise
        sandbox = cls(sandbox_id, config, cluster, name,
                      made.metadata.uid if made.metadata else None, agent=agent)
        try:
            await sandbox._until_ready()
            if sandbox.agent is not None:
                await sandbox.agent.start()
            await sandbox.runtime.make_dir(config.workdir, True)
        except BaseException:
            await sandbox.close()
            raise
        return sandbox

    async def _phase(self) -> tuple[str, bool, str]:
        """The pod's phase, readiness and what holds it back (a condition's
        message: unschedulable, say); ``Gone`` when it is not there (or not ours)."""
        try:
            pod = await self.cluster.client.get(Pod, self.pod)
        except ApiError as exc:
            if exc.status.code == 404:
                return "Gone", False, ""
            raise ProviderError(f"reading pod {self.pod} failed: {exc.status.message}") from exc
        if self.uid and pod.metadata and pod.metadata.uid != self.uid:
            return "Gone", False, ""
        status = pod.status
        if status is None:
            return "Pending", False, ""
        conditions = status.conditions or []
        ready = any(c.type == "Ready" and c.status == "True" for c in conditions)
        held = "; ".join(f"{c.reason}: {c.message}" for c in conditions
                         if c.status == "False" and c.message)
        return status.phase or "Pending", ready, held

    async def _until_ready(self) -> None:
        deadline = time.monotonic() + self.config.ready_timeout
        while True:
            phase, ready, held = await self._phase()
            if ready:
                return
            if phase in ("Failed", "Succeeded", "Gone"):
                raise SandboxUnavailable(f"pod {self.pod} did not start: it is {phase}")
            if time.monotonic() > deadline:
                raise SandboxUnavailable(
                    f"pod {self.pod} was not ready within {self.config.ready_timeout} s"
                    + (f" ({held})" if held else ""))
            await asyncio.sleep(0.2)

    def describe(self) -> dict[str, Any]:
        return {"provider": self.provider, "workdir": self.workdir, "pod": self.pod,
                "uid": self.uid, "config": self.config.model_dump(),
                "agent": self.agent is not None}

    @classmethod
    async def reconnect(cls, sandbox_id: str, description: Mapping[str, Any]
                        ) -> KubernetesSandbox:
        config = KubernetesConfig.model_validate(description["config"])
        # The agent, if any, runs on in the pod: the relay opens on first use.
        return cls(sandbox_id, config, Cluster(config), str(description["pod"]),
                   description.get("uid"), agent=bool(description.get("agent")))

    # -- lifecycle ----------------------------------------------------------------------
    async def is_alive(self) -> bool:
        phase, _, _ = await self._phase()
        return phase == "Running"

    async def observed_state(self) -> RuntimeState:
        phase, _, _ = await self._phase()
        return RuntimeState.RUNNING if phase in ("Running", "Pending") else RuntimeState.GONE

    async def close(self) -> None:
        try:
            if self.agent is not None:
                await self.agent.close()
            await self.cluster.delete_pod(self.pod, self.uid)
        finally:
            await self.cluster.close()
