"""A stand-in for a Kubernetes API server, for the ``kubernetes`` provider's tests.

No API server can be installed on the machines these tests run on, so this
serves the part of the API's documented contract the provider uses, for one
namespace: Pods and PersistentVolumeClaims (create, get, list, delete),
``metadata.resourceVersion`` and ``uid`` set by the server, 409 AlreadyExists
on a create of a name that exists, 409 Conflict on a delete whose
``preconditions.uid`` does not match, 404 NotFound as a ``Status`` object;
and ``pods/{name}/exec`` over WebSocket with the ``v5.channel.k8s.io`` (and
``v4``) subprotocol: one channel byte per frame (0 stdin, 1 stdout, 2 stderr,
3 the final ``Status`` as JSON, 255 close, v5 only), reaching a real process.

Scheduling is the scheduler's rule on one node (``standin-node``, with the
labels and taints given): a pod whose ``nodeSelector`` the node's labels do
not match, or that does not tolerate one of its NoSchedule or NoExecute
taints, stays Pending with ``PodScheduled`` False (``Unschedulable``); a pod
that fits gets ``spec.nodeName``. Image pull secrets are kept, not used.

A pod's container really runs: a local docker container of the pod's image
and command; exec is ``docker exec`` in it. Not covered (yet): watches,
bookmarks and 410 Gone, authentication, admission, other kinds.
Every behaviour here is one the real API server has.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import threading
import uuid
from typing import Any

import docker
from aiohttp import WSMsgType, web

#: The label of the docker containers the stand-in runs as pods: the hutch
#: home of the tests that made them (the suite's leftover check reads it).
STANDIN_LABEL = "hutch-test.kube-standin"
PROTOCOLS = ("v5.channel.k8s.io", "v4.channel.k8s.io")
NODE = "standin-node"


def _json(obj: Any, status: int = 200) -> web.Response:
    # The API server's Content-Type is exactly application/json (no charset):
    # clients (lightkube) read a Status as one only then.
    return web.Response(body=json.dumps(obj).encode(), status=status,
                        headers={"Content-Type": "application/json"})


def _status(code: int, reason: str, message: str) -> web.Response:
    return _json({"kind": "Status", "apiVersion": "v1", "metadata": {},
                              "status": "Failure", "message": message, "reason": reason,
                              "code": code}, status=code)


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
                 node_taints: list[dict[str, str]] | None = None,
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
        self.objects: dict[str, dict[str, dict[str, Any]]] = {
            "pods": {}, "persistentvolumeclaims": {}}
        #: The kubeconfig written for it (write_kubeconfig), for the tests.
        self.kubeconfig = ""
        self.version = 0
        self.docker = docker.from_env()
        self._loop = asyncio.new_event_loop()
        self._lock = threading.Lock()
        self.port = 0
        self._runner: web.AppRunner | None = None
        #: Every pods/exec served, its command (as an audit log records them).
        self.execs: list[list[str]] = []
        self._open_execs: set[web.WebSocketResponse] = set()

    # -- life of the server ----------------------------------------------------------
    def start(self) -> KubeStandin:
        app = web.Application()
        base = "/api/v1/namespaces/{ns}/{kind}"
        app.router.add_get(base, self.list)
        app.router.add_post(base, self.create)
        app.router.add_get(base + "/{name}", self.get)
        app.router.add_delete(base + "/{name}", self.delete)
        app.router.add_route("*", base + "/{name}/exec", self.exec)
        self._runner = web.AppRunner(app)
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
        return self

    def stop(self) -> None:
        for pod in list(self.objects["pods"].values()):
            self._remove_container(pod)
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)

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

    # -- the REST side ---------------------------------------------------------------
    def _store(self, request: web.Request) -> dict[str, dict[str, Any]] | None:
        if request.match_info["ns"] != self.namespace:
            return None
        return self.objects.get(request.match_info["kind"])

    def _next_version(self) -> str:
        self.version += 1
        return str(self.version)

    async def list(self, request: web.Request) -> web.Response:
        store = self._store(request)
        if store is None:
            return _status(404, "NotFound", "the server could not find the requested resource")
        kind = request.match_info["kind"]
        selector = request.query.get("labelSelector", "")
        wanted = dict(p.split("=", 1) for p in selector.split(",") if "=" in p)
        items = [o for o in store.values()
                 if all(o["metadata"].get("labels", {}).get(k) == v for k, v in wanted.items())]
        list_kind = "PodList" if kind == "pods" else "PersistentVolumeClaimList"
        return _json({"kind": list_kind, "apiVersion": "v1",
                                  "metadata": {"resourceVersion": str(self.version)},
                                  "items": items})

    async def get(self, request: web.Request) -> web.Response:
        store = self._store(request)
        name = request.match_info["name"]
        if store is None or name not in store:
            return _status(404, "NotFound", f'{request.match_info["kind"]} "{name}" not found')
        obj = store[name]
        if request.match_info["kind"] == "pods" and obj["spec"].get("nodeName"):
            obj["status"] = await asyncio.to_thread(self._pod_status, obj)
        return _json(obj)

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
        with self._lock:
            if name in store:
                return _status(409, "AlreadyExists", f'{kind} "{name}" already exists')
            meta.update(namespace=self.namespace, uid=str(uuid.uuid4()),
                        resourceVersion=self._next_version())
            store[name] = obj
        if kind == "pods" and (unschedulable := self._unschedulable(obj)):
            obj["status"] = {"phase": "Pending", "conditions": [{
                "type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                "message": f"0/1 nodes are available: 1 {unschedulable}."}]}
        elif kind == "pods":
            obj["spec"]["nodeName"] = NODE
            try:
                await asyncio.to_thread(self._run_container, obj)
            except docker.errors.APIError as exc:
                del store[name]
                return _status(422, "Invalid", f"the pod's container cannot run: {exc}")
            obj["status"] = await asyncio.to_thread(self._pod_status, obj)
        else:
            obj["status"] = {"phase": "Bound"}
        return _json(obj, status=201)

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
        del store[name]
        obj["metadata"]["resourceVersion"] = self._next_version()
        if kind == "pods":
            await asyncio.to_thread(self._remove_container, obj)
        return _json(obj)

    # -- pods as docker containers -----------------------------------------------------
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

    def _container_name(self, pod: dict[str, Any]) -> str:
        return f"kube-standin-{pod['metadata']['uid']}"

    def _run_container(self, pod: dict[str, Any]) -> None:
        spec = pod["spec"]["containers"][0]
        # The container's securityContext, as a kubelet hands it to its
        # runtime: capabilities dropped and added, privileged, and
        # allowPrivilegeEscalation false as no_new_privs.
        security = spec.get("securityContext") or {}
        caps = security.get("capabilities") or {}
        self.docker.containers.run(
            cap_drop=caps.get("drop") or None, cap_add=caps.get("add") or None,
            privileged=bool(security.get("privileged")),
            security_opt=(["no-new-privileges"]
                          if security.get("allowPrivilegeEscalation") is False else None),
            image=spec["image"],
            command=(spec.get("command") or []) + (spec.get("args") or []) or None,
            name=self._container_name(pod), detach=True,
            labels={STANDIN_LABEL: os.environ.get("HUTCH_HOME", "")},
            environment={e["name"]: e.get("value", "") for e in spec.get("env") or []},
            working_dir=spec.get("workingDir"),
        )

    def _remove_container(self, pod: dict[str, Any]) -> None:
        try:
            self.docker.api.remove_container(self._container_name(pod), force=True)
        except docker.errors.NotFound:
            pass

    def _pod_status(self, pod: dict[str, Any]) -> dict[str, Any]:
        try:
            state = self.docker.api.inspect_container(self._container_name(pod))["State"]
        except docker.errors.NotFound:
            return {"phase": "Failed", "reason": "ContainerGone"}
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

    # -- pods/exec over WebSocket ------------------------------------------------------
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
        ws = web.WebSocketResponse(protocols=self.protocols)
        await ws.prepare(request)
        self._open_execs.add(ws)
        try:
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

        def recv_exact(n: int) -> bytes | None:
            data = b""
            while len(data) < n:
                piece = sock.recv(n - len(data))
                if not piece:
                    return None
                data += piece
            return data

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
            sock.close()
        code = (await asyncio.to_thread(api.exec_inspect, exec_id))["ExitCode"] or 0
        if code == 0:
            status: dict[str, Any] = {"metadata": {}, "status": "Success"}
        else:
            status = {"metadata": {}, "status": "Failure", "reason": "NonZeroExitCode",
                      "message": f"command terminated with non-zero exit code: {code}",
                      "details": {"causes": [{"reason": "ExitCode", "message": str(code)}]}}
        if not ws.closed:
            await ws.send_bytes(b"\x03" + json.dumps(status).encode())
            await ws.close()
        return ws
