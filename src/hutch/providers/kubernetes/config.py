"""The ``kubernetes`` provider's settings."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import ConfigDict, Field

from ..base import ProviderSettings
from ..policy import ReachesHost


class KubernetesConfig(ProviderSettings):
    """Which cluster, which namespace, what the pod runs. With no
    ``kubeconfig`` and ``in_cluster`` false, the kubeconfig is found as
    kubectl finds it (``$KUBECONFIG``, ``~/.kube/config``)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    type: Literal["kubernetes"] = "kubernetes"
    #: Through the daemon these reach its host (a file of the caller's
    #: choosing, the daemon's own service account): the operator's to allow.
    kubeconfig: Annotated[
        str | None, ReachesHost("reads a host file of the caller's choosing as a kubeconfig")
    ] = None
    #: The kubeconfig's context (its current one when unset).
    context: str | None = None
    #: Use the pod's service account (hutch running inside the cluster).
    in_cluster: Annotated[
        bool, ReachesHost("acts with the daemon's own service account", lambda v: not v)
    ] = False
    #: The namespace (the context's when unset, else ``default``).
    namespace: str | None = None
    image: str = "debian:bookworm-slim"
    #: The working directory (made if missing).
    workdir: str = "/workspace"
    env: dict[str, str] = {}
    #: How long a new pod may take to be ready, seconds.
    ready_timeout: float = Field(default=120.0, gt=0, le=3600)
    #: The working directory on a PersistentVolumeClaim of its own, so that
    #: suspend deletes the pod and keeps the files (and resume starts a new
    #: pod on them); false: the pod's own file system, gone with the pod,
    #: and the sandbox cannot suspend.
    persistent: bool = True
    #: The claim's requested size (a Kubernetes quantity).
    volume_size: str = Field(default="1Gi", pattern=r"^[0-9]+(\.[0-9]+)?([KMGTPE]i?|[kmgtpe])?$")
    #: The VolumeSnapshotClass of snapshots where the cluster offers
    #: ``snapshot.storage.k8s.io`` (its default class when unset);
    #: elsewhere snapshots are the working directory as an archive.
    snapshot_class: str | None = None
