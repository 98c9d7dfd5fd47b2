"""The Pod hutch makes for a sandbox, from the provider's settings."""

from __future__ import annotations

from lightkube.models.core_v1 import (
    Capabilities,
    Container,
    EnvVar,
    LocalObjectReference,
    PodSpec,
    SeccompProfile,
    SecurityContext,
    Toleration,
)
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import Pod

from .api import CONTAINER, HOME_LABEL, SANDBOX_LABEL, home_tag
from .config import KubernetesConfig

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


def sandbox_pod(config: KubernetesConfig, sandbox_id: str, name: str,
                keeper: list[str]) -> Pod:
    """The pod: one container running ``keeper`` (commands come in through
    exec), labelled with the sandbox and hutch's home, placed and pulled as
    the settings say."""
    return Pod(
        metadata=ObjectMeta(name=name, labels={SANDBOX_LABEL: sandbox_id.lower(),
                                               HOME_LABEL: home_tag()}),
        spec=PodSpec(
            restartPolicy="Never", terminationGracePeriodSeconds=0,
            containers=[Container(
                name=CONTAINER, image=config.image, command=keeper,
                env=[EnvVar(name=k, value=v) for k, v in config.env.items()],
                securityContext=SECURITY_CONTEXT,
            )],
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
