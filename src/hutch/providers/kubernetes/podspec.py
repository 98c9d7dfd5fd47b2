"""The Pod hutch makes for a sandbox, from the provider's settings."""

from __future__ import annotations

from lightkube.models.core_v1 import (
    Capabilities,
    Container,
    EnvVar,
    LocalObjectReference,
    PersistentVolumeClaimVolumeSource,
    PodSpec,
    ResourceRequirements,
    SeccompProfile,
    SecurityContext,
    Toleration,
    Volume,
    VolumeMount,
)
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import Pod

from ..policy import parse_bytes
from .api import CONTAINER, SANDBOX_ID_ANNOTATION, labels
from .config import KubernetesConfig

#: The pod's volume that holds the working directory.
WORKDIR_VOLUME = "workdir"

#: What the pod's container may not do, whatever the cluster's defaults: the
#: docker provider's rule (the runtime's default capabilities less raw
#: sockets, mknod, audit writes, chroot and file capabilities; no setuid
#: program raises a user; the runtime's default seccomp filter).
SECURITY_CONTEXT = SecurityContext(
    capabilities=Capabilities(drop=["NET_RAW", "MKNOD", "AUDIT_WRITE", "SYS_CHROOT", "SETFCAP"]),
    allowPrivilegeEscalation=False,
    privileged=False,
    seccompProfile=SeccompProfile(type="RuntimeDefault"),
)


def resources(config: KubernetesConfig) -> ResourceRequirements | None:
    """The container's limits from hutch's (requests default to them: the
    pod is scheduled where they fit, and its QoS class is Guaranteed)."""
    limits = {}
    if config.memory is not None:
        limits["memory"] = str(int(parse_bytes(config.memory)))
    if config.cpus is not None:
        limits["cpu"] = f"{max(1, round(config.cpus * 1000))}m"
    return ResourceRequirements(limits=limits) if limits else None


def sandbox_pod(config: KubernetesConfig, sandbox_id: str, name: str,
                keeper: list[str], claim: str | None = None) -> Pod:
    """The pod: one container running ``keeper`` (commands come in through
    exec), labelled with the sandbox and hutch's home, placed and pulled as
    the settings say, its working directory on ``claim`` if given."""
    volumes, mounts = [], []
    if claim is not None:
        volumes.append(Volume(name=WORKDIR_VOLUME, persistentVolumeClaim=(
            PersistentVolumeClaimVolumeSource(claimName=claim))))
        mounts.append(VolumeMount(name=WORKDIR_VOLUME, mountPath=config.workdir))
    return Pod(
        metadata=ObjectMeta(name=name, labels=labels(sandbox_id),
                            annotations={SANDBOX_ID_ANNOTATION: sandbox_id}),
        spec=PodSpec(
            restartPolicy="Never", terminationGracePeriodSeconds=0,
            containers=[Container(
                name=CONTAINER, image=config.image, command=keeper,
                env=[EnvVar(name=k, value=v) for k, v in config.env.items()],
                securityContext=SECURITY_CONTEXT,
                volumeMounts=mounts or None,
                resources=resources(config),
            )],
            volumes=volumes or None,
            # The service account's token stays out of reach of what runs inside.
            automountServiceAccountToken=False,
            nodeSelector=dict(config.node_selector) or None,
            tolerations=[
                Toleration(key=t.key, operator=t.operator, value=t.value, effect=t.effect,
                           tolerationSeconds=t.toleration_seconds)
                for t in config.tolerations] or None,
            imagePullSecrets=[LocalObjectReference(name=s)
                              for s in config.image_pull_secrets] or None,
        ),
    )
