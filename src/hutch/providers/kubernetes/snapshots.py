"""Snapshots and forks of a kubernetes sandbox's working directory.

Where the cluster serves ``snapshot.storage.k8s.io/v1`` (a CSI snapshotter)
and the working directory is on a claim, a snapshot is a VolumeSnapshot of
that claim, and a sandbox started from it gets a new claim whose
``dataSource`` is the snapshot (the storage copies, not hutch). Elsewhere a
snapshot is the working directory as a tar archive, read out through exec
into hutch's snapshot storage (``$HUTCH_HOME/kubernetes/snapshots``) and
written into a new sandbox's the same way. Either way only the working
directory is kept: processes, memory and the rest of the pod's file system
are not (``includes_memory`` false).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import time
from typing import Any

import anyio.to_thread

from ..._errors import HutchError, InvalidArgument, ProviderError, SandboxUnavailable
from ..._paths import hutch_home
from ..._types import ProviderSnapshot
from .api import HOME_LABEL, Cluster, home_selector, home_tag
from .clusters import CONNECTION
from .config import KubernetesConfig
from .execruntime import PodExecRuntime
from .lifecycle import PodLifecycle, reached_clusters

#: The label naming the hutch snapshot a VolumeSnapshot holds.
SNAPSHOT_LABEL = "hutch.dev/snapshot"
#: How long a VolumeSnapshot may take to be ready to use, seconds.
SNAPSHOT_READY_TIMEOUT = 600.0
_QUANTITY = re.compile(r"^([0-9.]+)([KMGTPE]i?|[kmgtpe])?$")
_UNITS = {"": 1, "k": 10**3, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15,
          "E": 10**18, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50,
          "Ei": 2**60}


def _bytes(quantity: Any) -> int:
    """A Kubernetes quantity (``1Gi``, ``4096``) in bytes; 0 if unreadable."""
    found = _QUANTITY.match(str(quantity or "").strip())
    if not found:
        return 0
    return int(float(found.group(1)) * _UNITS.get(found.group(2) or "", 1))


def archives_dir() -> str:
    return os.path.join(hutch_home(), "kubernetes", "snapshots")


def _archive(snapshot_id: str) -> str:
    return os.path.join(archives_dir(), f"{snapshot_id}.tar")


def _snapshot_name(snapshot_id: str) -> str:
    return "hutch-" + snapshot_id.lower().replace("_", "-")[:50]


class PodSnapshots(PodLifecycle):
    """Capture, start from, remove and list snapshots (see the module's docstring)."""

    #: The per-command exec runtime (set by the sandbox): archives go through it.
    pod_exec: PodExecRuntime

    async def capture(self, snapshot_id: str, *, diff: bool = True) -> ProviderSnapshot:
        """A VolumeSnapshot of the claim where the cluster has them, else an
        archive; either way the sandbox is left as it was (a suspended one's
        archive is read through a pod made for it and deleted after)."""
        if self.claim is not None and await self.cluster.offers_snapshots():
            return await self._volume_snapshot(snapshot_id)
        if await self._pod() is not None:
            return await self._archive_out(snapshot_id)
        if self.claim is None:
            raise SandboxUnavailable(f"sandbox {self.sandbox_id} has no pod to read from")
        await self._start_pod()
        try:
            return await self._archive_out(snapshot_id)
        finally:
            await self._delete_pod()

    def _snapshot_data(self, **data: Any) -> dict[str, Any]:
        return {**data, "config": self.config.model_dump()}

    async def _volume_snapshot(self, snapshot_id: str) -> ProviderSnapshot:
        name = _snapshot_name(snapshot_id)
        spec: dict[str, Any] = {"source": {"persistentVolumeClaimName": self.claim}}
        if self.config.snapshot_class is not None:
            spec["volumeSnapshotClassName"] = self.config.snapshot_class
        made = await self.cluster.call("POST", self.cluster.kind_path("volumesnapshots"), body={
            "apiVersion": "snapshot.storage.k8s.io/v1", "kind": "VolumeSnapshot",
            "metadata": {"name": name, "labels": {HOME_LABEL: home_tag(),
                                                  SNAPSHOT_LABEL: snapshot_id}},
            "spec": spec})
        uid = ((made or {}).get("metadata") or {}).get("uid")
        try:
            status = await _until_ready_to_use(self.cluster, name)
        except BaseException:
            with contextlib.suppress(Exception):
                await self.cluster.delete("volumesnapshots", name, uid)
            raise
        return ProviderSnapshot(snapshot_id, self.provider, _bytes(status.get("restoreSize")),
                                self._snapshot_data(volume_snapshot=name, uid=uid))

    async def _archive_out(self, snapshot_id: str) -> ProviderSnapshot:
        """The working directory as a tar archive, streamed out through exec."""
        path = _archive(snapshot_id)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        partial = path + ".partial"
        session = await self.pod_exec.open_exec(
            ["tar", "-C", self.workdir, "--numeric-owner", "-cf", "-", "."])
        said: list[bytes] = []
        try:
            async with await anyio.open_file(partial, "wb") as out:
                while (chunk := await session.read()) is not None:
                    if chunk.stream == "stdout":
                        await out.write(chunk.data)
                    elif sum(map(len, said)) < 4096:
                        said.append(chunk.data)
                await out.flush()
                await anyio.to_thread.run_sync(os.fsync, out.wrapped.fileno())
            code = await session.wait()
            if code != 0:
                raise ProviderError(f"archiving {self.workdir} failed (tar exited {code}): "
                                    f"{b''.join(said).decode('utf-8', 'replace')[:500]}")
            os.replace(partial, path)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(partial)
        return ProviderSnapshot(snapshot_id, self.provider, os.path.getsize(path),
                                self._snapshot_data(archive=True))

    async def _archive_in(self, snapshot_id: str) -> None:
        """An archive's files written into the working directory through exec."""
        session = await self.pod_exec.open_exec(
            ["tar", "-C", self.workdir, "--numeric-owner", "-xf", "-"], keep_stdin=True)

        async def feed() -> None:
            async with await anyio.open_file(_archive(snapshot_id), "rb") as source:
                while piece := await source.read(1 << 20):
                    await session.write_stdin(piece)
            await session.close_stdin()

        said: list[bytes] = []

        async def drain() -> None:
            while (chunk := await session.read()) is not None:
                if sum(map(len, said)) < 4096:
                    said.append(chunk.data)

        await asyncio.gather(feed(), drain())
        code = await session.wait()
        if code != 0:
            raise ProviderError(f"unpacking snapshot {snapshot_id} failed (tar exited {code}): "
                                f"{b''.join(said).decode('utf-8', 'replace')[:500]}")

    @classmethod
    async def create_from_snapshot(
        cls, config: Any, sandbox_id: str, snapshot: ProviderSnapshot
    ) -> PodSnapshots:
        data = snapshot.data
        origin = KubernetesConfig.model_validate(data.get("config") or {})
        settings = config if isinstance(config, KubernetesConfig) else origin
        if data.get("volume_snapshot"):
            # A VolumeSnapshot is of its namespace, in its cluster: the branch
            # is made there, on a claim (whatever the settings say).
            settings = settings.model_copy(update={
                **{k: getattr(origin, k) for k in CONNECTION}, "persistent": True})
            made = await cls._provision(settings, sandbox_id,
                                        from_snapshot=str(data["volume_snapshot"]))
            assert isinstance(made, PodSnapshots)
            return made
        if not os.path.exists(_archive(snapshot.snapshot_id)):
            raise InvalidArgument(f"snapshot {snapshot.snapshot_id} is gone from this host")
        made = await cls._provision(settings, sandbox_id, from_snapshot=None)
        assert isinstance(made, PodSnapshots)
        try:
            await made._archive_in(snapshot.snapshot_id)
        except BaseException:
            with contextlib.suppress(Exception):
                await made.close()
            raise
        return made

    @classmethod
    async def remove_snapshot(cls, snapshot: ProviderSnapshot) -> None:
        """Its archive, or its VolumeSnapshot (found by its label in every
        cluster this home uses when the handle does not say which)."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(_archive(snapshot.snapshot_id))
        data = snapshot.data
        if data.get("archive"):
            return
        if data.get("volume_snapshot") and data.get("config"):
            cluster = Cluster(KubernetesConfig.model_validate(data["config"]))
            try:
                await cluster.delete("volumesnapshots", str(data["volume_snapshot"]),
                                     data.get("uid"))
            finally:
                await cluster.close()
            return
        async with reached_clusters() as reached:
            for cluster in reached:
                if not await cluster.offers_snapshots():
                    continue
                listed = await cluster.listed(
                    "volumesnapshots", f"{home_selector()},{SNAPSHOT_LABEL}={snapshot.snapshot_id}")
                for item in listed.get("items") or []:
                    meta = item.get("metadata") or {}
                    await cluster.delete("volumesnapshots", meta["name"], meta.get("uid"))

    @classmethod
    async def held_snapshots(cls) -> list[str]:
        """The archives here, and this home's VolumeSnapshots in every cluster
        it uses (a cluster that cannot be asked now makes this fail, rather
        than its snapshots look gone)."""
        held: set[str] = set()
        try:
            names = os.listdir(archives_dir())
        except FileNotFoundError:
            names = []
        held.update(n[:-4] for n in names if n.endswith(".tar"))
        async with reached_clusters() as reached:
            for cluster in reached:
                try:
                    if not await cluster.offers_snapshots():
                        continue
                    listed = await cluster.listed("volumesnapshots", home_selector())
                except HutchError as exc:
                    raise ProviderError(
                        f"cannot list the snapshots in namespace {cluster.namespace}: {exc}"
                    ) from exc
                for item in listed.get("items") or []:
                    label = ((item.get("metadata") or {}).get("labels") or {}).get(
                        SNAPSHOT_LABEL)
                    if label:
                        held.add(str(label))
        return sorted(held)


async def _until_ready_to_use(cluster: Cluster, name: str) -> dict[str, Any]:
    """The VolumeSnapshot's status once it is ready to use."""
    deadline = time.monotonic() + SNAPSHOT_READY_TIMEOUT
    while True:
        found = await cluster.get("volumesnapshots", name)
        if found is None:
            raise ProviderError(f"VolumeSnapshot {name} went before it was ready")
        status = found.get("status") or {}
        if status.get("readyToUse"):
            return dict(status)
        error = (status.get("error") or {}).get("message")
        if error:
            raise ProviderError(f"VolumeSnapshot {name} failed: {error}")
        if time.monotonic() > deadline:
            raise ProviderError(f"VolumeSnapshot {name} was not ready within "
                                f"{SNAPSHOT_READY_TIMEOUT:.0f} s")
        await asyncio.sleep(0.2)
