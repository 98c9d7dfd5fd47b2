"""Preview URLs: a sandbox's port, reached from the daemon's host through the
API server's ``pods/{name}/portforward``, and from inside the cluster
through a Service.

The port-forward WebSocket (subprotocol ``v4.channel.k8s.io``, or the plain
``portforward.k8s.io``) carries one TCP connection per forwarded port: for
the i-th port of ``?ports=`` channel 2i carries its data, channel 2i+1 its
errors, each frame one channel byte and its data. The server's first frame on
each channel is the port, two little-endian bytes; the client sends data
without it. A WebSocket has no way to open a second connection, so each
connection to the listener opens a WebSocket of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING, Any

from ..._errors import ProviderError
from ..._lazy import lazy_module
from .api import Cluster, labels, pod_name

if TYPE_CHECKING:
    import httpx2
    from httpx2 import websockets as httpx2_websockets
else:  # imported at their first use: see hutch._lazy
    httpx2 = lazy_module("httpx2")
    httpx2_websockets = lazy_module("httpx2.websockets")

log = logging.getLogger("hutch.kubernetes")
PROTOCOLS = ["v4.channel.k8s.io", "portforward.k8s.io"]
DATA, ERROR = 0, 1
_CHUNK = 1 << 16


def service_name(sandbox_id: str, port: int) -> str:
    """The Service of one port (a DNS-1035 label: the pod's name is one)."""
    return f"{pod_name(sandbox_id)}-{port}"


def service_manifest(sandbox_id: str, port: int) -> dict[str, Any]:
    selector = labels(sandbox_id)
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": {"name": service_name(sandbox_id, port), "labels": selector},
            "spec": {"type": "ClusterIP", "selector": selector,
                     "ports": [{"name": f"p{port}", "protocol": "TCP", "port": port,
                                "targetPort": port}]}}


async def ensure_service(cluster: Cluster, sandbox_id: str, port: int) -> None:
    """The port's Service, for callers inside the cluster (one made before,
    by this daemon or the one before it, is kept: its name is this sandbox's)."""
    name = service_name(sandbox_id, port)
    if await cluster.get("services", name) is not None:
        return
    try:
        response = await cluster.http.request(
            "POST", cluster.kind_path("services"), json=service_manifest(sandbox_id, port))
    except httpx2.HTTPError as exc:
        raise ProviderError(f"creating service {name} failed: {exc}") from exc
    if response.status_code >= 300 and response.status_code != 409:  # 409: made meanwhile
        raise ProviderError(f"creating service {name} failed: {response.status_code} "
                            f"{response.text[:500]}")


async def delete_services(cluster: Cluster, sandbox_id: str) -> None:
    """Every Service made for the sandbox's ports."""
    selector = ",".join(f"{k}={v}" for k, v in labels(sandbox_id).items())
    for item in (await cluster.listed("services", selector)).get("items") or []:
        meta = item.get("metadata") or {}
        await cluster.delete("services", meta["name"], meta.get("uid"))


class PortForward:
    """A listener on the daemon's loopback whose every connection is
    forwarded to ``port`` of the pod through its own ``pods/portforward``."""

    def __init__(self, cluster: Cluster, pod: str, port: int) -> None:
        self.cluster = cluster
        self.pod = pod
        self.port = port
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task[None]] = set()

    async def open(self) -> str:
        """Start listening; the URL to use."""
        self._server = await asyncio.start_server(self._accepted, "127.0.0.1", 0)
        local = self._server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{local}"

    async def close(self) -> None:
        """No new connections; the open ones end."""
        if self._server is not None:
            self._server.close()
        for task in list(self._connections):
            task.cancel()
        for task in list(self._connections):
            with contextlib.suppress(BaseException):
                await task
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 5)

    async def _accepted(self, reader: asyncio.StreamReader,
                        writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        try:
            await self._forward(reader, writer)
        except Exception as exc:  # the API refused, the pod went, the port is closed
            log.info("kubernetes: port-forward to %s:%d ended: %s", self.pod, self.port, exc)
        finally:
            self._connections.discard(task)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _forward(self, reader: asyncio.StreamReader,
                       writer: asyncio.StreamWriter) -> None:
        # The WebSocket session lives in this one task (httpx's sessions
        # hold a task group); the upload is a task of its own that only sends.
        async with self.cluster.http.websocket(
                self.cluster.pod_path(self.pod) + "/portforward", subprotocols=PROTOCOLS,
                params={"ports": str(self.port)},
                keepalive_ping_interval_seconds=None) as ws:
            upload = asyncio.ensure_future(self._upload(reader, ws))
            try:
                await self._download(ws, writer)
            finally:
                upload.cancel()
                with contextlib.suppress(BaseException):
                    await upload

    @staticmethod
    async def _upload(reader: asyncio.StreamReader, ws: Any) -> None:
        while data := await reader.read(_CHUNK):
            await ws.send_bytes(bytes([DATA]) + data)
        # The v4 channels cannot say the client is done writing: the
        # server's side ends the connection (its answer read, or a close).

    async def _download(self, ws: Any, writer: asyncio.StreamWriter) -> None:
        prefixed = {DATA: False, ERROR: False}
        while True:
            try:
                frame = await ws.receive_bytes()
            except httpx2_websockets.WebSocketDisconnect:
                return
            if not frame or frame[0] not in prefixed:
                continue
            channel, data = frame[0], bytes(frame[1:])
            if not prefixed[channel]:  # the port, once per channel
                prefixed[channel] = True
                data = data[2:]
            if not data:
                continue
            if channel == ERROR:
                raise ProviderError(data.decode("utf-8", "replace"))
            writer.write(data)
            await writer.drain()
