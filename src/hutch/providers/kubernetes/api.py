"""The API server, through lightkube: the client, the pod hutch makes, and
the two calls lightkube does not shape (a delete with a UID precondition and
the ``pods/exec`` WebSocket), made on an httpx client with lightkube's own
connection settings (server, TLS, credentials)."""

from __future__ import annotations

import hashlib
import os
from typing import TYPE_CHECKING, Any

from ..._errors import InvalidArgument, ProviderError
from ..._lazy import lazy_module
from ..._paths import hutch_home
from .config import KubernetesConfig

if TYPE_CHECKING:
    import httpx2
    import lightkube
    from lightkube.config import client_adapter
    from lightkube.config.kubeconfig import SingleConfig
else:  # imported at their first use: see hutch._lazy
    httpx2 = lazy_module("httpx2")
    lightkube = lazy_module("lightkube")
    client_adapter = lazy_module("lightkube.config.client_adapter")

#: The label naming the hutch sandbox a pod serves, and the hutch home it
#: belongs to (daemons sharing a cluster never touch each other's pods).
SANDBOX_LABEL = "hutch.dev/sandbox"
HOME_LABEL = "hutch.dev/home"
#: The sandbox's id as it is (a label value is lower-cased, for its name's sake).
SANDBOX_ID_ANNOTATION = "hutch.dev/sandbox-id"
CONTAINER = "sandbox"
SNAPSHOT_API = "snapshot.storage.k8s.io/v1"


def home_selector() -> str:
    """The label selector of what this hutch home made."""
    return f"{HOME_LABEL}={home_tag()}"


def labels(sandbox_id: str) -> dict[str, str]:
    return {SANDBOX_LABEL: sandbox_id.lower(), HOME_LABEL: home_tag()}


def ours(obj: dict[str, Any] | None, sandbox_id: str) -> bool:
    """Whether ``obj`` is one this home made for ``sandbox_id``."""
    found = ((obj or {}).get("metadata") or {}).get("labels") or {}
    return found == {**found, **labels(sandbox_id)}


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
                single = lightkube.KubeConfig.from_service_account().get()
            else:
                single = lightkube.KubeConfig.from_file(
                    config.kubeconfig or default_kubeconfig()).get(config.context)
        except Exception as exc:  # lightkube's ConfigError, a missing file, bad YAML
            raise InvalidArgument(f"the kubernetes configuration cannot be read: {exc}") from exc
        if single is None:
            raise InvalidArgument(f"no kubeconfig context {config.context!r}")
        self.single: SingleConfig = single
        self.namespace = config.namespace or single.namespace or "default"
        self.client = lightkube.AsyncClient(config=single, namespace=self.namespace)
        self.http: httpx2.AsyncClient = client_adapter.AsyncClient(
            single, client_adapter.ConnectionParams())
        self._snapshots: bool | None = None

    def pod_path(self, name: str) -> str:
        return f"/api/v1/namespaces/{self.namespace}/pods/{name}"

    def kind_path(self, kind: str, name: str = "") -> str:
        """The path of ``kind`` (``pods``, ``persistentvolumeclaims``,
        ``volumesnapshots``) in the namespace, or of one object of it."""
        group = (f"/apis/{SNAPSHOT_API}" if kind == "volumesnapshots" else "/api/v1")
        return f"{group}/namespaces/{self.namespace}/{kind}" + (f"/{name}" if name else "")

    async def call(self, method: str, path: str, *, body: Any = None,
                   params: dict[str, str] | None = None) -> dict[str, Any] | None:
        """One API call; its JSON answer, None where the object is not
        there (404); ProviderError for any other failure, with the server's word."""
        try:
            response = await self.http.request(method, path, json=body, params=params)
        except httpx2.HTTPError as exc:
            raise ProviderError(f"{method} {path} failed: {exc}") from exc
        if response.status_code == 404:
            return None
        if response.status_code >= 300:
            try:
                said = response.json().get("message") or response.text
            except ValueError:
                said = response.text
            raise ProviderError(f"{method} {path} failed: {response.status_code} {said[:500]}")
        answer: dict[str, Any] = response.json()
        return answer

    async def get(self, kind: str, name: str) -> dict[str, Any] | None:
        return await self.call("GET", self.kind_path(kind, name))

    async def listed(self, kind: str, selector: str) -> dict[str, Any]:
        """The list of ``kind`` matching the label ``selector`` (with its resourceVersion)."""
        listed = await self.call("GET", self.kind_path(kind), params={"labelSelector": selector})
        return listed or {"items": [], "metadata": {}}

    async def delete(self, kind: str, name: str, uid: str | None) -> None:
        """Foreground deletion, only of the object ``uid`` names (one of the
        same name made since is someone else's); gone already is done."""
        body: dict[str, Any] = {"kind": "DeleteOptions", "apiVersion": "v1",
                                "propagationPolicy": "Foreground", "gracePeriodSeconds": 0}
        if uid:
            body["preconditions"] = {"uid": uid}
        try:
            response = await self.http.request(
                "DELETE", self.kind_path(kind, name), json=body)
        except httpx2.HTTPError as exc:
            raise ProviderError(f"deleting {kind} {name} failed: {exc}") from exc
        if response.status_code in (200, 202, 404):
            return
        if response.status_code == 409 and uid:
            return  # the precondition failed: what is there now is not the one meant
        raise ProviderError(f"deleting {kind} {name} failed: {response.status_code} "
                            f"{response.text[:500]}")

    async def delete_pod(self, name: str, uid: str | None) -> None:
        await self.delete("pods", name, uid)

    async def offers_snapshots(self) -> bool:
        """Whether the cluster serves ``snapshot.storage.k8s.io/v1`` (a CSI
        snapshotter is installed), asked once."""
        if self._snapshots is None:
            found = await self.call("GET", f"/apis/{SNAPSHOT_API}") or {}
            self._snapshots = any(
                r.get("name") == "volumesnapshots" for r in found.get("resources") or [])
        return self._snapshots

    async def close(self) -> None:
        await self.http.aclose()
        await self.client.close()
