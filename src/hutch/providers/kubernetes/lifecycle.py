"""A kubernetes sandbox's life: made, suspended to nothing (the pod deleted,
its claim kept), resumed (a new pod on the same claim), found again after a
restart, failed when its pod goes outside hutch, deleted; and what a daemon
starting up frees (the pods and claims of this home that no record names)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator, Mapping
from typing import Any

from ..._errors import HutchError, InvalidArgument, ProviderError, SandboxUnavailable
from ..._faults import fault_point
from ..._types import Capabilities
from ..base import RuntimeReport, RuntimeState, SandboxBackend
from . import clusters
from .api import SANDBOX_LABEL, Cluster, home_selector, ours, pod_name
from .config import KubernetesConfig
from .pods import (
    claim_name,
    make_claim,
    make_pod,
    our_pod,
    phase_of,
    until_gone,
    until_ready,
)
from .preview import delete_services
from .watch import watch_runtimes

log = logging.getLogger("hutch.kubernetes")
#: How long a deleted pod may take to be gone, seconds.
GONE_TIMEOUT = 120.0


@contextlib.asynccontextmanager
async def reached_clusters() -> AsyncIterator[list[Cluster]]:
    """A connection to every cluster this home has used whose settings can
    still be read (one whose kubeconfig is gone is forgotten)."""
    found = []
    for config in clusters.remembered():
        try:
            found.append(Cluster(config))
        except InvalidArgument:
            clusters.forget(config)
    try:
        yield found
    finally:
        for cluster in found:
            with contextlib.suppress(Exception):
                await cluster.close()


class PodLifecycle(SandboxBackend):
    """The pod and its claim, from create to close. What runs in the pod (a
    plain keeper, or hutch's agent) is the subclass's: :meth:`_keeper`,
    :meth:`_pod_started` (each new pod, at create and resume) and
    :meth:`_pod_stopping` (before the pod is deleted)."""

    provider = "kubernetes"
    config_model = KubernetesConfig
    #: Any daemon reaching the cluster reaches its pods.
    reachable_from_any_host = True

    def __init__(self, sandbox_id: str, config: KubernetesConfig, cluster: Cluster,
                 name: str, uid: str | None, claim: str | None = None, *,
                 agent: bool = False) -> None:
        super().__init__(sandbox_id, config.workdir)
        #: Whether hutch's agent is the pod's keeper (and serves the sandbox).
        self.uses_agent = agent
        self.config = config
        self.cluster = cluster
        self.pod = name
        #: The pod's uid (None while suspended): only that pod is this sandbox's.
        self.uid = uid
        #: The claim the working directory is on (None: the pod's own files).
        self.claim = claim

    # -- provisioning -------------------------------------------------------------------
    @classmethod
    async def create(cls, config: KubernetesConfig, sandbox_id: str) -> PodLifecycle:
        return await cls._provision(config, sandbox_id, from_snapshot=None)

    @classmethod
    async def _provision(cls, config: KubernetesConfig, sandbox_id: str, *,
                         from_snapshot: str | None) -> PodLifecycle:
        """A new sandbox: its claim (from a VolumeSnapshot if named), its pod,
        ready, its working directory made."""
        agent = await asyncio.to_thread(cls.wants_agent, config)
        cluster = Cluster(config)
        clusters.remember(config)
        claim = claim_name(sandbox_id) if config.persistent else None
        sandbox = cls(sandbox_id, config, cluster, pod_name(sandbox_id), None, claim,
                      agent=agent)
        try:
            if claim is not None:
                await make_claim(cluster, config, sandbox_id, from_snapshot)
            await sandbox._start_pod()
        except BaseException:
            with contextlib.suppress(Exception):
                await sandbox.close()
            raise
        return sandbox

    @classmethod
    def wants_agent(cls, config: KubernetesConfig) -> bool:
        """Whether a new sandbox of ``config`` gets hutch's agent (blocking)."""
        return False

    def _keeper(self) -> list[str]:
        """What the pod's container runs."""
        return ["sh", "-c", "trap 'exit 0' TERM; while :; do sleep 3600 & wait; done"]

    async def _pod_started(self) -> None:
        """A new pod is ready (its working directory is made here)."""

    async def _pod_stopping(self) -> None:
        """The pod is about to be deleted."""

    async def _pod_adopted(self) -> None:
        """The pod, found running after a restart, is this sandbox's again
        (a resume cut short may have made it and done no more)."""

    async def _start_pod(self, *, fault: str = "") -> None:
        """A pod (at create, at each resume), ready, then :meth:`_pod_started`."""
        self.uid = await make_pod(self.cluster, self.config, self.sandbox_id, self._keeper(),
                                  self.claim)
        if fault:
            fault_point(fault)
        await until_ready(self.cluster, self.sandbox_id, self.uid, self.config.ready_timeout)
        await self._pod_started()

    def describe(self) -> dict[str, Any]:
        return {"provider": self.provider, "workdir": self.workdir, "pod": self.pod,
                "uid": self.uid, "claim": self.claim, "config": self.config.model_dump(),
                "agent": self.uses_agent}

    @classmethod
    async def reconnect(cls, sandbox_id: str, description: Mapping[str, Any]
                        ) -> PodLifecycle:
        """The sandbox found again: its pod is whichever this home made for it
        (a resume cut short by the restart made one its record does not name)."""
        config = KubernetesConfig.model_validate(description["config"])
        cluster = Cluster(config)
        clusters.remember(config)
        # The agent, if any, runs on in the pod: its relay opens on first use.
        sandbox = cls(sandbox_id, config, cluster, str(description["pod"]),
                      description.get("uid"), description.get("claim"),
                      agent=bool(description.get("agent")))
        try:
            pod = await our_pod(cluster, sandbox_id)
        except ProviderError:
            pod = None  # unreachable now: observed_state says so
        if pod is not None:
            sandbox.uid = (pod.get("metadata") or {}).get("uid") or sandbox.uid
            if phase_of(pod)[1]:
                with contextlib.suppress(HutchError):  # observed_state tells what is wrong
                    await sandbox._pod_adopted()
        return sandbox

    # -- what the cluster says ------------------------------------------------------------
    async def _pod(self) -> dict[str, Any] | None:
        """This sandbox's pod (None: none, or another pod of its name)."""
        if self.uid is None:
            return None
        pod = await self.cluster.get("pods", self.pod)
        if pod is None or (pod.get("metadata") or {}).get("uid") != self.uid:
            return None
        return pod

    async def _claim_kept(self) -> bool:
        if self.claim is None:
            return False
        claim = await self.cluster.get("persistentvolumeclaims", self.claim)
        return ours(claim, self.sandbox_id) and "deletionTimestamp" not in (
            (claim or {}).get("metadata") or {})

    async def is_alive(self) -> bool:
        phase, _ = phase_of(await self._pod())
        return phase in ("Running", "Pending")

    async def is_suspended(self) -> bool:
        return await self._pod() is None and await self._claim_kept()

    async def observed_state(self) -> RuntimeState:
        if await self.is_alive():
            return RuntimeState.RUNNING
        if await self.is_suspended():
            return RuntimeState.SUSPENDED
        return RuntimeState.GONE

    # -- suspend to nothing --------------------------------------------------------------
    def sandbox_capabilities(self) -> Capabilities:
        caps = super().sandbox_capabilities()
        return dataclasses.replace(caps, suspend=caps.suspend and self.claim is not None)

    async def suspend(self) -> None:
        """The pod deleted (its memory and processes with it), the claim kept."""
        if self.claim is None:
            raise SandboxUnavailable(
                f"sandbox {self.sandbox_id} has no claim to keep its files (persistent=false)")
        await self._delete_pod(fault="suspend.kubernetes.deleted")

    async def resume(self) -> None:
        """A new pod on the same claim, ready."""
        if await self.is_alive():
            return
        if not await self._claim_kept():
            raise SandboxUnavailable(
                f"the claim {self.claim} of sandbox {self.sandbox_id} is gone: "
                "its files cannot be resumed")
        await self._start_pod(fault="resume.kubernetes.started")

    async def _delete_pod(self, *, fault: str = "") -> None:
        await self._pod_stopping()
        uid = self.uid
        if uid is None:
            pod = await our_pod(self.cluster, self.sandbox_id)
            uid = (pod or {}).get("metadata", {}).get("uid")
            if uid is None:
                return
        await self.cluster.delete("pods", self.pod, uid)
        if fault:
            fault_point(fault)
        await until_gone(self.cluster, "pods", self.pod, uid, GONE_TIMEOUT)
        self.uid = None

    async def release_runtime(self) -> None:
        """Its pod failed: what is left of it goes; the claim keeps the files."""
        with contextlib.suppress(HutchError):
            await self._delete_pod()

    async def close(self) -> None:
        """Foreground deletion of the pod, then of its claim, each by its uid."""
        try:
            await self._delete_pod()
            await delete_services(self.cluster, self.sandbox_id)
            if self.claim is not None:
                claim = await self.cluster.get("persistentvolumeclaims", self.claim)
                if ours(claim, self.sandbox_id):
                    await self.cluster.delete("persistentvolumeclaims", self.claim,
                                              (claim or {}).get("metadata", {}).get("uid"))
        finally:
            await self.cluster.close()

    # -- a daemon starting up ------------------------------------------------------------
    @classmethod
    async def discard(cls, sandbox_id: str) -> None:
        """What a create cut short may have left, in every cluster this home uses."""
        async with reached_clusters() as reached:
            for cluster in reached:
                with contextlib.suppress(HutchError):
                    await _remove_of(cluster, {sandbox_id.lower()}, exclude=False)

    @classmethod
    async def reap_orphans(cls, known: set[str]) -> list[str]:
        """The pods and claims of this home whose sandbox no record names."""
        removed: list[str] = []
        failed: list[str] = []
        async with reached_clusters() as reached:
            for cluster in reached:
                try:
                    removed += await _remove_of(cluster, {k.lower() for k in known},
                                                exclude=True)
                except HutchError as exc:
                    failed.append(str(exc))
        if failed:
            log.info("kubernetes orphans not reaped everywhere: %s", "; ".join(failed))
        return removed

    @classmethod
    async def watch_runtimes(cls, report: RuntimeReport) -> None:
        """Every cluster's pods of this home, watched (:mod:`.watch`)."""
        await watch_runtimes(report)


async def _remove_of(cluster: Cluster, sandboxes: set[str], *, exclude: bool) -> list[str]:
    """Delete this home's pods, services and claims in ``cluster`` of ``sandboxes`` (or,
    ``exclude``, of every other sandbox); what was deleted."""
    removed = []
    for kind in ("pods", "services", "persistentvolumeclaims"):
        listed = await cluster.listed(kind, home_selector())
        for item in listed.get("items") or []:
            meta = item.get("metadata") or {}
            sandbox = (meta.get("labels") or {}).get(SANDBOX_LABEL, "")
            if (sandbox in sandboxes) == exclude:
                continue
            await cluster.delete(kind, meta["name"], meta.get("uid"))
            removed.append(f"{kind}/{meta['name']}")
    return removed
