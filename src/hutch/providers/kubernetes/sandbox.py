"""``kubernetes``: one Pod per sandbox, its commands through ``pods/exec``.

This first slice runs processes and moves files through exec; suspend (the
pod deleted, its PVC kept), snapshots, the agent inside the pod and a watch
for pods lost outside hutch are still to come, and declared false.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Mapping
from typing import Any

from lightkube import ApiError
from lightkube.resources.core_v1 import Pod

from ..._errors import (
    ProviderError,
    SandboxFileNotFound,
    SandboxPermissionDenied,
    SandboxUnavailable,
)
from ..._types import Capabilities
from ..base import (
    BackendProcess,
    NativeBackend,
    ProcessRequest,
    RuntimeState,
    UnstartedProcess,
)
from .api import Cluster, pod_name
from .config import KubernetesConfig
from .execws import ExecSession, kill_argv, wrapped
from .files import CommandFiles
from .podspec import sandbox_pod


class KubernetesSandbox(CommandFiles, NativeBackend):
    provider = "kubernetes"
    capabilities = Capabilities(processes=True, users=True)
    config_model = KubernetesConfig

    def __init__(self, sandbox_id: str, config: KubernetesConfig, cluster: Cluster,
                 name: str, uid: str | None) -> None:
        super().__init__(sandbox_id, config.workdir)
        self.config = config
        self.cluster = cluster
        self.pod = name
        self.uid = uid

    # -- provisioning -------------------------------------------------------------------
    @classmethod
    async def create(cls, config: KubernetesConfig, sandbox_id: str) -> KubernetesSandbox:
        cluster = Cluster(config)
        name = pod_name(sandbox_id)
        # The pod's keeper: it waits, commands come through exec.
        pod = sandbox_pod(config, sandbox_id, name, [
            "sh", "-c", "trap 'exit 0' TERM; while :; do sleep 3600 & wait; done"])
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
                      made.metadata.uid if made.metadata else None)
        try:
            await sandbox._until_ready()
            await sandbox._checked(["mkdir", "-p", "--", config.workdir],
                                   f"mkdir {config.workdir}")
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
                "uid": self.uid, "config": self.config.model_dump()}

    @classmethod
    async def reconnect(cls, sandbox_id: str, description: Mapping[str, Any]
                        ) -> KubernetesSandbox:
        config = KubernetesConfig.model_validate(description["config"])
        return cls(sandbox_id, config, Cluster(config), str(description["pod"]),
                   description.get("uid"))

    # -- lifecycle ----------------------------------------------------------------------
    async def is_alive(self) -> bool:
        phase, _, _ = await self._phase()
        return phase == "Running"

    async def observed_state(self) -> RuntimeState:
        phase, _, _ = await self._phase()
        return RuntimeState.RUNNING if phase in ("Running", "Pending") else RuntimeState.GONE

    async def close(self) -> None:
        try:
            await self.cluster.delete_pod(self.pod, self.uid)
        finally:
            await self.cluster.close()

    # -- processes ------------------------------------------------------------------------
    async def start_process(self, request: ProcessRequest) -> BackendProcess:
        exec_id = uuid.uuid4().hex

        async def kill(signal: str) -> None:
            await self.run(kill_argv(exec_id, signal))

        session = await ExecSession.open(
            self.cluster.http, self.cluster.pod_path(self.pod),
            wrapped(request, exec_id, {}), stdin=request.stdin,
            keep_stdin=request.keep_stdin, kill=kill, marked=True)
        said = await session.started
        if said in ("ok", ""):
            return session
        await session.wait()
        command = request.argv[0] if request.argv else ""
        if said == "nouser":
            return UnstartedProcess(f"no such user {request.user!r}")
        if said == "nocwd":
            raise SandboxFileNotFound(f"working directory {request.cwd} does not exist")
        if said == "notfound":
            raise SandboxFileNotFound(f"{command}: command not found")
        raise SandboxPermissionDenied(f"{command}: not executable")

    async def run(self, argv: list[str], stdin: bytes | None = None) -> tuple[int, bytes, bytes]:
        session = await ExecSession.open(
            self.cluster.http, self.cluster.pod_path(self.pod), argv,
            stdin=stdin if stdin is not None else None, keep_stdin=False,
            kill=None)
        out: list[bytes] = []
        err: list[bytes] = []
        while (chunk := await session.read()) is not None:
            (out if chunk.stream == "stdout" else err).append(chunk.data)
        return await session.wait(), b"".join(out), b"".join(err)
