"""A fleet: several daemons serving one shared store (issue 24).

Each daemon registers (its id, the URL where the others reach it) and
renews its registration, and the leases of the rows it owns, by a
heartbeat. A daemon serves the sandboxes it owns; a sandbox whose owner's
lease lapsed (its daemon died, or stalled past it) is taken over by a live
daemon (its epoch bumped, so the old owner's late writes are refused) if
its runtime can be reached from any host (the provider says so:
``reachable_from_any_host``), and recorded ``failed`` ("its host is gone")
otherwise. A daemon that finds a sandbox it serves owned by another drops
it from memory, leaving its runtime to the new owner.
"""

from __future__ import annotations

import os
import time
import uuid

import anyio
import anyio.to_thread

from .._errors import HutchError, SandboxUnavailable, StoreUnavailable
from ..providers.registry import get_provider
from ..states import FINAL, SandboxState
from ..store import DaemonRow, OwnershipLost, SandboxRow
from .common import DAEMON_ID_FILE, HOST_GONE, fleet_lease_seconds, log
from .reconcile import Reconciling


def daemon_id_of(data_dir: str) -> str:
    """This daemon's id in its fleet, kept in its data directory: the same
    across its restarts, so it finds its own rows again."""
    path = os.path.join(data_dir, DAEMON_ID_FILE)
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read().strip()
        if text:
            return text
    except FileNotFoundError:
        pass
    made = f"d-{uuid.uuid4().hex[:16]}"
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(made + "\n")
    return made


class ServedElsewhere(Exception):  # not an error: a redirection
    """What was asked is served by another daemon of the fleet, at ``url``:
    the server sends the request there (the daemon has no HTTP of its own)."""

    def __init__(self, daemon_id: str, url: str) -> None:
        super().__init__(f"served by daemon {daemon_id} at {url}")
        self.daemon_id, self.url = daemon_id, url


class Fleet(Reconciling):
    #: The fleet's daemons as last read, and when (monotonic).
    _fleet: dict[str, DaemonRow] = {}  # replaced, never changed in place
    _fleet_read = 0.0
    #: sandbox id -> (the other daemon serving it, or None, when read
    #: (monotonic)): forwarding trusts another daemon's ownership while that
    #: daemon's registration holds (for a lease at most, and until a
    #: takeover is seen), so a forwarded call costs no read of the store.
    _owners: dict[str, tuple[str | None, float]]

    async def _join_fleet(self) -> None:
        """Write as this daemon from now on, and register it. On a store
        only one daemon serves (SQLite), its rows never lapse: no other
        daemon could take them over."""
        self.store.act_as(self.daemon_id,
                          fleet_lease_seconds() if self.store.shared else _NEVER_LAPSES)
        assert self.daemon_id is not None
        self._owners = {}
        await self.astore.register_daemon(self.daemon_id, self.advertise_url or "",
                                          self.store.lease_seconds)

    async def _keep_in_fleet(self) -> None:
        """The heartbeat, and a look for lapsed owners, until cancelled."""
        lease = self.store.lease_seconds
        beat_every = lease / 3
        since_beat = 0.0
        tick = min(1.0, beat_every)
        while True:
            await anyio.sleep(tick)
            since_beat += tick
            try:
                if since_beat >= beat_every and self.daemon_id is not None:
                    since_beat = 0.0
                    await self.astore.register_daemon(self.daemon_id, self.advertise_url or "",
                                                      lease)
                    await self._drop_what_others_own()
                if self.store.shared:
                    await self._take_over_lapsed()
            except Exception:
                log.exception("the fleet's heartbeat failed; tried again")

    async def _drop_what_others_own(self) -> None:
        owners = {r.id: r.owner for r in await self.astore.list_sandboxes(include_final=True)}
        for sandbox_id in list(self.sandboxes):
            if sandbox_id in self._hosted:
                continue
            owner = owners.get(sandbox_id)
            if owner is not None and owner != self.daemon_id:
                self._forget_lost(sandbox_id, f"daemon {owner} took it over")

    async def _take_over_lapsed(self) -> None:
        """Take over what daemons whose lease lapsed owned: their workspaces
        and snapshots, then each of their sandboxes (one daemon wins each)."""
        for kind in ("workspace", "snapshot"):
            for key in await self.astore.take_over_lapsed(kind):
                log.info("took over %s %s: its daemon's lease lapsed", kind, key)
        lapsed = await self.astore.lapsed_sandboxes()
        if lapsed:
            self._owners = {}  # some change hands now: forwarding reads their owners again
        for row in lapsed:
            if not await self.astore.take_over("sandbox", row.id):
                continue  # another live daemon did
            taken = await self.astore.get_sandbox(row.id)
            if taken is not None and taken.state not in FINAL:
                await self._take_over_sandbox(taken, from_daemon=row.owner)

    async def _take_over_sandbox(self, row: SandboxRow, *, from_daemon: str | None) -> None:
        try:
            reachable = get_provider(row.provider).reachable_from_any_host
        except HutchError:
            reachable = False
        self._forget_lost(row.id, "its lease lapsed")  # this daemon's own, stalled: found again
        if not reachable:
            row.state, row.reason = SandboxState.FAILED.value, HOST_GONE
            await self.astore.put_sandbox(
                row, ("lost", f"failed: {HOST_GONE} (daemon {from_daemon} stopped answering)"))
            log.warning("sandbox %s failed: %s (daemon %s)", row.id, HOST_GONE, from_daemon)
            if row.workspace is not None:
                try:
                    await self._workspace_lost_its_sandbox(row.workspace, row.id, HOST_GONE)
                except StoreUnavailable as exc:
                    log.warning("workspace %s: could not record it stale: %s",
                                row.workspace, exc)
            return
        try:
            await self._reconcile_sandbox(row, after_clean_stop=False, taken_over=True)
        except OwnershipLost as exc:
            self._forget_lost(row.id, str(exc))
            return
        await self._note(row.id, "taken over",
                         f"served by daemon {self.daemon_id}; daemon {from_daemon} stopped "
                         "answering")

    # -- who serves what ---------------------------------------------------------------
    async def served_by(self, path: str) -> tuple[str, str] | None:
        """The daemon of the fleet (its id and URL) that serves what a
        request ``path`` of hutch's API names (a sandbox, workspace or
        snapshot another daemon owns); None where this one answers (its own,
        or nobody's)."""
        parts = path.split("/")
        if len(parts) < 4 or parts[1] != "v1" or not parts[3]:
            return None
        kind = _ROUTED.get(parts[2])
        return None if kind is None else await self.owner_serving(kind, parts[3])

    async def owner_serving(self, kind: str, key: str) -> tuple[str, str] | None:
        """The other daemon of the fleet (its id and URL) that serves the
        ``kind`` ("sandbox", "workspace" or "snapshot") named ``key``; None
        where this one answers (its own, or nobody's, or no fleet)."""
        if not self.store.shared:
            return None
        owner: str | None
        if kind == "sandbox":
            if key in self.sandboxes:
                return None
            cached = self._owners.get(key)
            if cached is not None:
                owner, age = cached[0], time.monotonic() - cached[1]
                if owner is None and age < _NOBODY_SECONDS:
                    return None
                if owner is not None and age < self.store.lease_seconds:
                    # Another daemon's sandbox stays its own while its
                    # registration holds: it changes hands only once that lapses.
                    try:
                        return owner, await self.daemon_url(owner)
                    except SandboxUnavailable:
                        pass  # lapsed: whoever took it over is read below
            row = await self.astore.get_sandbox(key)
            owner = None if row is None or row.state in FINAL or self._own(row.owner) \
                else row.owner
            if len(self._owners) > 10000:
                self._owners = {}
            self._owners[key] = (owner, time.monotonic())
        elif kind == "workspace":
            ws = await self.astore.get_workspace(key)
            owner = None if ws is None else ws.owner
        elif kind == "snapshot":
            snap = await self.astore.get_snapshot(key)
            owner = None if snap is None else snap.owner
        else:
            raise ValueError(f"no kind {kind!r}")
        if owner is None or owner == self.daemon_id:
            return None
        return owner, await self.daemon_url(owner)

    async def raise_if_served_elsewhere(self, sandbox_id: str) -> None:
        """ServedElsewhere where another live daemon owns ``sandbox_id``."""
        if sandbox_id in self.sandboxes or not self.store.shared:
            return
        row = await self.astore.get_sandbox(sandbox_id)
        if row is None or row.state in FINAL or self._own(row.owner):
            return
        assert row.owner is not None
        raise ServedElsewhere(row.owner, await self.daemon_url(row.owner))

    async def daemon_url(self, daemon_id: str) -> str:
        """Where the fleet's daemon ``daemon_id`` is reached, while its
        registration holds (read again at most a second apart);
        SandboxUnavailable once it lapsed."""
        now = time.monotonic()
        known = self._fleet.get(daemon_id)
        if known is None or not known.alive or now - self._fleet_read > 1.0:
            self._fleet = {d.id: d for d in await self.astore.daemons()}
            self._fleet_read = now
            known = self._fleet.get(daemon_id)
        if known is None or not known.alive or not known.url:
            raise SandboxUnavailable(
                f"daemon {daemon_id}, which serves it, stopped answering; a live daemon "
                f"takes its sandboxes over within {self.store.lease_seconds + 1:.0f} s")
        return known.url


#: How long forwarding trusts that a sandbox is nobody else's (this
#: daemon's, ended, or unknown) as read: it answers those itself, from the store.
_NOBODY_SECONDS = 1.0
#: A lease (seconds) that does not lapse in practice (about 30 years).
_NEVER_LAPSES = 1e9
#: A request path's first part -> the kind of row its second names.
_ROUTED = {"sandboxes": "sandbox", "workspaces": "workspace", "snapshots": "snapshot"}
