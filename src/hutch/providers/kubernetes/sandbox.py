"""``kubernetes``: one Pod per sandbox, reached through the API server.

hutch's agent is the pod's keeper and serves exec, files, grep, glob and
processes on one kept ``pods/exec`` (:mod:`.agentpod`); with
``runtime = "native"`` (or no agent built here) each command is a
``pods/exec`` of its own and files go through commands (:mod:`.execruntime`).
The pod's life (its claim, suspend to nothing, the watch for pods lost
outside hutch, adoption after a restart) is :mod:`.lifecycle`'s, its
snapshots and forks :mod:`.snapshots`'.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from ..._errors import InvalidArgument, SandboxFileExists, SandboxUnavailable
from ..._types import Capabilities
from ..agent import AgentUnavailable, agent_binary
from ..base import SandboxRuntime
from .agentpod import AGENT_PATH, PodAgent, keeper_command
from .api import Cluster
from .config import KubernetesConfig
from .execruntime import PodExecRuntime
from .pods import phase_of
from .preview import PortForward, ensure_service
from .snapshots import PodSnapshots

log = logging.getLogger("hutch.kubernetes")


class KubernetesSandbox(PodSnapshots):
    # resource_limits: memory and CPU as the container's limits, held by the kubelet.
    # preview_url: a listener on the daemon's host, through pods/portforward.
    capabilities = Capabilities(processes=True, users=True, suspend=True, snapshot=True,
                                fork=True, resource_limits=True, preview_url=True)

    def __init__(self, sandbox_id: str, config: KubernetesConfig, cluster: Cluster,
                 name: str, uid: str | None, claim: str | None = None, *,
                 agent: bool = False) -> None:
        super().__init__(sandbox_id, config, cluster, name, uid, claim, agent=agent)
        self.pod_exec = PodExecRuntime(sandbox_id, config.workdir, cluster, name)
        #: The agent in the pod, when it serves the sandbox.
        self.agent = (PodAgent(sandbox_id, config.workdir, self.pod_exec, self._still_running)
                      if agent else None)
        #: The listeners of the ports previewed, while the pod runs: port -> (its URL, it).
        self._forwards: dict[int, tuple[str, PortForward]] = {}
        self._forwards_lock = asyncio.Lock()

    @property
    def runtime(self) -> SandboxRuntime:
        return self.agent.runtime if self.agent is not None else self.pod_exec

    @classmethod
    def wants_agent(cls, config: KubernetesConfig) -> bool:
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

    def _keeper(self) -> list[str]:
        return keeper_command() if self.agent is not None else super()._keeper()

    async def _pod_started(self) -> None:
        if self.agent is not None:
            await self.agent.start()
        with contextlib.suppress(SandboxFileExists):  # the claim is mounted there
            await self.runtime.make_dir(self.config.workdir, True)

    async def _pod_stopping(self) -> None:
        async with self._forwards_lock:
            forwards, self._forwards = self._forwards, {}
        for _, forward in forwards.values():
            await forward.close()
        if self.agent is not None:
            await self.agent.close()

    async def preview_url(self, port: int) -> str:
        """A URL on the daemon's host forwarded to ``port`` of the pod (its
        listener opened on first use, again after a resume), and the port's
        Service for callers inside the cluster."""
        if not 0 < port < 65536:
            raise InvalidArgument(f"port {port} is not a TCP port (1-65535)")
        async with self._forwards_lock:
            if port not in self._forwards:
                await ensure_service(self.cluster, self.sandbox_id, port)
                forward = PortForward(self.cluster, self.pod, port)
                self._forwards[port] = (await forward.open(), forward)
            return self._forwards[port][0]

    async def _pod_adopted(self) -> None:
        # A pod whose resume was cut before the agent was copied in waits
        # for it still: copied in now, as at its start.
        if self.agent is not None and (await self.pod_exec.run(
                ["test", "-x", AGENT_PATH]))[0] != 0:
            await self._pod_started()

    async def _still_running(self, reason: str) -> None:
        """Returns while the pod runs; else the sandbox is lost, and says why."""
        phase, _ = phase_of(await self._pod())
        if phase != "Running":
            raise SandboxUnavailable(
                f"kubernetes sandbox {self.sandbox_id}: its pod {self.pod} is {phase} "
                f"({reason})")
