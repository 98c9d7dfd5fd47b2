"""Warm pools: sandboxes made ahead, so that a create takes one ready.

A pool names the settings of a create (a provider and its settings, as a
request gives them, admitted by the operator's policy as any request is; or
a sandbox definition, whose provider settings they then are) and a size.
The daemon keeps that many runtimes made and waiting: made by the provider,
not yet sandboxes (no lifecycle record, no deadline, no timer, not listed),
their rows in the store ``creating``, so a daemon killed with a pool full
finds half-made records at its next start and frees what they made, as for
any create cut short. A create whose provider settings are a pool's takes
one of its runtimes: one store write (its row running, with the request's
options, and the events of its making) and it is a sandbox from there, as a
fresh one is (its own options, its clocks from the take, its id, a working
directory nothing has run in). The pool refills behind it.

While they wait, pooled runtimes cost the daemon nothing: no task, timer or
poll per runtime (one filler per pool sleeps until a take, a resize or a
death wakes it); a runtime that dies outside hutch while it waits is told by
its provider's watcher, as a sandbox's death is, and dropped. They are left
running, not paused nor suspended: an idle keeper and agent use no CPU
(measured: see bench/bench_pools.py), a freeze saves no memory, and a thaw,
or a resume, would be on the way of every take (a docker unpause is an
Engine round trip; a suspend's resume is a start).

Pools count toward the operator's ``max_sandboxes`` (see .policy): their
sizes together cannot exceed it, a pool fills only while there is room, and
a create that finds none takes the room of a runtime a pool keeps ready
(made ahead on speculation; a real request goes first) before it is refused.

Pools set through the API are kept in the store and set again when the
daemon starts (over hutch.toml's pool of the same name); every pool drains
on shutdown, leaving nothing behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import anyio

from .._errors import HutchError, InvalidArgument, NotFound, ResourceExhausted
from .._sandbox import new_sandbox_id
from ..config import SandboxSpec
from ..providers.base import RuntimeNotice
from ..providers.registry import get_provider
from ..states import SandboxState
from ..store import SandboxRow
from .common import log
from .sandboxes import PooledRuntime, Sandboxes

#: The most sandboxes one pool may keep.
MAX_POOL_SIZE = 1000
#: How long a pool waits after a failed make before it tries again.
RETRY_SECONDS = 5.0
#: How long after a take its pool starts the refill: the taken sandbox's
#: first requests (its create's answer, its first exec) come within it, and a
#: make (processes started, mounts, a store write) would compete with them
#: for the host's CPUs. A pool of one refills this much later; a larger one
#: has the rest ready meanwhile.
REFILL_AFTER_SECONDS = 0.05
#: The store's meta key of the pools set through the API (name -> its
#: settings and size, or None: removed), per daemon of a fleet.
POOLS_META = "pools"
#: Keys a pool's settings cannot have: a pool makes plain sandboxes.
_NOT_POOLED = ("workspace", "from_snapshot", "snapshot_id", "size")


@dataclass
class Pool:
    name: str
    #: The create request's settings, as given (what /v1/pools shows).
    settings: dict[str, Any]
    size: int
    spec: SandboxSpec
    #: Runtimes made and waiting, oldest first.
    ready: list[PooledRuntime] = field(default_factory=list)
    hits: int = 0
    #: Creates of its settings that found it empty (made cold).
    misses: int = 0
    #: The id of the runtime being made for it, if one is.
    making: str | None = None
    filler: asyncio.Task[None] | None = None
    #: Set to wake the filler (a runtime taken or dead, the size changed, room freed).
    wanted: asyncio.Event = field(default_factory=asyncio.Event)
    #: When a create last took one of its runtimes (monotonic), if one did.
    taken_at: float | None = None


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

    async def set_pool(self, name: str, settings: Mapping[str, Any], size: int,
                       *, persist: bool = True) -> dict[str, Any]:
        """Make or change a pool; a change of settings drops what it keeps.
        ``persist``: kept in the store, set again at the next start (an API
        client's pool; the operator's from hutch.toml are read from there)."""
        check_pool_name(name)
        if not 0 <= size <= MAX_POOL_SIZE:
            raise InvalidArgument(f"pool size must be 0 to {MAX_POOL_SIZE}, got {size}")
        settings = dict(settings)
        spec = self._pool_spec(settings)
        limit = self.policy.max_sandboxes
        kept = size + sum(p.size for n, p in self._pools.items() if n != name)
        if limit is not None and kept > limit:
            raise InvalidArgument(
                f"pools would keep {kept} sandboxes ready, over this daemon's limit of "
                f"{limit} sandboxes (max_sandboxes under [server] in hutch.toml)")
        if persist:
            await self._persist_pool(name, {"settings": settings, "size": size})
        old = self._pools.get(name)
        if old is not None and old.spec.provider == spec.provider:
            old.size, old.settings = size, settings
            pool = old
        else:
            if old is not None:
                await self._drain(old)
            pool = self._pools[name] = Pool(name, settings, size, spec)
        while len(pool.ready) > size:
            await self._discard(pool.ready.pop())
        pool.wanted.set()
        if pool.filler is None or pool.filler.done():
            pool.filler = asyncio.get_running_loop().create_task(self._fill(pool))
        return self.pool_json(pool)

    async def remove_pool(self, name: str) -> None:
        pool = self._pools.get(name)
        if pool is None:
            raise NotFound(f"no pool {name!r}")
        await self._persist_pool(name, None)
        del self._pools[name]
        await self._drain(pool)

    async def start_pools(self, configured: Mapping[str, Mapping[str, Any]]) -> None:
        """Set the operator's pools (hutch.toml's ``[pools.NAME]``: a size and
        a create's settings), then those API clients set before the last
        stop, which have the last word over the operator's of their name."""
        stored = await self._stored_pools()
        for name, table in configured.items():
            if name not in stored:
                table = dict(table)
                if not isinstance(table.get("size"), int):
                    raise InvalidArgument(f"[pools.{name}] needs a size (a whole number)")
                await self.set_pool(name, table, table.pop("size"), persist=False)
        for name, kept in stored.items():
            if kept is None:
                continue  # removed through the API
            try:
                await self.set_pool(name, kept["settings"], int(kept["size"]), persist=False)
            except (HutchError, KeyError, TypeError, ValueError) as exc:
                # Valid when it was set: its definition since removed, its
                # provider gone from this host, the operator's rules changed.
                log.warning("pool %s set before the restart is not set again: %s", name, exc)

    async def drain_pools(self) -> None:
        """Free every pool's runtimes (the daemon stops)."""
        for name in list(self._pools):
            await self._drain(self._pools.pop(name))

    def _pool_spec(self, settings: Mapping[str, Any]) -> SandboxSpec:
        """The provider settings a pool's sandboxes are made with: a
        definition's, or a create request's as the operator's policy admits it."""
        for key in _NOT_POOLED:
            if key in settings:
                raise InvalidArgument(f"a pool's settings cannot name {key!r}")
        if "definition" in settings:
            if set(settings) != {"definition"}:
                raise InvalidArgument(
                    "a pool of a definition names the definition alone (its settings are "
                    f"the definition's), not {', '.join(sorted(set(settings) - {'definition'}))}")
            if not isinstance(settings["definition"], str):
                raise InvalidArgument("a pool's definition is a definition's id (a string)")
            return SandboxSpec(provider=self.definitions.get(settings["definition"]).provider)
        return self.spec_from_request(settings)  # the operator's policy, as for a create

    def _pools_key(self) -> str:
        return f"{POOLS_META}:{self.daemon_id}" if self.store.shared else POOLS_META

    async def _stored_pools(self) -> dict[str, Any]:
        text = await self.astore.get_meta(self._pools_key())
        try:
            stored = json.loads(text) if text else {}
        except ValueError:
            stored = None
        if not isinstance(stored, dict):
            log.warning("the pools set through the API are unreadable in the store; none set")
            return {}
        return stored

    async def _persist_pool(self, name: str, kept: dict[str, Any] | None) -> None:
        stored = await self._stored_pools()
        stored[name] = kept
        await self.astore.set_meta(self._pools_key(), json.dumps(stored, sort_keys=True))

    # -- taking and filling ------------------------------------------------------------------
    def _pooled_ids(self) -> set[str]:
        return {sid for pool in self._pools.values()
                for sid in [*(r.sandbox_id for r in pool.ready),
                            *([pool.making] if pool.making else [])]}

    async def _take_pooled(self, spec: SandboxSpec) -> PooledRuntime | None:
        # No provider call: a runtime that died while it waited was dropped
        # when its provider's watcher told (see _runtime_notice).
        for pool in self._pools.values():
            if pool.spec.provider == spec.provider:
                if pool.ready:
                    pool.hits += 1
                    pool.taken_at = time.monotonic()
                    pool.wanted.set()
                    return pool.ready.pop(0)
                pool.misses += 1
        return None

    async def return_pooled(self, pooled: PooledRuntime) -> None:
        await self._discard(pooled)
        for pool in self._pools.values():
            pool.wanted.set()

    async def _fill(self, pool: Pool) -> None:
        while True:
            if len(pool.ready) >= pool.size or not self._room_for_pooled():
                pool.wanted.clear()
                await pool.wanted.wait()
                continue
            if pool.taken_at is not None:
                # Behind the take, not beside its first requests (once per take).
                await anyio.sleep(max(0.0, pool.taken_at + REFILL_AFTER_SECONDS
                                      - time.monotonic()))
                pool.taken_at = None
                continue  # what it wants may have changed meanwhile
            try:
                made = await self._make_pooled(pool)
            except HutchError as exc:
                log.warning("pool %s: making a sandbox failed (tried again in %gs): %s",
                            pool.name, RETRY_SECONDS, exc)
                await anyio.sleep(RETRY_SECONDS)
                continue
            if len(pool.ready) < pool.size:
                pool.ready.append(made)
            else:  # the pool shrank while it was made
                await self._discard(made)

    async def _make_pooled(self, pool: Pool) -> PooledRuntime:
        spec, sid = pool.spec, new_sandbox_id()
        pool.making = sid  # not listed while it is made
        try:
            # Recorded before it is made, as any create: a crash leaves a row the next start frees.
            row = SandboxRow(
                id=sid, provider=spec.provider_name, state=SandboxState.CREATING.value,
                spec=spec.model_dump(), created_at_unix=time.time())
            await self.astore.put_sandbox(row)
            backend_cls = get_provider(spec.provider_name)
            try:
                backend = await backend_cls.create(spec.provider, sid)
            except BaseException:
                with anyio.CancelScope(shield=True):
                    with contextlib.suppress(HutchError):
                        await backend_cls.discard(sid)
                    await self.astore.delete_sandbox(sid)
                raise
            made = PooledRuntime(sid, backend, pool.name, row.version)
            try:
                self._watch(backend_cls)  # its death while it waits is told, as a sandbox's
                await backend.runtime.warm()  # what its first exec would open or pay first
            except BaseException:  # the pool removed meanwhile: what was made goes too
                await self._discard(made)
                raise
            return made
        finally:
            pool.making = None

    async def _discard(self, pooled: PooledRuntime) -> None:
        with anyio.CancelScope(shield=True):
            try:
                await pooled.backend.close()
            except HutchError as exc:
                log.warning("pooled sandbox %s: closing it failed: %s", pooled.sandbox_id, exc)
            await self.astore.delete_sandbox(pooled.sandbox_id)

    async def _drain(self, pool: Pool) -> None:
        if pool.filler is not None:
            pool.filler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await pool.filler
        while pool.ready:
            await self._discard(pool.ready.pop())

    async def _runtime_notice(self, notice: RuntimeNotice) -> None:
        """A pooled runtime that died while it waited is dropped (never handed
        out) and made again; a sandbox's notice goes on as ever."""
        for pool in self._pools.values():
            for pooled in pool.ready:
                if pooled.sandbox_id == notice.sandbox_id:
                    break
            else:
                continue
            if not notice.may_have_died:
                return
            try:
                alive = await pooled.backend.is_alive()  # a notice is a hint
            except HutchError:
                alive = False
            if not alive and pooled in pool.ready:
                log.warning("pool %s: sandbox %s died while kept ready: %s",
                            pool.name, pooled.sandbox_id, notice.message)
                pool.ready.remove(pooled)
                pool.wanted.set()
                await self._discard(pooled)
            return
        await super()._runtime_notice(notice)

    # -- the operator's limits -----------------------------------------------------------------
    def _counted(self) -> int:
        """Sandboxes toward ``max_sandboxes``: those served, creates under
        way, and what pools keep ready or are making."""
        pooled = sum(len(p.ready) + (p.making is not None) for p in self._pools.values())
        return len(self.sandboxes) - len(self._hosted) + self._starting + pooled

    def _room_for_pooled(self) -> bool:
        limit = self.policy.max_sandboxes
        return limit is None or self._counted() < limit

    @asynccontextmanager
    async def _room(self) -> AsyncIterator[None]:
        limit = self.policy.max_sandboxes
        self._starting += 1
        try:
            if limit is not None and self._counted() > limit:
                # A runtime kept ready on speculation gives way to a request.
                fullest = max(self._pools.values(), key=lambda p: len(p.ready), default=None)
                if fullest is None or not fullest.ready:
                    raise ResourceExhausted(
                        f"this daemon serves as many sandboxes as its operator allows "
                        f"({limit}: max_sandboxes under [server] in hutch.toml); one must "
                        "end before another is made")
                await self._discard(fullest.ready.pop())
            yield
        finally:
            self._starting -= 1
            self._room_freed()

    def _room_freed(self) -> None:
        for pool in self._pools.values():
            if len(pool.ready) < pool.size:
                pool.wanted.set()

    def _forget(self, sandbox_id: str) -> None:
        super()._forget(sandbox_id)
        self._room_freed()
