"""The API server, through lightkube: the client, the pod hutch makes, and
the two calls lightkube does not shape (a delete with a UID precondition and
the ``pods/exec`` WebSocket), made on an httpx client with lightkube's own
connection settings (server, TLS, credentials)."""

from __future__ import annotations

import hashlib
import os
from typing import Any

import httpx2
from lightkube import AsyncClient, KubeConfig
from lightkube.config.client_adapter import AsyncClient as adapted_http_client
from lightkube.config.client_adapter import ConnectionParams
from lightkube.config.kubeconfig import SingleConfig

from ..._errors import InvalidArgument, ProviderError
from ..._paths import hutch_home
from .config import KubernetesConfig

#: The label naming the hutch sandbox a pod serves, and the hutch home it
#: belongs to (daemons sharing a cluster never touch each other's pods).
SANDBOX_LABEL = "hutch.dev/sandbox"
HOME_LABEL = "hutch.dev/home"
CONTAINER = "sandbox"


def home_tag() -> str:
    home = os.path.realpath(hutch_home()).encode()
    return hashlib.sha256(home).hexdigest()[:16]


def default_kubeconfig() -> str:
    """The kubeconfig kubectl reads: ``$KUBECONFIG``'s first file, else
    ``~/.kube/config``. Never the service account unasked (lightkube's
    ``from_env`` tries that first: in a pod, ``in_cluster`` would not be
    the operator's choice any more)."""
    listed = [p for p in os.environ.get("KUBECONFIG", "").split(os.pathsep) if p]
    return listed[0] if listed else os.path.expanduser("~/.kube/config")


def pod_name(sandbox_id: str) -> str:
    return "hutch-" + sandbox_id.lower().replace("_", "-")[:50]


class Cluster:
    """One connection to the API server: lightkube's client and an httpx one."""

    def __init__(self, config: KubernetesConfig) -> None:
        try:
            if config.in_cluster:
                single = KubeConfig.from_service_account().get()
            else:
                single = KubeConfig.from_file(
                    config.kubeconfig or default_kubeconfig()).get(config.context)
        except Exception as exc:  # lightkube's ConfigError, a missing file, bad YAML
            raise InvalidArgument(f"the kubernetes configuration cannot be read: {exc}") from exc
        if single is None:
            raise InvalidArgument(f"no kubeconfig context {config.context!r}")
        self.single: SingleConfig = single
        self.namespace = config.namespace or single.namespace or "default"
        self.client = AsyncClient(config=single, namespace=self.namespace)
        self.http: httpx2.AsyncClient = adapted_http_client(single, ConnectionParams())

    def pod_path(self, name: str) -> str:
        return f"/api/v1/namespaces/{self.namespace}/pods/{name}"

    async def delete_pod(self, name: str, uid: str | None) -> None:
        """Foreground deletion, only of the pod ``uid`` names (a pod of the
        same name made since is someone else's); gone already is done."""
        body: dict[str, Any] = {"kind": "DeleteOptions", "apiVersion": "v1",
                                "propagationPolicy": "Foreground", "gracePeriodSeconds": 0}
        if uid:
            body["preconditions"] = {"uid": uid}
        try:
            response = await self.http.request("DELETE", self.pod_path(name), json=body)
        except httpx2.HTTPError as exc:
            raise ProviderError(f"deleting pod {name} failed: {exc}") from exc
        if response.status_code in (200, 202, 404):
            return
        raise ProviderError(f"deleting pod {name} failed: {response.status_code} "
                            f"{response.text[:500]}")

    async def close(self) -> None:
        await self.http.aclose()
        await self.client.close()
