"""The ``kubernetes`` provider's settings.

Which of them an API client may set through the daemon is the operator's
call (:mod:`hutch.daemon.policy`): the cluster's credentials are the daemon
host's (a kubeconfig file, its default one, its service account), and where a
pod runs (namespace, nodes, tolerations), what it pulls with (image pull
secrets) and what its storage costs (storage class) are spent with them.
Each is refused to a client unless the operator allows it by name (``hutch
serve --allow node_selector``) or set it in the server's sandbox defaults.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..base import ProviderSettings
from ..policy import (
    HostPath,
    Limit,
    MemorySize,
    NotBool,
    OperatorsChoice,
    ReachesHost,
    format_bytes,
    parse_bytes,
)

#: A Kubernetes object name (RFC 1123 DNS subdomain), as secrets and storage
#: classes are named.
_OBJECT_NAME = r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$"
#: A namespace (RFC 1123 DNS label).
_NAMESPACE = r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$"


def _uses_service_account(config: Any) -> bool:
    return bool(getattr(config, "in_cluster", False))


class Toleration(BaseModel):
    """One of the pod's tolerations (``core/v1`` Toleration)."""

    model_config = ConfigDict(extra="forbid")

    key: str | None = Field(default=None, max_length=316)
    operator: Literal["Exists", "Equal"] = "Equal"
    value: str | None = Field(default=None, max_length=63)
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    #: How long a NoExecute taint is tolerated, seconds (forever when unset).
    toleration_seconds: int | None = Field(default=None, ge=0)

    @model_validator(mode="after")
    def _exists_has_no_value(self) -> Toleration:
        if self.operator == "Exists" and self.value:
            raise ValueError("a toleration with operator Exists takes no value")
        if self.key is None and self.operator != "Exists":
            raise ValueError("a toleration without a key must use operator Exists")
        return self


class KubernetesConfig(ProviderSettings):
    """Which cluster, which namespace, what the pod runs and where.

    The cluster is reached with ``kubeconfig`` (a file; its ``context``), or
    with the pod's own service account (``in_cluster``); with neither, the
    daemon user's default kubeconfig (``$KUBECONFIG``, else
    ``~/.kube/config``), never the service account unasked."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    type: Literal["kubernetes"] = "kubernetes"
    #: Through the daemon these reach its host (a file of the caller's
    #: choosing, or the daemon user's own kubeconfig, or the daemon's service
    #: account): the operator's to allow. Unset reaches the host too (the
    #: default kubeconfig) unless ``in_cluster``.
    kubeconfig: Annotated[
        str | None,
        ReachesHost("reads a kubeconfig on the daemon's host (unset: the daemon user's own)",
                    safe_in=_uses_service_account),
        HostPath(),
    ] = None
    #: The kubeconfig's context (its current one when unset): another
    #: context may be another cluster, so it is the operator's too.
    context: Annotated[
        str | None,
        OperatorsChoice("picks a context (a cluster, a user) of the operator's kubeconfig"),
    ] = None
    #: Use the pod's service account (hutch running inside the cluster).
    in_cluster: Annotated[
        bool, ReachesHost("acts with the daemon's own service account", lambda v: not v)
    ] = False
    #: The namespace (the context's when unset, else ``default``).
    namespace: Annotated[
        str | None, OperatorsChoice("picks the namespace pods are made in"),
        Field(pattern=_NAMESPACE),
    ] = None
    #: The PersistentVolumeClaims' storage class (the cluster's default when unset).
    storage_class: Annotated[
        str | None, OperatorsChoice("picks the storage class (and its cost) of the volumes"),
        Field(pattern=_OBJECT_NAME),
    ] = None
    #: Secrets (in the namespace) the kubelet pulls the image with.
    image_pull_secrets: Annotated[
        list[Annotated[str, Field(pattern=_OBJECT_NAME)]],
        OperatorsChoice("pulls images with the operator's registry credentials"),
        Field(max_length=16),
    ] = []
    #: Labels a node must carry to run the pod.
    node_selector: Annotated[
        dict[str, str], OperatorsChoice("picks the nodes pods run on"),
        Field(max_length=32),
    ] = {}
    #: Taints the pod tolerates (nodes it may be put on despite them).
    tolerations: Annotated[
        list[Toleration], OperatorsChoice("lets pods onto tainted (reserved) nodes"),
        Field(max_length=32),
    ] = []
    image: str = "debian:bookworm-slim"
    #: The container's memory limit (``512m``, ``2g``): the kubelet's cgroup
    #: holds it; through the daemon its default and ceiling apply.
    memory: Annotated[MemorySize | None, Limit("memory", parse_bytes, format_bytes)] = None
    #: The container's CPU limit, in CPUs (``0.5``).
    cpus: Annotated[float | None, Limit("cpus"), NotBool] = Field(default=None, gt=0, le=1024)
    #: The working directory (made if missing).
    workdir: str = "/workspace"
    env: dict[str, str] = {}
    #: ``agent``: hutch's agent is the pod's keeper (copied in over exec at
    #: its start), and exec, files, grep, glob and processes go through it
    #: on one kept ``pods/exec``; ``native``: a ``pods/exec`` per command,
    #: files through commands; ``auto``: the agent where it is built here.
    runtime: Literal["auto", "agent", "native"] = "auto"
    #: How long a new pod may take to be ready, seconds.
    ready_timeout: float = Field(default=120.0, gt=0, le=3600)
    #: The working directory on a PersistentVolumeClaim of its own, so that
    #: suspend deletes the pod and keeps the files (and resume starts a new
    #: pod on them); false: the pod's own file system, gone with the pod,
    #: and the sandbox cannot suspend.
    persistent: bool = True
    #: The claim's requested size (a Kubernetes quantity; unset: 1Gi).
    volume_size: Annotated[
        str | None, OperatorsChoice("sizes the volumes (and their cost)"),
        Field(pattern=r"^[0-9]+(\.[0-9]+)?([KMGTPE]i?|[kmgtpe])?$"),
    ] = None
    #: The VolumeSnapshotClass of snapshots where the cluster offers
    #: ``snapshot.storage.k8s.io`` (its default class when unset);
    #: elsewhere snapshots are the working directory as an archive.
    snapshot_class: Annotated[
        str | None, OperatorsChoice("picks the snapshot class (and its cost) of snapshots"),
        Field(pattern=_OBJECT_NAME),
    ] = None

    @model_validator(mode="after")
    def _one_source_of_credentials(self) -> KubernetesConfig:
        if self.in_cluster and (self.kubeconfig or self.context):
            raise ValueError("in_cluster uses the service account: kubeconfig and context "
                             "do not apply")
        return self
