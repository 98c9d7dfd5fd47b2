"""A stand-in for a Kubernetes API server, for the ``kubernetes`` provider's tests.

No API server can be installed on the machines these tests run on, so this
serves the part of the API's documented contract the provider uses, for one
namespace:

- Pods, PersistentVolumeClaims and (with ``snapshots=True``, as a cluster
  with a CSI snapshotter has them) ``snapshot.storage.k8s.io/v1``
  VolumeSnapshots: create, get, list, delete, by label selector (``k=v``
  terms); ``metadata.resourceVersion`` (one counter for every object, as
  etcd's revision) and ``uid`` set by the server; 409 AlreadyExists on a
  create of a name that exists; 409 Conflict on a delete whose
  ``preconditions.uid`` does not match; 404 NotFound as a ``Status``;
  discovery of the snapshot group (``GET /apis/snapshot.storage.k8s.io/v1``,
  404 where the cluster has none).
- Watches (``?watch=true``) as the API streams them: one JSON event a line,
  ADDED / MODIFIED / DELETED from the ``resourceVersion`` given (the current
  objects as ADDED when none is given), BOOKMARK events carrying the latest
  resourceVersion when ``allowWatchBookmarks`` is asked (every
  ``bookmark_interval`` seconds), ``timeoutSeconds`` honoured, and an ERROR
  event with a 410 ``Expired`` Status for a resourceVersion older than the
  history kept (:meth:`compact` drops it, as etcd's compaction does).
- A pod's ``persistentVolumeClaim`` volumes mounted where its container
  says; a pod whose claim is missing stays Pending (unschedulable), as the
  scheduler leaves it. A claim in use is deleted only once no pod uses it
  (the ``kubernetes.io/pvc-protection`` finalizer). A claim whose
  ``dataSource`` is a VolumeSnapshot starts with the snapshot's files.
- Scheduling, the scheduler's rule on one node (``standin-node``, with the
  labels and taints given): a pod whose ``nodeSelector`` the node's labels
  do not match, or that does not tolerate one of its NoSchedule or NoExecute
  taints, stays Pending with ``PodScheduled`` False (``Unschedulable``); a
  pod that fits gets ``spec.nodeName``. Image pull secrets are kept, not used.
- The kubelet's part: a pod's container really runs (a local docker
  container of the pod's image and command; a claim is a docker volume, its
  data kept while the claim is); a container that dies makes its pod
  Failed or Succeeded (a MODIFIED event); :meth:`evict` is a node-pressure
  eviction (the container killed, the pod Failed with reason ``Evicted``);
  a container's memory and CPU limits are its docker container's, as the
  kubelet's cgroup holds them.
- ``pods/{name}/exec`` over WebSocket with the ``v5.channel.k8s.io`` (and
  ``v4``) subprotocol: one channel byte per frame (0 stdin, 1 stdout,
  2 stderr, 3 the final ``Status`` as JSON, 255 close, v5 only), reaching a
  real process (``docker exec``); a client that goes ends the command's
  stdin. ``protocols=("v4.channel.k8s.io",)`` is an API server before 1.30.
  ``exec_fault`` serves the failures a real cluster's exec has (see
  :class:`ExecFault`) for the commands a test picks.
- ``pods/{name}/portforward`` over WebSocket (``v4.channel.k8s.io`` or
  ``portforward.k8s.io``), as the API server relays it to the kubelet: one
  ``?ports=`` port per WebSocket here, one TCP connection to the pod's port
  (the docker container's address); channel 0 its data, channel 1 its
  errors, the server's first frame on each the port as two little-endian
  bytes; a connection refused is said on the error channel, and the
  WebSocket closes when the pod's side of the connection ends.
- Services: create, get, list, delete as any object, ``spec.clusterIP``
  set by the server (kube-proxy's routing to the selected pods is not
  served: nothing in the cluster calls the Service here).

Not covered: authentication, admission, scheduling across nodes, graceful
termination periods (every delete is immediate), other kinds, patch and
update. Every behaviour here is one the real API server has.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import docker
from aiohttp import WSMsgType, web

from hutch.providers.docker.process import read_ahead

#: The label of the docker containers and volumes the stand-in makes: the
#: hutch home of the tests that made them (the suite's leftover check reads it).
STANDIN_LABEL = "hutch-test.kube-standin"
PROTOCOLS = ("v5.channel.k8s.io", "v4.channel.k8s.io")
SNAPSHOT_GROUP = "snapshot.storage.k8s.io"
NODE = "standin-node"
_KINDS = {"pods": "Pod", "persistentvolumeclaims": "PersistentVolumeClaim",
          "volumesnapshots": "VolumeSnapshot", "services": "Service"}
PORTFORWARD_PROTOCOLS = ("v4.channel.k8s.io", "portforward.k8s.io")


@dataclass(frozen=True)
class ExecFault:
    """A ``pods/exec`` that does not run as asked, as real clusters have
    them: the API server's Failure ``Status`` on channel 3 and no output
    (``status_message``: the kubelet unreachable, "error dialing backend"),
    the WebSocket closed with no Status (``close_code``, ``close_reason``:
    the API server or a proxy on the way going away), its connection dropped
    with no close at all (``drop``), or ``command`` run instead (an image
    that lacks what the command needs)."""

    status_message: str = ""
    close_code: int = 1000
    close_reason: str = ""
    drop: bool = False
    command: list[str] | None = None


def _json(obj: Any, status: int = 200) -> web.Response:
    # The API server's Content-Type is exactly application/json (no charset):
    # clients (lightkube) read a Status as one only then.
    return web.Response(body=json.dumps(obj).encode(), status=status,
                        headers={"Content-Type": "application/json"})


def _status(code: int, reason: str, message: str) -> web.Response:
    return _json(_status_object(code, reason, message), status=code)


def _status_object(code: int, reason: str, message: str) -> dict[str, Any]:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": message, "reason": reason, "code": code}


def _selected(obj: dict[str, Any], selector: str) -> bool:
    wanted = dict(p.split("=", 1) for p in selector.split(",") if "=" in p)
    labels = obj["metadata"].get("labels") or {}
    return all(labels.get(k) == v for k, v in wanted.items())


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


_QUANTITY_SUFFIXES = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40,
                      "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "m": 1e-3}


def _quantity(text: str) -> float:
    """A resource.Quantity (``512Mi``, ``500m``, ``2``) as a number."""
    for suffix in sorted(_QUANTITY_SUFFIXES, key=len, reverse=True):
        if text.endswith(suffix):
            return float(text[:-len(suffix)]) * _QUANTITY_SUFFIXES[suffix]
    return float(text)


def _tolerates(toleration: dict[str, Any], taint: dict[str, str]) -> bool:
    """core/v1 Toleration's rule: the effect (if set) is the taint's; Exists
    matches the key (any key when unset), Equal the key and the value."""
    if toleration.get("effect") and toleration["effect"] != taint.get("effect"):
        return False
    if toleration.get("operator", "Equal") == "Exists":
        return not toleration.get("key") or toleration["key"] == taint.get("key")
    return (toleration.get("key") == taint.get("key")
            and (toleration.get("value") or "") == (taint.get("value") or ""))


class KubeStandin:
    """The server, on a loopback port, in a thread of its own."""

    def __init__(self, namespace: str = "default", node_labels: dict[str, str] | None = None,
                 node_taints: list[dict[str, str]] | None = None, *, snapshots: bool = False,
                 bookmark_interval: float = 1.0,
                 helper_image: str | None = None,
                 protocols: tuple[str, ...] = PROTOCOLS) -> None:
        self.namespace = namespace
        #: The exec subprotocols it speaks (an API server before 1.30 speaks v4, not v5).
        self.protocols = protocols
        #: The one node pods are scheduled on, as the scheduler does: its
        #: labels must match a pod's nodeSelector, and a pod must tolerate
        #: its NoSchedule and NoExecute taints; else the pod stays Pending.
        self.node_labels = {"kubernetes.io/hostname": NODE, "kubernetes.io/os": "linux",
                            **(node_labels or {})}
        self.node_taints = list(node_taints or [])
        self.snapshots = snapshots
        self.bookmark_interval = bookmark_interval
        #: The image of the short-lived containers that copy a volume's files.
        self.helper_image = helper_image or os.environ.get(
            "HUTCH_TEST_IMAGE", "hutch-test:bookworm")
        self.objects: dict[str, dict[str, dict[str, Any]]] = {k: {} for k in _KINDS}
        #: The kubeconfig written for it (write_kubeconfig), for the tests.
        self.kubeconfig = ""
        self.version = 0
        #: Every change since the last compaction: (resourceVersion, kind, type, object).
        self.history: list[tuple[int, str, str, dict[str, Any]]] = []
        self._compacted_at = 0
        self._watches: set[asyncio.Queue[tuple[str, str, dict[str, Any]] | None]] = set()
        self.docker = docker.from_env()
        self._loop = asyncio.new_event_loop()
        self.port = 0
        self._runner: web.AppRunner | None = None
        self._kubelet_stop = threading.Event()
        self._events: Any = None
        self._refreshing: set[asyncio.Future[None]] = set()
        #: Every pods/exec served, its command (as an audit log records them).
        self.execs: list[list[str]] = []
        self._open_execs: set[web.WebSocketResponse] = set()
        #: Given an exec's command, the fault to serve instead (None: serve it).
        self.exec_fault: Callable[[list[str]], ExecFault | None] | None = None

    # -- life of the server ----------------------------------------------------------
    def start(self) -> KubeStandin:
        app = web.Application()
        for base in ("/api/v1/namespaces/{ns}/{kind}",
                     f"/apis/{SNAPSHOT_GROUP}/v1/namespaces/{{ns}}/{{kind}}"):
            app.router.add_get(base, self.list)
            app.router.add_post(base, self.create)
            app.router.add_get(base + "/{name}", self.get)
            app.router.add_delete(base + "/{name}", self.delete)
        app.router.add_route("*", "/api/v1/namespaces/{ns}/{kind}/{name}/exec", self.exec)
        app.router.add_route("*", "/api/v1/namespaces/{ns}/{kind}/{name}/portforward",
                             self.portforward)
        app.router.add_get(f"/apis/{SNAPSHOT_GROUP}/v1", self.discovery)
        # A stop does not wait long for an exec still streaming: it closes them.
        self._runner = web.AppRunner(app, shutdown_timeout=5)
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        ready = threading.Event()

        async def serve() -> None:
            assert self._runner is not None
            await self._runner.setup()
            await web.SockSite(self._runner, sock).start()
            ready.set()

        threading.Thread(target=self._loop.run_forever, daemon=True).start()
        asyncio.run_coroutine_threadsafe(serve(), self._loop)
        ready.wait(10)
        threading.Thread(target=self._kubelet, daemon=True).start()
        return self

    def stop(self) -> None:
        self._kubelet_stop.set()
        if self._events is not None:
            self._events.close()
        self._call(self._end_watches())
        for pod in list(self.objects["pods"].values()):
            self._remove_container(pod)
        for kind in ("persistentvolumeclaims", "volumesnapshots"):
            for obj in list(self.objects[kind].values()):
                self._remove_volume(obj)
        self._call(self._end_execs())
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)

    async def _end_execs(self) -> None:
        """The API server goes away: its open exec streams are closed, as a
        real one's connections are."""
        for ws in list(self._open_execs):
            with contextlib.suppress(Exception):
                await ws.close(code=1001)

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(60)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def write_kubeconfig(self, path: str) -> str:
        config = {
            "apiVersion": "v1", "kind": "Config", "current-context": "standin",
            "clusters": [{"name": "standin", "cluster": {"server": self.url}}],
            "users": [{"name": "standin", "user": {"token": "standin-token"}}],
            "contexts": [{"name": "standin", "context": {
                "cluster": "standin", "user": "standin", "namespace": self.namespace}}],
        }
        with open(path, "w") as f:
            json.dump(config, f)  # JSON is YAML
        self.kubeconfig = path
        return path

    # -- what the tests do to the cluster, as its other actors would ---------------------
    def compact(self) -> None:
        """Drop the change history (etcd's compaction): a watch from an
        older resourceVersion is told 410 Gone."""
        async def compact() -> None:
            self.history.clear()
            self._compacted_at = self.version
        self._call(compact())

    def end_watches(self) -> None:
        """End every open watch (the API server restarted, or a watch's time ran out)."""
        self._call(self._end_watches())

    def evict(self, name: str, message: str = "The node was low on resource: memory.") -> None:
        """A node-pressure eviction by the kubelet: the pod's container is
        killed and the pod left Failed, reason ``Evicted``."""
        async def evict() -> None:
            pod = self.objects["pods"][name]
            pod["standin-evicted"] = message
            await asyncio.to_thread(self._remove_container, pod)
            self._set_status(pod, {"phase": "Failed", "reason": "Evicted", "message": message,
                                   "conditions": [{"type": "Ready", "status": "False"}]})
        self._call(evict())

    def delete_outside(self, kind: str, name: str) -> None:
        """Delete an object as another client of the API would (kubectl delete)."""
        async def delete() -> None:
            obj = self.objects[kind].get(name)
            if obj is not None:
                await self._delete(kind, obj)
        self._call(delete())

    # -- history and watches ---------------------------------------------------------
    def _next_version(self) -> str:
        self.version += 1
        return str(self.version)

    def _changed(self, kind: str, event: str, obj: dict[str, Any]) -> None:
        """Record a change (its resourceVersion already set) and tell the watches."""
        snapshot = self._public(obj)
        self.history.append((int(obj["metadata"]["resourceVersion"]), kind, event, snapshot))
        for queue in list(self._watches):
            queue.put_nowait((kind, event, snapshot))

    async def _end_watches(self) -> None:
        for queue in list(self._watches):
            queue.put_nowait(None)

    @staticmethod
    def _public(obj: dict[str, Any]) -> dict[str, Any]:
        return {k: copy.deepcopy(v) for k, v in obj.items() if not k.startswith("standin-")}

    async def _watch(self, request: web.Request, kind: str) -> web.StreamResponse:
        selector = request.query.get("labelSelector", "")
        since = request.query.get("resourceVersion", "")
        bookmarks = request.query.get("allowWatchBookmarks") in ("true", "1")
        timeout = float(request.query.get("timeoutSeconds") or 1800)
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(request)

        async def send(event: str, obj: dict[str, Any]) -> None:
            await response.write(json.dumps({"type": event, "object": obj}).encode() + b"\n")

        queue: asyncio.Queue[tuple[str, str, dict[str, Any]] | None] = asyncio.Queue()
        self._watches.add(queue)
        try:
            if since in ("", "0"):
                for obj in list(self.objects[kind].values()):
                    if _selected(obj, selector):
                        await send("ADDED", self._public(obj))
            else:
                start = int(since)
                if start < self._compacted_at:
                    await send("ERROR", _status_object(
                        410, "Expired",
                        f"too old resource version: {start} ({self._compacted_at})"))
                    return response
                for version, of_kind, event, obj in list(self.history):
                    if version > start and of_kind == kind and _selected(obj, selector):
                        await send(event, obj)
            ends = time.monotonic() + timeout
            while (left := ends - time.monotonic()) > 0:
                try:
                    item = await asyncio.wait_for(
                        queue.get(), min(left, self.bookmark_interval))
                except TimeoutError:
                    if bookmarks:
                        await send("BOOKMARK", {
                            "kind": _KINDS[kind], "apiVersion": "v1",
                            "metadata": {"resourceVersion": str(self.version)}})
                    continue
                if item is None:
                    break
                of_kind, event, obj = item
                if of_kind == kind and _selected(obj, selector):
                    await send(event, obj)
        except (ConnectionResetError, asyncio.CancelledError):
            pass
        finally:
            self._watches.discard(queue)
        return response

    # -- the REST side ---------------------------------------------------------------
    def _store(self, request: web.Request) -> dict[str, dict[str, Any]] | None:
        kind = request.match_info["kind"]
        snapshot_path = request.path.startswith("/apis/")
        if request.match_info["ns"] != self.namespace or kind not in self.objects:
            return None
        if snapshot_path != (kind == "volumesnapshots") or (snapshot_path and not self.snapshots):
            return None
        return self.objects[kind]

    async def discovery(self, request: web.Request) -> web.Response:
        if not self.snapshots:
            return _status(404, "NotFound", "the server could not find the requested resource")
        return _json({
            "kind": "APIResourceList", "apiVersion": "v1", "groupVersion": f"{SNAPSHOT_GROUP}/v1",
            "resources": [{"name": "volumesnapshots", "singularName": "volumesnapshot",
                           "namespaced": True, "kind": "VolumeSnapshot",
                           "verbs": ["create", "delete", "get", "list", "watch"]}]})

    async def list(self, request: web.Request) -> web.StreamResponse:
        store = self._store(request)
        if store is None:
            return _status(404, "NotFound", "the server could not find the requested resource")
        kind = request.match_info["kind"]
        if request.query.get("watch") in ("true", "1"):
            return await self._watch(request, kind)
        selector = request.query.get("labelSelector", "")
        items = [self._public(o) for o in store.values() if _selected(o, selector)]
        return _json({"kind": _KINDS[kind] + "List", "apiVersion": "v1",
                                  "metadata": {"resourceVersion": str(self.version)},
                                  "items": items})

    async def get(self, request: web.Request) -> web.Response:
        store = self._store(request)
        name = request.match_info["name"]
        if store is None or name not in store:
            return _status(404, "NotFound", f'{request.match_info["kind"]} "{name}" not found')
        return _json(self._public(store[name]))

    async def create(self, request: web.Request) -> web.Response:
        store = self._store(request)
        if store is None:
            return _status(404, "NotFound", "the server could not find the requested resource")
        obj = await request.json()
        kind = request.match_info["kind"]
        meta = obj.setdefault("metadata", {})
        name = meta.get("name")
        if not name:
            return _status(422, "Invalid", "metadata.name: Required value")
        if name in store:
            return _status(409, "AlreadyExists", f'{kind} "{name}" already exists')
        meta.update(namespace=self.namespace, uid=str(uuid.uuid4()),
                    creationTimestamp=_now())
        store[name] = obj
        try:
            if kind == "pods":
                claims = [self.objects["persistentvolumeclaims"].get(c) for c in _claims(obj)]
                unschedulable = self._unschedulable(obj) or (
                    "" if all(c is not None and "deletionTimestamp" not in c["metadata"]
                              for c in claims) else "persistentvolumeclaim not found")
                if unschedulable:
                    obj["status"] = {"phase": "Pending", "conditions": [{
                        "type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                        "message": f"0/1 nodes are available: 1 {unschedulable}."}]}
                else:
                    obj["spec"]["nodeName"] = NODE
                    await asyncio.to_thread(self._run_container, obj)
                    obj["status"] = await asyncio.to_thread(self._pod_status, obj)
            elif kind == "services":
                obj.setdefault("spec", {})["clusterIP"] = f"10.96.0.{len(store) % 250 + 2}"
            elif kind == "persistentvolumeclaims":
                await asyncio.to_thread(self._make_claim_volume, obj)
                obj["status"] = {"phase": "Bound"}
            else:
                source = self.objects["persistentvolumeclaims"].get(
                    (obj.get("spec", {}).get("source") or {}).get("persistentVolumeClaimName"))
                if source is None:
                    del store[name]
                    return _status(422, "Invalid", "spec.source: the claim does not exist")
                size = await asyncio.to_thread(self._copy_volume, source, obj)
                obj["status"] = {"readyToUse": True, "restoreSize": str(size),
                                 "creationTime": _now()}
        except docker.errors.APIError as exc:
            del store[name]
            return _status(422, "Invalid", f"the stand-in cannot make it: {exc}")
        meta["resourceVersion"] = self._next_version()
        self._changed(kind, "ADDED", obj)
        return _json(self._public(obj), status=201)

    async def delete(self, request: web.Request) -> web.Response:
        store = self._store(request)
        name = request.match_info["name"]
        kind = request.match_info["kind"]
        if store is None or name not in store:
            return _status(404, "NotFound", f'{kind} "{name}" not found')
        body = await request.json() if request.can_read_body else {}
        uid = (body.get("preconditions") or {}).get("uid")
        obj = store[name]
        if uid is not None and uid != obj["metadata"]["uid"]:
            return _status(409, "Conflict", (
                f"Precondition failed: UID in precondition: {uid}, "
                f"UID in object meta: {obj['metadata']['uid']}"))
        await self._delete(kind, obj)
        return _json(self._public(obj))

    async def _delete(self, kind: str, obj: dict[str, Any]) -> None:
        name = obj["metadata"]["name"]
        if kind == "persistentvolumeclaims" and any(
                name in _claims(p) for p in self.objects["pods"].values()):
            # pvc-protection: kept, Terminating, until no pod uses it.
            obj["metadata"]["deletionTimestamp"] = _now()
            obj["metadata"]["finalizers"] = ["kubernetes.io/pvc-protection"]
            obj["metadata"]["resourceVersion"] = self._next_version()
            self._changed(kind, "MODIFIED", obj)
            return
        del self.objects[kind][name]
        obj["metadata"]["resourceVersion"] = self._next_version()
        if kind == "pods":
            await asyncio.to_thread(self._remove_container, obj)
        elif kind != "services":
            await asyncio.to_thread(self._remove_volume, obj)
        self._changed(kind, "DELETED", obj)
        if kind == "pods":
            for claim in list(self.objects["persistentvolumeclaims"].values()):
                if "deletionTimestamp" in claim["metadata"]:
                    await self._delete("persistentvolumeclaims", claim)

    def _set_status(self, pod: dict[str, Any], status: dict[str, Any]) -> None:
        if pod.get("status") == status or pod["metadata"]["name"] not in self.objects["pods"]:
            return
        pod["status"] = status
        pod["metadata"]["resourceVersion"] = self._next_version()
        self._changed("pods", "MODIFIED", pod)

    def _unschedulable(self, pod: dict[str, Any]) -> str:
        """Why the node does not fit the pod (the scheduler's words), or ''."""
        spec = pod.get("spec") or {}
        selector = spec.get("nodeSelector") or {}
        if any(self.node_labels.get(k) != v for k, v in selector.items()):
            return "node(s) didn't match Pod's node affinity/selector"
        tolerations = spec.get("tolerations") or []
        for taint in self.node_taints:
            if taint.get("effect") not in ("NoSchedule", "NoExecute"):
                continue
            if not any(_tolerates(t, taint) for t in tolerations):
                return f"node(s) had untolerated taint {{{taint['key']}: {taint.get('value', '')}}}"
        return ""

    # -- the kubelet: pods as docker containers, claims as docker volumes ------------------
    def _container_name(self, pod: dict[str, Any]) -> str:
        return f"kube-standin-{pod['metadata']['uid']}"

    def _volume_name(self, obj: dict[str, Any]) -> str:
        return f"kube-standin-{obj['metadata']['uid']}"

    def _labels(self) -> dict[str, str]:
        return {STANDIN_LABEL: os.environ.get("HUTCH_HOME", "")}

    def _run_container(self, pod: dict[str, Any]) -> None:
        spec = pod["spec"]["containers"][0]
        claims = self.objects["persistentvolumeclaims"]
        volumes = {v["name"]: v for v in pod["spec"].get("volumes") or []}
        binds = {}
        for mount in spec.get("volumeMounts") or []:
            claim = (volumes.get(mount["name"]) or {}).get("persistentVolumeClaim")
            if claim:
                binds[self._volume_name(claims[claim["claimName"]])] = {
                    "bind": mount["mountPath"], "mode": "rw"}
        # The container's securityContext, as a kubelet hands it to its
        # runtime: capabilities dropped and added, privileged, and
        # allowPrivilegeEscalation false as no_new_privs.
        security = spec.get("securityContext") or {}
        caps = security.get("capabilities") or {}
        # Its resource limits, as the kubelet's cgroup holds them.
        limits = (spec.get("resources") or {}).get("limits") or {}
        self.docker.containers.run(
            mem_limit=int(_quantity(limits["memory"])) if "memory" in limits else None,
            nano_cpus=int(_quantity(limits["cpu"]) * 1e9) if "cpu" in limits else None,
            cap_drop=caps.get("drop") or None, cap_add=caps.get("add") or None,
            privileged=bool(security.get("privileged")),
            security_opt=(["no-new-privileges"]
                          if security.get("allowPrivilegeEscalation") is False else None),
            image=spec["image"],
            command=(spec.get("command") or []) + (spec.get("args") or []) or None,
            name=self._container_name(pod), detach=True,
            labels=self._labels(),
            environment={e["name"]: e.get("value", "") for e in spec.get("env") or []},
            working_dir=spec.get("workingDir"), volumes=binds,
        )

    def _remove_container(self, pod: dict[str, Any]) -> None:
        try:
            self.docker.api.remove_container(self._container_name(pod), force=True)
        except docker.errors.NotFound:
            pass

    def _make_claim_volume(self, claim: dict[str, Any]) -> None:
        self.docker.volumes.create(self._volume_name(claim), labels=self._labels())
        source = (claim.get("spec") or {}).get("dataSource") or {}
        if source.get("kind") == "VolumeSnapshot":
            snapshot = self.objects["volumesnapshots"].get(source.get("name"))
            if snapshot is None:
                raise docker.errors.APIError(f"no VolumeSnapshot {source.get('name')}")
            self._copy_volume(snapshot, claim)

    def _copy_volume(self, source: dict[str, Any], target: dict[str, Any]) -> int:
        """Copy ``source``'s volume to a new one of ``target``'s; its size in bytes."""
        name = self._volume_name(target)
        self.docker.volumes.create(name, labels=self._labels())
        out = self.docker.containers.run(
            self.helper_image, ["sh", "-c", "cp -a /from/. /to/ && du -sb /to | cut -f1"],
            volumes={self._volume_name(source): {"bind": "/from", "mode": "ro"},
                     name: {"bind": "/to", "mode": "rw"}},
            remove=True, labels=self._labels())
        return int(out.split()[0])

    def _remove_volume(self, obj: dict[str, Any]) -> None:
        try:
            self.docker.api.remove_volume(self._volume_name(obj), force=True)
        except docker.errors.NotFound:
            pass

    def _pod_status(self, pod: dict[str, Any]) -> dict[str, Any]:
        if "standin-evicted" in pod:
            return pod["status"]  # type: ignore[no-any-return]
        try:
            state = self.docker.api.inspect_container(self._container_name(pod))["State"]
        except docker.errors.NotFound:
            return pod.get("status") or {"phase": "Pending"}  # type: ignore[no-any-return]
        spec = pod["spec"]["containers"][0]
        running = bool(state["Running"])
        phase = "Running" if running else ("Succeeded" if state["ExitCode"] == 0 else "Failed")
        container_state = ({"running": {"startedAt": state["StartedAt"][:19] + "Z"}} if running
                           else {"terminated": {"exitCode": state["ExitCode"]}})
        return {"phase": phase, "conditions": [
                    {"type": "Ready", "status": "True" if running else "False"}],
                "containerStatuses": [{
                    "name": spec["name"], "image": spec["image"], "imageID": "",
                    "ready": running, "restartCount": 0, "started": running,
                    "state": container_state}]}

    def _kubelet(self) -> None:
        """A pod's container that dies makes its pod Failed (or Succeeded)."""
        engine = docker.from_env()  # a client of its own: this thread's
        while not self._kubelet_stop.is_set():
            try:
                self._events = engine.events(decode=True, filters={
                    "type": ["container"], "event": ["die"], "label": [STANDIN_LABEL]})
                for event in self._events:
                    name = str((event.get("Actor") or {}).get("Attributes", {}).get("name", ""))
                    self._loop.call_soon_threadsafe(self._container_died, name)
            except Exception:
                if self._kubelet_stop.wait(0.5):
                    return

    def _container_died(self, container: str) -> None:
        for pod in self.objects["pods"].values():
            if self._container_name(pod) == container:
                task = asyncio.ensure_future(self._refresh(pod))
                self._refreshing.add(task)
                task.add_done_callback(self._refreshing.discard)

    async def _refresh(self, pod: dict[str, Any]) -> None:
        self._set_status(pod, await asyncio.to_thread(self._pod_status, pod))

    # -- pods/exec over WebSocket ------------------------------------------------------
    @property
    def open_execs(self) -> int:
        """How many pods/exec connections are open now."""
        return len(self._open_execs)

    def drop_execs(self) -> int:
        """Every open pods/exec connection closed by the server, as an API
        server's restart (or a cut in the network) closes them; how many."""

        async def drop() -> int:
            open_now = list(self._open_execs)
            for ws in open_now:
                await ws.close()
            return len(open_now)

        return asyncio.run_coroutine_threadsafe(drop(), self._loop).result(10)

    async def exec(self, request: web.Request) -> web.StreamResponse:
        store = self._store(request)
        name = request.match_info["name"]
        if store is None or request.match_info["kind"] != "pods" or name not in store:
            return _status(404, "NotFound", f'pods "{name}" not found')
        pod = store[name]
        command = request.query.getall("command", [])
        stdin = request.query.get("stdin") in ("true", "1")
        self.execs.append(list(command))
        fault = self.exec_fault(list(command)) if self.exec_fault is not None else None
        ws = web.WebSocketResponse(protocols=self.protocols)
        await ws.prepare(request)
        self._open_execs.add(ws)
        try:
            if fault is not None and fault.command is None:
                if fault.status_message:
                    await ws.send_bytes(b"\x03" + json.dumps({
                        "metadata": {}, "status": "Failure", "reason": "InternalError",
                        "message": fault.status_message}).encode())
                if fault.drop and request.transport is not None:
                    request.transport.abort()
                else:
                    await ws.close(code=fault.close_code, message=fault.close_reason.encode())
                return ws
            if fault is not None and fault.command is not None:
                command = fault.command
            return await self._exec_session(ws, pod, command, stdin)
        finally:
            self._open_execs.discard(ws)

    async def _exec_session(self, ws: web.WebSocketResponse, pod: dict[str, Any],
                            command: list[str], stdin: bool) -> web.WebSocketResponse:
        v5 = ws.ws_protocol == PROTOCOLS[0]
        api = self.docker.api
        try:
            exec_id = (await asyncio.to_thread(
                api.exec_create, self._container_name(pod), command, stdin=stdin))["Id"]
            hijacked = await asyncio.to_thread(api.exec_start, exec_id, socket=True)
        except docker.errors.APIError as exc:
            await ws.send_bytes(b"\x03" + json.dumps({
                "metadata": {}, "status": "Failure", "reason": "InternalError",
                "message": str(exc)}).encode())
            await ws.close()
            return ws
        sock = hijacked._sock
        # What docker-py's HTTP client read past the response's headers is the
        # stream's start: a thread slow to read them (a loaded machine) reads
        # the command's first output with them, and the socket has it no more.
        early = bytearray(await asyncio.to_thread(read_ahead, hijacked))
        # docker-py's request timeout (60 s) would cut a command quiet that
        # long (the agent's relay is quiet for minutes) with no Status.
        sock.settimeout(None)

        def recv_exact(n: int) -> bytes | None:
            data = bytearray(early[:n])
            del early[:n]
            while len(data) < n:
                try:
                    piece = sock.recv(n - len(data))
                except OSError:  # shut down under it: the session is over
                    return None
                if not piece:
                    return None
                data += piece
            return bytes(data)

        async def pump_out() -> None:
            while True:
                header = await asyncio.to_thread(recv_exact, 8)
                if header is None:
                    return
                body = await asyncio.to_thread(recv_exact, int.from_bytes(header[4:], "big"))
                if body is None:
                    return
                if ws.closed:
                    return  # the client went: the command's output has nowhere to go
                await ws.send_bytes(bytes([header[0]]) + body)

        async def pump_in() -> None:
            async for msg in ws:
                if msg.type != WSMsgType.BINARY or not msg.data:
                    continue
                channel, data = msg.data[0], msg.data[1:]
                if channel == 0 and stdin:
                    await asyncio.to_thread(sock.sendall, data)
                elif channel == 255 and v5 and data[:1] == b"\x00":
                    await asyncio.to_thread(sock.shutdown, socket.SHUT_WR)
            # The client went (or closed): the command's stdin ends.
            if stdin:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_WR)

        reader = asyncio.ensure_future(pump_in())
        try:
            await pump_out()
        finally:
            reader.cancel()
            with contextlib.suppress(OSError):  # a reader still blocked on it wakes
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
        if ws.closed:
            return ws  # the client went: no Status to send
        code = await asyncio.to_thread(self._exec_exit_code, exec_id)
        if code is None:
            status: dict[str, Any] = {
                "metadata": {}, "status": "Failure", "reason": "InternalError",
                "message": f"exec {exec_id[:12]}: its stream ended, docker still says it runs"}
        elif code == 0:
            status = {"metadata": {}, "status": "Success"}
        else:
            status = {"metadata": {}, "status": "Failure", "reason": "NonZeroExitCode",
                      "message": f"command terminated with non-zero exit code: {code}",
                      "details": {"causes": [{"reason": "ExitCode", "message": str(code)}]}}
        if not ws.closed:
            await ws.send_bytes(b"\x03" + json.dumps(status).encode())
            await ws.close()
        return ws

    def _exec_exit_code(self, exec_id: str) -> int | None:
        """An exec's exit code once docker has it (its stream may end a moment
        before docker records the exit: never a Success it does not know of);
        None if it never comes."""
        deadline = time.monotonic() + 30
        while True:
            try:
                state = self.docker.api.exec_inspect(exec_id)
            except docker.errors.NotFound:  # the container went meanwhile
                return 137
            if not state.get("Running") and state.get("ExitCode") is not None:
                return int(state["ExitCode"])
            if time.monotonic() > deadline:
                return None
            time.sleep(0.02)

    # -- pods/portforward over WebSocket -----------------------------------------------
    async def portforward(self, request: web.Request) -> web.StreamResponse:
        store = self._store(request)
        name = request.match_info["name"]
        if store is None or request.match_info["kind"] != "pods" or name not in store:
            return _status(404, "NotFound", f'pods "{name}" not found')
        try:
            port = int(request.query.get("ports", ""))
            if not 0 < port < 65536:
                raise ValueError
        except ValueError:
            return _status(400, "BadRequest", "invalid port in ports query")
        try:
            details = await asyncio.to_thread(
                self.docker.api.inspect_container, self._container_name(store[name]))
        except docker.errors.NotFound:
            return _status(400, "BadRequest", f'pod "{name}" is not running')
        address = next((n["IPAddress"] for n in (
            details["NetworkSettings"].get("Networks") or {}).values()
            if n.get("IPAddress")), "")
        ws = web.WebSocketResponse(protocols=PORTFORWARD_PROTOCOLS)
        await ws.prepare(request)
        prefix = port.to_bytes(2, "little")
        await ws.send_bytes(b"\x00" + prefix)
        await ws.send_bytes(b"\x01" + prefix)
        try:
            reader, writer = await asyncio.open_connection(address, port)
        except OSError as exc:
            await ws.send_bytes(b"\x01" + (
                f"an error occurred forwarding {port} -> {port}: error forwarding port "
                f"{port} to pod {name}: {exc}").encode())
            await ws.close()
            return ws

        async def pump_in() -> None:
            async for msg in ws:
                if msg.type == WSMsgType.BINARY and msg.data[:1] == b"\x00":
                    writer.write(msg.data[1:])
                    await writer.drain()
            writer.close()  # the client went: the connection ends

        relay = asyncio.ensure_future(pump_in())
        try:
            while data := await reader.read(1 << 16):
                if ws.closed:
                    break
                await ws.send_bytes(b"\x00" + data)
        except OSError:
            pass
        finally:
            relay.cancel()
            with contextlib.suppress(BaseException):
                await relay
            writer.close()
            if not ws.closed:
                await ws.close()
        return ws


def _claims(pod: dict[str, Any]) -> Iterable[str]:
    """The claims a pod's volumes name."""
    for volume in pod.get("spec", {}).get("volumes") or []:
        claim = volume.get("persistentVolumeClaim")
        if claim:
            yield claim["claimName"]


_shared: KubeStandin | None = None


def shared() -> KubeStandin:
    """One stand-in for the whole test session (with a CSI snapshotter),
    started on first use: the conformance suite's and the fault harness's."""
    global _shared
    if _shared is None:
        import atexit
        import tempfile

        _shared = KubeStandin(snapshots=True).start()
        fd, path = tempfile.mkstemp(prefix="hutch-kubeconfig-")
        os.close(fd)
        _shared.write_kubeconfig(path)
        # The run's temporary directory may be gone first (conftest removes it).
        atexit.register(lambda: os.path.exists(path) and os.unlink(path))
    return _shared
