"""Refs: credentials scoped to one sandbox, and the sessions attached through them."""

from __future__ import annotations

import hashlib
import hmac
import math
import secrets
import time
from typing import Any

from .._errors import (
    NotFound,
    SandboxUnavailable,
    Unauthorized,
)
from .._refwire import DaemonRef, attachment_json, check_ref_lifetime, decode_ref
from ..states import RESUMABLE
from ..store import (
    RefRow,
)
from .common import (
    MAX_SESSION_ID,
    MAX_SESSIONS,
    REF_USE_EVENT_SECONDS,
    AttachedSession,
)
from .watch import Watching


class Refs(Watching):
    # -- refs: credentials scoped to one sandbox ----------------------------------------
    async def create_ref(
        self, sandbox_id: str, expires_in: float | None, daemon_url: str
    ) -> dict[str, Any]:
        """Hand out a ref to a live sandbox; only a hash of its secret is kept."""
        await self.get(sandbox_id)  # a live sandbox, or the typed error of why not
        if expires_in is not None:
            check_ref_lifetime(expires_in)
        now = time.time()
        secret = secrets.token_urlsafe(32)
        row = RefRow(
            id="ref-" + secrets.token_hex(8), sandbox_id=sandbox_id,
            secret_sha256=hashlib.sha256(secret.encode()).hexdigest(), created_at_unix=now,
            expires_at_unix=None if expires_in is None else now + expires_in,
            workspace=self.workspace_of.get(sandbox_id),
        )
        known = await self._load_refs(sandbox_id)  # read before the new row is in the store
        await self.astore.put_ref(row)
        known.append(row)
        self._refs[row.id] = row
        await self.astore.log_event(
            sandbox_id, "ref",
            f"ref {row.id} handed out"
            + ("" if expires_in is None else f", expires in {expires_in:g} s")
            + ("" if row.workspace is None else f", following workspace {row.workspace}"),
        )
        token = DaemonRef(daemon_url.rstrip("/"), sandbox_id, row.id, secret).encode()
        return {"ref": token, "ref_id": row.id, "sandbox_id": sandbox_id,
                "expires_at_unix": row.expires_at_unix}

    async def revoke_ref(self, sandbox_id: str, ref_id: str) -> None:
        """End a ref: it is refused from now on. Idempotent."""
        row = await self._ref_row(ref_id)
        if row is None or row.sandbox_id != sandbox_id:
            raise NotFound(f"no ref {ref_id} for sandbox {sandbox_id}")
        if row.revoked_at_unix is not None:
            return
        row.revoked_at_unix = time.time()
        await self.astore.put_ref(row)
        await self.astore.log_event(sandbox_id, "ref", f"ref {ref_id} revoked")

    async def _load_refs(self, sandbox_id: str) -> list[RefRow]:
        """A sandbox's refs, read from the store (off the loop) once, then
        kept: what :meth:`open_refs` answers from."""
        refs = self._refs_of.get(sandbox_id)
        if refs is None:
            stored = await self.astore.list_refs(sandbox_id, self.workspace_of.get(sandbox_id))
            refs = self._refs_of.setdefault(
                sandbox_id, [self._refs.setdefault(r.id, r) for r in stored])
        return refs

    async def ref_target(self, ref: RefRow, sandbox_id: str) -> str | None:
        """The sandbox a request through ``ref`` that names ``sandbox_id`` is
        for; None when the ref does not reach it.

        A ref handed out for a workspace's sandbox follows the workspace: a
        request naming any sandbox that served it goes to the one serving it
        now (after a suspend and resume, a new one), and while none does it
        fails saying why.
        """
        if ref.workspace is None:
            return sandbox_id if sandbox_id == ref.sandbox_id else None
        if sandbox_id != ref.sandbox_id and self.workspace_of.get(sandbox_id) != ref.workspace:
            row = await self.astore.get_sandbox(sandbox_id)
            if row is None or row.workspace != ref.workspace:
                return None
        return await self._serving(ref.workspace)

    async def _serving(self, workspace: str) -> str:
        """The live sandbox serving ``workspace``, or the typed error of why none is."""
        for sandbox_id, name in self.workspace_of.items():
            if name == workspace:
                return sandbox_id
        row = await self.astore.get_workspace(workspace)
        if row is None:
            raise SandboxUnavailable(
                f"workspace {workspace} was deleted: its owner's cleanup ended it"
            )
        if row.status in RESUMABLE:
            raise SandboxUnavailable(
                f"workspace {workspace} is {row.status}: its sandbox comes back when its "
                f"owner resumes it (hutch workspace resume {workspace})"
            )
        raise SandboxUnavailable(
            f"workspace {workspace} is {row.status}: no sandbox serves it yet; try again"
        )

    async def _ref_row(self, ref_id: str) -> RefRow | None:
        row = self._refs.get(ref_id)
        if row is None:
            row = await self.astore.get_ref(ref_id)
            if row is not None:
                self._refs[ref_id] = row
        return row

    async def check_ref(self, token: str) -> RefRow:
        """The ref ``token`` presents, if it is genuine, unrevoked and unexpired.

        Its use is an event (at most once a minute a ref).
        """
        ref = decode_ref(token)
        row = None if ref is None else await self._ref_row(ref.ref_id)
        digest = hashlib.sha256((ref.secret if ref else "").encode()).hexdigest()
        # Constant time, whatever part is wrong.
        if (
            ref is None or row is None
            or not hmac.compare_digest(digest, row.secret_sha256)
            or row.sandbox_id != ref.sandbox_id
        ):
            raise Unauthorized("this ref is not one this daemon handed out")
        now = time.time()
        row.check_usable(now)
        if now - self._ref_used.get(row.id, -math.inf) >= REF_USE_EVENT_SECONDS:
            self._ref_used[row.id] = now
            await self.astore.log_event(row.sandbox_id, "ref", f"ref {row.id} used")
        return row

    def ref_session(self, ref: RefRow, sandbox_id: str, session: str | None) -> None:
        """A request through ``ref`` for ``sandbox_id``: the session making it
        is attached there (and listed) until it detaches or the sandbox ends."""
        sessions = self._sessions.setdefault(sandbox_id, {})
        key = f"{ref.id}/{(session or '')[:MAX_SESSION_ID]}"
        now = time.time()
        known = sessions.get(key)
        if known is not None:
            known.last_used_unix = now
            return
        if len(sessions) >= MAX_SESSIONS:  # sessions that never detached: the stalest goes
            del sessions[min(sessions, key=lambda k: sessions[k].last_used_unix)]
        sessions[key] = AttachedSession(ref.id, (session or "")[:MAX_SESSION_ID], now, now)

    async def detach(self, ref: RefRow, sandbox_id: str, session: str | None) -> None:
        """A session holding a ref closed: it leaves; the sandbox stays."""
        self._sessions.get(sandbox_id, {}).pop(f"{ref.id}/{(session or '')[:MAX_SESSION_ID]}",
                                               None)
        await self.astore.log_event(
            ref.sandbox_id, "ref", f"a session holding ref {ref.id} detached"
        )

    def open_refs(self, sandbox_id: str) -> list[RefRow]:
        """The refs that can still attach to a sandbox (unrevoked, unexpired),
        of those loaded (:meth:`_load_refs`: by :meth:`info` and every ref
        handed out; a sandbox none was handed out for here has none loaded)."""
        now = time.time()
        return [
            r for r in self._refs_of.get(sandbox_id, ())
            if r.revoked_at_unix is None and (r.expires_at_unix is None or r.expires_at_unix > now)
        ]

    def refs_json(self, sandbox_id: str) -> list[dict[str, Any]]:
        return [
            {"ref_id": r.id, "created_at_unix": r.created_at_unix,
             "expires_at_unix": r.expires_at_unix, "last_used_unix": self._ref_used.get(r.id),
             "workspace": r.workspace}
            for r in self.open_refs(sandbox_id)
        ]

    def attachments(self, sandbox_id: str) -> list[dict[str, Any]]:
        """The sessions attached to a sandbox through refs that still work."""
        refs = {r.id: r for r in self.open_refs(sandbox_id)}
        return [
            attachment_json(s.session, refs[s.ref_id], s.attached_at_unix, s.last_used_unix)
            for s in self._sessions.get(sandbox_id, {}).values() if s.ref_id in refs
        ]
