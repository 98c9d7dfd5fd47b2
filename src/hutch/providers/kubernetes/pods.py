"""What hutch makes in the cluster for one sandbox: its pod, and the
PersistentVolumeClaim its working directory is on (when it can suspend), and
the waits for a pod to be ready or gone."""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

from ..._errors import ProviderError, SandboxUnavailable
from ..._lazy import lazy_module
from .api import SANDBOX_ID_ANNOTATION, SNAPSHOT_API, Cluster, labels, ours, pod_name
from .config import KubernetesConfig

if TYPE_CHECKING:
    import lightkube
else:  # imported at their first use: see hutch._lazy
    lightkube = lazy_module("lightkube")


def claim_name(sandbox_id: str) -> str:
    """The claim of a sandbox's working directory (the pod's name: another kind)."""
    return pod_name(sandbox_id)


def claim_manifest(config: KubernetesConfig, sandbox_id: str,
                   from_snapshot: str | None = None) -> dict[str, Any]:
    """The claim of ``sandbox_id``'s working directory; ``from_snapshot``
    (a VolumeSnapshot's name) starts it with that snapshot's files."""
    spec: dict[str, Any] = {"accessModes": ["ReadWriteOnce"],
                            "resources": {"requests": {"storage": config.volume_size or "1Gi"}}}
    if config.storage_class is not None:
        spec["storageClassName"] = config.storage_class
    if from_snapshot is not None:
        spec["dataSource"] = {"apiGroup": SNAPSHOT_API.split("/")[0], "kind": "VolumeSnapshot",
                              "name": from_snapshot}
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
            "metadata": {"name": claim_name(sandbox_id), "labels": labels(sandbox_id),
                         "annotations": {SANDBOX_ID_ANNOTATION: sandbox_id}},
            "spec": spec}


async def make_claim(cluster: Cluster, config: KubernetesConfig, sandbox_id: str,
                     from_snapshot: str | None = None) -> str:
    """Make the claim; its uid. A create whose answer was lost is undone."""
    manifest = claim_manifest(config, sandbox_id, from_snapshot)
    try:
        made = await cluster.call("POST", cluster.kind_path("persistentvolumeclaims"),
                                  body=manifest)
    except BaseException:
        await cluster.delete("persistentvolumeclaims", claim_name(sandbox_id), None)
        raise
    return str(((made or {}).get("metadata") or {}).get("uid") or "")


async def make_pod(cluster: Cluster, config: KubernetesConfig, sandbox_id: str,
                   keeper: list[str], claim: str | None) -> str:
    """Make the pod, running ``keeper``; its uid. A create whose outcome is
    unknown (the answer lost or unreadable) is undone: the name is this
    sandbox's alone."""
    # Imported here: lightkube's models are of no use until a pod is made.
    from .podspec import sandbox_pod

    name = pod_name(sandbox_id)
    try:
        made = await cluster.client.create(sandbox_pod(config, sandbox_id, name, keeper, claim))
    except lightkube.ApiError as exc:
        raise ProviderError(f"creating pod {name} failed: {exc.status.message}") from exc
    except BaseException:
        await cluster.delete_pod(name, None)
        raise
    return str(made.metadata.uid if made.metadata else "")


def phase_of(pod: dict[str, Any] | None) -> tuple[str, bool]:
    """A pod's phase and readiness (``Gone`` for no pod)."""
    if pod is None:
        return "Gone", False
    status = pod.get("status") or {}
    ready = any(c.get("type") == "Ready" and c.get("status") == "True"
                for c in status.get("conditions") or [])
    return str(status.get("phase") or "Pending"), ready


def why_not_running(pod: dict[str, Any] | None, name: str) -> str:
    """What became of a pod that is not running, for a person."""
    if pod is None:
        return f"its pod {name} was deleted outside hutch"
    status = pod.get("status") or {}
    if status.get("reason") == "Evicted":
        return f"its pod {name} was evicted: {status.get('message') or 'by its node'}"
    said = status.get("message") or status.get("reason")
    for container in status.get("containerStatuses") or []:
        ended = (container.get("state") or {}).get("terminated")
        if ended:
            said = said or (f"its container exited with code {ended.get('exitCode')}"
                            + (f" ({ended['reason']})" if ended.get("reason") else ""))
    phase = status.get("phase") or "Pending"
    return f"its pod {name} is {phase}" + (f": {said}" if said else "")


async def until_ready(cluster: Cluster, sandbox_id: str, uid: str, timeout: float) -> None:
    """Wait until the pod ``uid`` is ready; SandboxUnavailable if it ends or
    is not ready within ``timeout`` seconds."""
    name = pod_name(sandbox_id)
    deadline = time.monotonic() + timeout
    while True:
        pod = await cluster.get("pods", name)
        if pod is not None and (pod.get("metadata") or {}).get("uid") != uid:
            pod = None
        phase, ready = phase_of(pod)
        if ready:
            return
        if phase in ("Failed", "Succeeded", "Gone"):
            raise SandboxUnavailable(
                f"pod {name} did not start: {why_not_running(pod, name)}")
        if time.monotonic() > deadline:
            held = "; ".join(
                f"{c.get('reason')}: {c.get('message')}"
                for c in ((pod or {}).get("status") or {}).get("conditions") or []
                if c.get("status") == "False" and c.get("message"))
            raise SandboxUnavailable(f"pod {name} was not ready within {timeout} s"
                                     + (f" ({held})" if held else ""))
        await asyncio.sleep(0.2)


async def until_gone(cluster: Cluster, kind: str, name: str, uid: str | None,
                     timeout: float) -> None:
    """Wait until the object ``uid`` of ``kind`` is deleted (a foreground
    deletion finishes after its answer)."""
    deadline = time.monotonic() + timeout
    while True:
        found = await cluster.get(kind, name)
        if found is None or (uid and (found.get("metadata") or {}).get("uid") != uid):
            return
        if time.monotonic() > deadline:
            raise SandboxUnavailable(f"{kind} {name} was not deleted within {timeout} s")
        await asyncio.sleep(0.1)


async def our_pod(cluster: Cluster, sandbox_id: str) -> dict[str, Any] | None:
    """The pod this home made for ``sandbox_id``, if there is one."""
    pod = await cluster.get("pods", pod_name(sandbox_id))
    return pod if ours(pod, sandbox_id) else None
