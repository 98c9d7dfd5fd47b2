"""A docker sandbox's state as images: suspend (a commit, or a flatten past the
layer cap), snapshots (the container's file system as an image, the working
directory as layers, see ``layers``), their removal, and what is held or orphaned."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import logging
import os
import shutil
from collections.abc import Mapping
from typing import Any

import anyio
import anyio.to_thread

from ..._errors import HutchError, ProviderError
from ..._faults import fault_point
from ..._paths import hutch_home, sandbox_workdir
from ..._types import ProviderSnapshot
from .. import layers
from .._diskcap import image_for, unmount_capped
from .._docker_engine import call as _call
from .._docker_engine import engine
from .._docker_engine import status_of as _status
from . import netguard
from .freeze import drop_start_locks, freeze_guard
from .labels import (
    HOME_LABEL,
    MANAGED_LABEL,
    PRESERVE_LABEL,
    SANDBOX_LABEL,
    SNAPSHOT_LABEL,
    SUSPENDED_REPOSITORY,
    snapshot_repository,
)
from .process import DockerProcesses

log = logging.getLogger("hutch.docker")


#: How long removing a snapshot's image may wait on the Engine.
SNAPSHOT_REMOVAL_TIMEOUT = 30.0


#: overlay2 stacks at most 128 layers; a suspend that would pass this many
#: flattens the container into a one-layer image instead of committing on top.
MAX_SUSPEND_LAYERS = 100


def _own_image_bytes(api: Any, image_id: str) -> int:
    """What image ``image_id`` holds of its own: its size less its parent's
    (a commit's layer over the image it ran from), or all of it where it
    stands alone (flattened). Docker's ``Size`` counts every layer below."""
    import docker.errors

    image = api.inspect_image(image_id)
    total = int(image.get("Size") or 0)
    parent = image.get("Parent")
    if not parent:
        return total
    try:
        below = int(api.inspect_image(parent).get("Size") or 0)
    except docker.errors.ImageNotFound:
        return total
    return max(0, total - below)


def commit_state(
    api: Any,
    container: str,
    base_image: str,
    repository: str,
    tag: str,
    labels: Mapping[str, str],
    *,
    flatten: bool = False,
    stopped: bool = False,
    fault: str = "snapshot.docker.frozen",
) -> str:
    """Write ``container``'s file system to ``repository:tag``; its image id.

    The one place that decides between a commit (one more layer on
    ``base_image``) and a flatten (a single-layer image): suspend and
    snapshot (and so workspace suspend) both come here. A commit that would
    stack ``base_image``'s layers past :data:`MAX_SUSPEND_LAYERS` flattens,
    since overlay2 stops at 128; ``flatten`` asks for one regardless.
    ``stopped``: the caller has paused the container, under its freeze guard.
    ``fault``: the fault point (:mod:`hutch._faults`) of the step, inside its freeze.
    """
    depth = len(api.inspect_image(base_image)["RootFS"].get("Layers") or [])
    if layers.flattens(depth, asked=flatten, limit=MAX_SUSPEND_LAYERS):
        config = api.inspect_container(container)["Config"]
        return _flatten(api, container, config, labels, repository, tag)
    if stopped:  # the caller holds the container paused (and its freeze guard)
        image = api.commit(container, repository=repository, tag=tag, conf={"Labels": labels},
                           pause=False)
        return str(image["Id"])
    # Paused by the guard, not by the commit's own pause: that one trusts the
    # Engine's lagging flag, and could undo the user's pause.
    with freeze_guard(container).frozen(api, container):
        fault_point(fault)
        image = api.commit(container, repository=repository, tag=tag, conf={"Labels": labels},
                           pause=False)
    return str(image["Id"])


def _flatten(
    api: Any, container: str, config: Mapping[str, Any], labels: Mapping[str, str],
    repository: str, tag: str,
) -> str:
    """Export ``container``'s file system into a one-layer suspend image.

    An import keeps files only, so the container's environment, user and
    working directory go along as Dockerfile changes.
    """

    def quoted(value: str) -> str:
        return json.dumps(value).replace("$", "\\$")  # "...", with ENV's $ kept literal

    changes = [f"ENV {k}={quoted(v)}" for k, _, v in
               (str(item).partition("=") for item in config.get("Env") or [])]
    if config.get("User"):
        changes.append(f"USER {config['User']}")
    if config.get("WorkingDir"):
        changes.append(f"WORKDIR {config['WorkingDir']}")
    changes += [f"LABEL {quoted(k)}={quoted(v)}" for k, v in labels.items()]
    api.import_image(
        src=api.export(container, chunk_size=1 << 20), repository=repository,
        tag=tag, changes=changes, stream_src=True,
    )
    return str(api.inspect_image(f"{repository}:{tag}")["Id"])


def free_untagged_images(api: Any) -> int:
    """Remove this hutch home's images that no tag names any more: a snapshot
    removed while a branch's container still ran on it is only untagged, and
    goes here once nothing stands on it. Not forced: an image a container or
    a child image still uses stays (the Engine refuses), for a later call.
    Returns how many went."""
    import docker.errors

    images = api.images(all=True, filters={
        "dangling": True, "label": [f"{MANAGED_LABEL}=1", f"{HOME_LABEL}={hutch_home()}"],
    })
    freed = 0
    for image in images:
        try:
            api.remove_image(image["Id"], noprune=False)
            freed += 1
        except docker.errors.NotFound:
            pass
        except docker.errors.APIError as exc:
            if _status(exc) != 409:
                raise
    return freed


def _capped_sandbox_dirs() -> list[str]:
    """The sandboxes whose own working directory is (or was) a capped mount
    here: a mount, or an image it is mounted from, in ``sandboxes/<id>``."""
    parent = os.path.join(hutch_home(), "sandboxes")
    try:
        names = sorted(os.listdir(parent))
    except OSError:
        return []
    found = []
    for name in names:
        workdir = sandbox_workdir(name)
        if os.path.ismount(workdir) or os.path.exists(image_for(workdir)):
            found.append(name)
    return found


def _release_own_dir(sandbox_id: str) -> None:
    """Free a sandbox's own host directory: its capped working directory's
    mount, image and loop device first (removing files would only empty a
    mount, not end it), then the directory with what else it holds."""
    workdir = sandbox_workdir(sandbox_id)
    with contextlib.suppress(OSError):
        unmount_capped(workdir)
    if not os.path.ismount(workdir):
        shutil.rmtree(os.path.dirname(workdir), ignore_errors=True)


class DockerSnapshots(DockerProcesses):
    """Suspend, snapshots and what the Engine holds of them."""

    async def suspend(self) -> None:
        """Commit the container's changes to an image and remove the container."""
        api = engine()
        container = self._container()
        previous = self.suspended_image
        labels = {**self.config.labels, MANAGED_LABEL: "1", SANDBOX_LABEL: self.sandbox_id,
                  HOME_LABEL: hutch_home()}

        image_id = await _call(
            commit_state, api, container, previous or self.base_image, SUSPENDED_REPOSITORY,
            self.sandbox_id, labels, fault="suspend.docker.frozen",
        )
        fault_point("suspend.docker.committed")
        self.suspended_image = image_id
        await _call(api.remove_container, container, force=True)
        fault_point("suspend.docker.removed")
        drop_start_locks(container)
        self.container_id = None
        await anyio.to_thread.run_sync(self._release_network_policy)
        if self.layered:
            # Nothing runs on its working directory now: it holds no mounted store.
            await anyio.to_thread.run_sync(layers.rest, self.sandbox_id)
        if self._agent is not None:
            self._agent.drop_connections()
        if previous and previous != image_id:
            # Refused while the new image builds on it (a commit); after a
            # flatten it goes, with the untagged layers below it.
            with contextlib.suppress(HutchError):
                await _call(api.remove_image, previous)

    # -- snapshots: the container's file system as an image, the working
    # -- directory as layers (see layers) ------------------------------------------------
    async def capture(self, snapshot_id: str, *, diff: bool = True) -> ProviderSnapshot:
        """The container's file system (committed; a layer on its image, or
        flattened past the layer cap) and the working directory (a layer of
        what changed since the branch started, or a copy), both. A paused
        container is committed as it is; a suspended one is its suspend image."""
        api = engine()
        repository = snapshot_repository()
        labels = {MANAGED_LABEL: "1", SNAPSHOT_LABEL: snapshot_id, HOME_LABEL: hutch_home()}
        if self.container_id is not None and not await self._container_exists():
            # Gone outside hutch's hands: what survives is the working
            # directory and the image it ran from, and that is what is kept.
            self.container_id = None
        # The directory first, the image last: held_snapshots lists images, so a
        # capture cut short between the two leaves nothing listed half-made.
        frozen = (
            await _call(self._freeze_and_commit, snapshot_id, diff, repository, labels)
            if self.layered else None
        )
        if frozen is not None:
            size, image_id = frozen
        else:
            size = await anyio.to_thread.run_sync(
                lambda: layers.capture(snapshot_id, self.sandbox_id, self.host_workdir,
                                        self._current_chain(), diff=diff)
            )
            try:
                image_id = await _call(self._commit, snapshot_id, diff, repository, labels)
            except BaseException:
                await anyio.to_thread.run_sync(layers.remove, snapshot_id)
                raise
        try:
            image_bytes = await _call(_own_image_bytes, api, image_id)
        except BaseException:
            await anyio.to_thread.run_sync(layers.remove, snapshot_id)
            raise
        return ProviderSnapshot(
            snapshot_id, self.provider, size + image_bytes,
            {"image": f"{repository}:{snapshot_id}", "image_id": str(image_id)},
        )

    def _commit(
        self, snapshot_id: str, diff: bool, repository: str, labels: Mapping[str, str],
        *, stopped: bool = False,
    ) -> str:
        """The container's file system as the snapshot's image (a suspended
        sandbox's is its suspend image, tagged); its id."""
        api = engine()
        base = self.suspended_image or self.base_image
        if self.container_id is None:
            api.tag(base, repository, snapshot_id)
            return base
        return commit_state(api, self.container_id, base, repository, snapshot_id, labels,
                            flatten=not diff, stopped=stopped)

    def _current_chain(self) -> list[str] | None:
        if self.layered:
            self.chain = layers.mounted_chain(self.sandbox_id)
        return self.chain

    def _freeze_and_commit(
        self, snapshot_id: str, diff: bool, repository: str, labels: Mapping[str, str]
    ) -> tuple[int, str] | None:
        """Capture the layered working directory by moving what changed into
        the snapshot (``layers.freeze``), and commit the container, in one
        stop of it (paused as by docker pause, unless it is already): a
        process that wrote in the directory during the move would write into
        the snapshot, or be lost, and the two are taken at the same instant.
        (size, image id), or None when a process holds the directory (the
        caller copies it, with the container running). Blocking."""
        api = engine()
        container = self.container_id

        def freeze_then_commit(holder: int | None) -> tuple[int, str] | None:
            if not layers.freeze(snapshot_id, self.sandbox_id, flatten=not diff,
                                  holder=holder):
                return None
            self._current_chain()
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                # Counting the layer's size (a stat a file) while the commit runs.
                size = pool.submit(layers.layer_size, snapshot_id)
                try:
                    image_id = self._commit(snapshot_id, diff, repository, labels, stopped=True)
                except BaseException:
                    layers.remove(snapshot_id)  # the sandbox goes on over its layer
                    raise
                return size.result(), image_id

        if container is None:
            return freeze_then_commit(None)
        # Held across the pause: a program that dies inside it leaves the
        # container paused and the marker saying so, for the next one that
        # takes the lock (``_mend_capture_cut_short``) to unpause.
        with layers.sandbox_lock(self.sandbox_id):
            state = api.inspect_container(container)["State"]
            holder = int(state.get("Pid") or 0) or None
            if not state.get("Running"):
                return freeze_then_commit(holder)
            # Not the Engine's "Paused" (it lags): the guard knows whose pause it is.
            with freeze_guard(container).frozen(api, container,
                                                marker=self._paused_for_capture()):
                fault_point("snapshot.docker.frozen-layered")
                return freeze_then_commit(holder)

    def _paused_for_capture(self) -> str:
        return os.path.join(layers.mount_dir(self.sandbox_id), "paused-for-capture")

    async def _mend_capture_cut_short(self) -> None:
        """A program that died in the middle of a capture may have left the
        working directory unmounted (its freeze's journal says how far it
        got) and the container paused: both put right, the directory first."""
        import docker.errors

        def mend() -> None:
            with layers.sandbox_lock(self.sandbox_id):
                if layers.mounted_chain(self.sandbox_id) is None:
                    return  # its directory is gone: nothing to mend
                if self.container_id is None:
                    layers.rest(self.sandbox_id)  # suspended: its directory at rest
                else:
                    layers.after_start(self.sandbox_id)
                marker = self._paused_for_capture()
                if os.path.exists(marker):
                    if self.container_id is not None:
                        with contextlib.suppress(docker.errors.APIError):
                            freeze_guard(self.container_id).unpause(engine(), self.container_id)
                    os.unlink(marker)

        await _call(mend)

    async def _container_exists(self) -> bool:
        import docker.errors

        def probe() -> bool:
            try:
                engine().inspect_container(self.container_id)
            except docker.errors.NotFound:
                return False
            return True

        exists: bool = await _call(probe)
        return exists

    @classmethod
    async def remove_snapshot(cls, snapshot: ProviderSnapshot) -> None:
        import docker.errors

        api = engine()
        reference = f"{snapshot_repository()}:{snapshot.snapshot_id}"

        def untag() -> None:
            # Untagged, not forced: layers a branch's container or a child
            # snapshot still stands on stay until they go.
            try:
                api.remove_image(reference, noprune=False)
            except docker.errors.NotFound:
                pass
            except docker.errors.APIError as exc:
                if _status(exc) != 409:
                    raise
                api.remove_image(reference, force=True)  # in use: untag only

        # Bounded: an Engine wedged on a paused container's lock makes image
        # removal wait; the image is then left, still listed by
        # held_snapshots, for the next reconciliation to free.
        def untag_and_free() -> None:
            untag()
            free_untagged_images(api)

        with anyio.move_on_after(SNAPSHOT_REMOVAL_TIMEOUT) as scope:
            try:
                await anyio.to_thread.run_sync(untag_and_free, abandon_on_cancel=True)
            except docker.errors.DockerException as exc:
                raise ProviderError(f"docker: removing {reference}: {exc}") from None
        if scope.cancelled_caught:
            log.warning("removing snapshot image %s: the Docker Engine did not answer in "
                        "%.0f s; left for the next reconciliation", reference,
                        SNAPSHOT_REMOVAL_TIMEOUT)
        await anyio.to_thread.run_sync(layers.remove, snapshot.snapshot_id)

    @classmethod
    async def held_snapshots(cls) -> list[str]:
        api = engine()
        repository = snapshot_repository()
        images = await _call(api.images, repository)
        return sorted(
            tag.partition(":")[2] for image in images for tag in image.get("RepoTags") or []
            if tag.startswith(repository + ":")
        )

    @classmethod
    async def discard(cls, sandbox_id: str) -> None:
        import docker.errors

        api = engine()
        name = f"hutch-{sandbox_id}"

        def remove() -> None:
            try:
                labels = api.inspect_container(name)["Config"]["Labels"] or {}
            except docker.errors.NotFound:
                return
            ours = labels.get(SANDBOX_LABEL) == sandbox_id
            if ours and labels.get(HOME_LABEL) == hutch_home():
                api.remove_container(name, force=True)
                with contextlib.suppress(ProviderError):
                    netguard.release(sandbox_id)

        await _call(remove)
        await anyio.to_thread.run_sync(layers.end_branch, sandbox_id)
        await anyio.to_thread.run_sync(_release_own_dir, sandbox_id)

    @classmethod
    async def reap_orphans(cls, known: set[str]) -> list[str]:
        api = engine()
        home = hutch_home()
        containers = await _call(
            api.containers, all=True, filters={"label": [f"{MANAGED_LABEL}=1",
                                                         f"{HOME_LABEL}={home}"]},
        )
        removed = []
        for container in containers:
            labels = container.get("Labels") or {}
            sandbox_id = labels.get(SANDBOX_LABEL, "")
            if sandbox_id in known or labels.get(PRESERVE_LABEL) == "1":
                continue
            with contextlib.suppress(HutchError):
                await _call(api.remove_container, container["Id"], force=True)
                drop_start_locks(container["Id"])
                if sandbox_id:
                    with contextlib.suppress(ProviderError):
                        await anyio.to_thread.run_sync(netguard.release, sandbox_id)
                removed.append(sandbox_id or container["Id"][:12])
        with contextlib.suppress(HutchError):
            for sandbox_id in await _call(netguard.sweep, api, "hutch-"):
                removed.append(f"{sandbox_id} (its network policy's host rules)")
        for sandbox_id in await anyio.to_thread.run_sync(layers.branches):
            if sandbox_id not in known:
                await anyio.to_thread.run_sync(layers.end_branch, sandbox_id)
        for sandbox_id in await anyio.to_thread.run_sync(_capped_sandbox_dirs):
            if sandbox_id not in known:
                await anyio.to_thread.run_sync(_release_own_dir, sandbox_id)
                removed.append(f"{sandbox_id} (its capped working directory)")
        # Snapshot images untagged while their branches ran, now unused.
        with contextlib.suppress(HutchError):
            await _call(free_untagged_images, api)
        return removed
