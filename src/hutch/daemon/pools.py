"""Warm pools: sandboxes made ahead, so that a create takes one ready.

A pool names the settings of a create (a provider and its settings, as a
request gives them, admitted by the operator's policy as any request is) and
a size. The daemon keeps that many runtimes made and waiting: made by the
provider, not yet sandboxes (no lifecycle record, no deadline, no timer, not
listed), their rows in the store ``creating``, so a daemon killed with a
pool full finds half-made records at its next start and frees what they
made, as for any create cut short. A create whose provider settings are a
pool's takes one of its runtimes and becomes a sandbox from there as a fresh
one does (its own options, a fresh deadline, its own id, a working directory
nothing has run in); the pool refills behind it. A pool drains on shutdown.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import anyio

from .._errors import HutchError, InvalidArgument, NotFound
from .._sandbox import new_sandbox_id
from ..config import SandboxSpec
from ..providers.base import SandboxBackend
from ..providers.registry import get_provider
from ..states import SandboxState
from ..store import SandboxRow
from .common import log
from .sandboxes import Sandboxes

#: The most sandboxes one pool may keep.
MAX_POOL_SIZE = 1000
#: How long a pool waits after a failed make before it tries again.
RETRY_SECONDS = 5.0


@dataclass
class Pool:
    name: str
    #: The create request's settings, as given (what /v1/pools shows).
    settings: dict[str, Any]
    size: int
    spec: SandboxSpec
    #: Runtimes made and waiting: (sandbox id, backend).
    ready: list[tuple[str, SandboxBackend]] = field(default_factory=list)
    hits: int = 0
    #: The id of the runtime being made for it, if one is.
    making: str | None = None
    filler: asyncio.Task[None] | None = None
    #: Set to wake the filler (a runtime taken, the size changed).
    wanted: asyncio.Event = field(default_factory=asyncio.Event)


def check_pool_name(name: str) -> None:
    if not name or len(name) > 64 or not all(c.isalnum() or c in "-_." for c in name):
        raise InvalidArgument(
            f"pool name {name!r}: 1 to 64 letters, digits, '-', '_' or '.'")


class Pooling(Sandboxes):
    # -- the API's face --------------------------------------------------------------------
    def pool_json(self, pool: Pool) -> dict[str, Any]:
        return {"name": pool.name, "provider": pool.spec.provider_name,
                "settings": pool.settings, "size": pool.size, "ready": len(pool.ready),
                "hits": pool.hits}

    def list_pools(self) -> list[dict[str, Any]]:
        return [self.pool_json(p) for _, p in sorted(self._pools.items())]

    def get_pool(self, name: str) -> dict[str, Any]:
        pool = self._pools.get(name)
        if pool is None:
            raise NotFound(f"no pool {name!r}")
        return self.pool_json(pool)

    async def set_pool(self, name: str, settings: Mapping[str, Any], size: int) -> dict[str, Any]:
        """Make or change a pool; a change of settings drops what it keeps."""
        check_pool_name(name)
        if not 0 <= size <= MAX_POOL_SIZE:
            raise InvalidArgument(f"pool size must be 0 to {MAX_POOL_SIZE}, got {size}")
        settings = dict(settings)
        for key in ("workspace", "from_snapshot", "snapshot_id", "size"):
            if key in settings:
                raise InvalidArgument(f"a pool's settings cannot name {key!r}")
        spec = self.spec_from_request(settings)  # the operator's policy, as for a create
        old = self._pools.get(name)
        if old is not None and old.spec.provider == spec.provider:
            old.size, old.settings = size, settings
            pool = old
        else:
            if old is not None:
                await self._drain(old)
            pool = self._pools[name] = Pool(name, settings, size, spec)
        while len(pool.ready) > size:
            await self._discard(*pool.ready.pop())
        pool.wanted.set()
        if pool.filler is None or pool.filler.done():
            pool.filler = asyncio.get_running_loop().create_task(self._fill(pool))
        return self.pool_json(pool)

    async def remove_pool(self, name: str) -> None:
        pool = self._pools.pop(name, None)
        if pool is None:
            raise NotFound(f"no pool {name!r}")
        await self._drain(pool)

    async def drain_pools(self) -> None:
        """Free every pool's runtimes (the daemon stops)."""
        for name in list(self._pools):
            await self._drain(self._pools.pop(name))

    # -- taking and filling ------------------------------------------------------------------
    def _pooled_ids(self) -> set[str]:
        return {sid for pool in self._pools.values()
                for sid in [*(s for s, _ in pool.ready), *([pool.making] if pool.making else [])]}

    async def _take_pooled(self, spec: SandboxSpec) -> tuple[str, SandboxBackend] | None:
        for pool in list(self._pools.values()):  # a pool may come or go while we wait
            while pool.ready and pool.spec.provider == spec.provider:
                sid, backend = pool.ready.pop(0)
                pool.wanted.set()
                try:
                    alive = await backend.is_alive()
                except HutchError:
                    alive = False
                if alive:
                    pool.hits += 1
                    return sid, backend
                # Its runtime died while it waited (removed outside hutch): never handed out.
                log.warning("pool %s: sandbox %s died while kept ready", pool.name, sid)
                await self._discard(sid, backend)
        return None

    async def _fill(self, pool: Pool) -> None:
        while True:
            if len(pool.ready) >= pool.size:
                pool.wanted.clear()
                await pool.wanted.wait()
                continue
            try:
                pool.ready.append(await self._make_pooled(pool))
            except HutchError as exc:
                log.warning("pool %s: making a sandbox failed (tried again in %gs): %s",
                            pool.name, RETRY_SECONDS, exc)
                await anyio.sleep(RETRY_SECONDS)

    async def _make_pooled(self, pool: Pool) -> tuple[str, SandboxBackend]:
        spec, sid = pool.spec, new_sandbox_id()
        pool.making = sid  # not listed while it is made
        try:
            # Recorded before it is made, as any create: a crash leaves a row the next start frees.
            await self.astore.put_sandbox(SandboxRow(
                id=sid, provider=spec.provider_name, state=SandboxState.CREATING.value,
                spec=spec.model_dump(), created_at_unix=time.time()))
            backend_cls = get_provider(spec.provider_name)
            try:
                return sid, await backend_cls.create(spec.provider, sid)
            except BaseException:
                with anyio.CancelScope(shield=True):
                    with contextlib.suppress(HutchError):
                        await backend_cls.discard(sid)
                    await self.astore.delete_sandbox(sid)
                raise
        finally:
            pool.making = None

    async def _discard(self, sid: str, backend: SandboxBackend) -> None:
        with anyio.CancelScope(shield=True):
            try:
                await backend.close()
            except HutchError as exc:
                log.warning("pooled sandbox %s: closing it failed: %s", sid, exc)
            await self.astore.delete_sandbox(sid)

    async def _drain(self, pool: Pool) -> None:
        if pool.filler is not None:
            pool.filler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await pool.filler
        while pool.ready:
            await self._discard(*pool.ready.pop())
