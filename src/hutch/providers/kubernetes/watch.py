"""Pods (and claims) of this home that fail or go outside hutch, learnt from
the API server's watch, not by polling: a pod evicted, deleted, or whose
container ended is told at once, in words for a person.

Each cluster this home uses is watched as an informer does: a list (its
resourceVersion), then a watch from there with bookmarks (so that a
reconnect resumes from a recent version), again from the last version seen
when the server ends it; a 410 Gone (the version compacted away) lists
again, and what went between the two lists is told as deleted.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

from ..._errors import HutchError, InvalidArgument, ProviderError
from ..._lazy import lazy_module
from ..base import RuntimeNotice, RuntimeReport
from . import clusters
from .api import SANDBOX_ID_ANNOTATION, SANDBOX_LABEL, Cluster, home_selector
from .config import KubernetesConfig
from .pods import why_not_running

if TYPE_CHECKING:
    import httpx2
else:  # imported at their first use: see hutch._lazy
    httpx2 = lazy_module("httpx2")

log = logging.getLogger("hutch.kubernetes")
#: How long the server may keep one watch open, seconds (it then ends it,
#: and the watch goes on from the last version seen).
WATCH_SECONDS = 300
ENDED = ("Failed", "Succeeded")


async def watch_runtimes(report: RuntimeReport) -> None:
    """Until cancelled, every cluster this home uses (and every one it
    reaches from now on) watched for pods and claims lost outside hutch."""
    loop = asyncio.get_running_loop()
    tasks: dict[str, asyncio.Task[None]] = {}
    telling: set[asyncio.Task[None]] = set()

    def tell(coro: Coroutine[Any, Any, None]) -> None:
        task = loop.create_task(coro)
        telling.add(task)
        task.add_done_callback(telling.discard)

    def start(config: KubernetesConfig) -> None:
        key = clusters.key(config)
        if key not in tasks:
            for kind in ("pods", "persistentvolumeclaims"):
                tasks[key + kind] = loop.create_task(_watch(config, kind, report, tell))
            tasks[key] = tasks[key + "pods"]

    def heard(config: KubernetesConfig) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is gone
            loop.call_soon_threadsafe(start, config)

    clusters.LISTENERS.append(heard)
    try:
        for config in clusters.remembered():
            start(config)
        await asyncio.Event().wait()
    finally:
        clusters.LISTENERS.remove(heard)
        for task in [*tasks.values(), *telling]:
            task.cancel()


def _sandbox_of(obj: dict[str, Any]) -> str:
    meta = obj.get("metadata") or {}
    return str((meta.get("annotations") or {}).get(SANDBOX_ID_ANNOTATION)
               or (meta.get("labels") or {}).get(SANDBOX_LABEL) or "")


class _Seen:
    """What one watch has seen of one kind: uid -> (sandbox, name), and the
    uids already told about."""

    def __init__(self, kind: str, report: RuntimeReport, tell: Any) -> None:
        self.kind = kind
        self.objects: dict[str, tuple[str, str]] = {}
        self.told: set[str] = set()
        self._report = report
        self._tell = tell

    def _notice(self, uid: str, sandbox: str, message: str, *, of_suspended: bool) -> None:
        if uid in self.told or not sandbox:
            return
        self.told.add(uid)
        self._tell(self._report(RuntimeNotice(sandbox, message, of_suspended=of_suspended)))

    def event(self, kind: str, obj: dict[str, Any]) -> None:
        meta = obj.get("metadata") or {}
        uid, name, sandbox = str(meta.get("uid") or ""), str(meta.get("name")), _sandbox_of(obj)
        if kind == "DELETED":
            self.objects.pop(uid, None)
            self.gone(uid, sandbox, name)
            self.told.discard(uid)  # a uid is never seen again once deleted
            return
        self.objects[uid] = (sandbox, name)
        if self.kind == "pods":
            if (obj.get("status") or {}).get("phase") in ENDED:
                self._notice(uid, sandbox, why_not_running(obj, name), of_suspended=False)
        elif meta.get("deletionTimestamp"):
            self.gone(uid, sandbox, name)

    def gone(self, uid: str, sandbox: str, name: str) -> None:
        if self.kind == "pods":
            self._notice(uid, sandbox, why_not_running(None, name), of_suspended=False)
        else:
            self._notice(uid, sandbox, f"its claim {name}, which holds its working "
                         "directory's files, was deleted outside hutch", of_suspended=True)

    def relisted(self, items: list[dict[str, Any]]) -> None:
        """A fresh list: what went since the last is told as deleted."""
        now = {str((i.get("metadata") or {}).get("uid")) for i in items}
        for uid, (sandbox, name) in list(self.objects.items()):
            if uid not in now:
                del self.objects[uid]
                self.gone(uid, sandbox, name)
                self.told.discard(uid)
        for item in items:
            self.event("ADDED", item)


async def _watch(config: KubernetesConfig, kind: str, report: RuntimeReport,
                 tell: Any) -> None:
    seen = _Seen(kind, report, tell)
    version: str | None = None
    backoff = 0.5
    while True:
        try:
            cluster = Cluster(config)
        except InvalidArgument as exc:
            log.info("not watching a cluster whose settings cannot be read: %s", exc)
            return
        try:
            while True:
                if version is None:
                    listed = await cluster.listed(kind, home_selector())
                    version = str((listed.get("metadata") or {}).get("resourceVersion") or "")
                    seen.relisted(listed.get("items") or [])
                version = await _stream(cluster, kind, version, seen)
                backoff = 0.5
        except (HutchError, httpx2.HTTPError, ValueError) as exc:
            log.info("watching %s in %s broke (%s); again in %.1f s",
                     kind, cluster.namespace, exc, backoff)
        finally:
            with contextlib.suppress(Exception):
                await cluster.close()
        await asyncio.sleep(backoff)
        backoff = min(backoff * 2, 10.0)


async def _stream(cluster: Cluster, kind: str, version: str, seen: _Seen) -> str | None:
    """One watch from ``version``, until the server ends it; the last
    version seen (None: it is gone, list again)."""
    params = {"watch": "true", "resourceVersion": version, "allowWatchBookmarks": "true",
              "labelSelector": home_selector(), "timeoutSeconds": str(WATCH_SECONDS)}
    async with cluster.http.stream(
            "GET", cluster.kind_path(kind), params=params,
            timeout=httpx2.Timeout(10.0, read=WATCH_SECONDS + 30.0)) as response:
        if response.status_code == 410:
            return None
        if response.status_code != 200:
            await response.aread()
            raise ProviderError(f"watching {kind} failed: {response.status_code} "
                                f"{response.text[:300]}")
        async for line in response.aiter_lines():
            if not line.strip():
                continue
            event = json.loads(line)
            obj = event.get("object") or {}
            if event.get("type") == "ERROR":
                if obj.get("code") == 410:
                    return None
                raise ProviderError(f"watching {kind} failed: {obj.get('message')}")
            version = str((obj.get("metadata") or {}).get("resourceVersion") or version)
            if event.get("type") != "BOOKMARK":
                seen.event(str(event.get("type")), obj)
    return version
