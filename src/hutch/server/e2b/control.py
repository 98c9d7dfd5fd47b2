"""The E2B control plane (REST, JSON): create, connect, list, pause, kill and
timeouts, snapshots and forks, as the E2B SDKs' generated clients send and parse them
(``e2b/api/client/models`` in the Python SDK; the npm SDK's schema is the
same document).

What E2B names maps onto hutch's own operations: a template is a hutch
image (``base``: the daemon's default one), ``metadata`` the sandbox's
``metadata`` option, ``envVars`` the provider's ``env``, ``timeout`` a
``set_timeout`` deadline (E2B's 300 s when create names none; ``autoPause``:
the deadline suspends instead of ending it, ``on_timeout``), pause a
pause (or a suspend where the sandbox cannot pause, or when the caller asks
to drop memory), connect a resume, ``autoResume`` hutch's ``auto_resume``.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
import time
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any
from urllib.parse import parse_qsl, unquote

from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..._errors import (
    HutchError,
    InvalidArgument,
    NotFound,
    SandboxExpired,
    SandboxPermissionDenied,
    SandboxUnavailable,
)
from ..._sandbox import Sandbox
from ...config import SandboxSpec
from ...daemon import Daemon
from ...images import hutch_image_rootfs
from ...states import FINAL
from ...store import SandboxRow
from .dispatch import Caller, caller_of
from .errors import control_body, control_error
from .keys import envd_access_token
from .versions import CLIENT_ID, DEFAULT_TIMEOUT, ENVD_VERSION

#: The metadata key that keeps the template a sandbox was made from (the
#: ``hutch.`` prefix is refused in a caller's own metadata).
TEMPLATE_KEY = "hutch.e2b.template"
#: E2B's default template, and what it is here when no hutch image has its name.
BASE_TEMPLATE = "base"
#: The most sandboxes one page of a list holds (E2B's ceiling).
MAX_PAGE = 100

#: hutch's states as E2B names them; the ended ones are not listed (E2B forgets them).
E2B_STATE = {"creating": "running", "running": "running", "paused": "paused",
             "suspended": "paused"}


def _time(unix: float | None) -> str:
    """RFC 3339 in UTC, as the SDKs' ``isoparse`` reads it."""
    moment = datetime.fromtimestamp(unix if unix is not None else time.time(), UTC)
    return moment.isoformat().replace("+00:00", "Z")


def _memory_mb(spec_value: Any) -> int:
    if isinstance(spec_value, int) and spec_value > 0:
        return spec_value // (1024 * 1024)
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // (1024 * 1024)
    except (ValueError, OSError):
        return 0


class Control:
    """The control plane's answers, over the daemon a request's caller names."""

    def __init__(self, caller: Caller) -> None:
        self.caller = caller
        self.daemon: Daemon = caller.daemon

    # -- who may do what ----------------------------------------------------------------
    async def sandbox(self, sandbox_id: str) -> Sandbox:
        """The live sandbox ``sandbox_id`` names, if the caller may reach it."""
        ref = self.caller.ref
        if ref is not None:
            target = await self.daemon.ref_target(ref, sandbox_id)
            if target is None:
                raise SandboxPermissionDenied(
                    f"ref {ref.id} works only in sandbox {ref.sandbox_id}")
            sandbox_id = target
        try:
            sandbox = await self.daemon.get(sandbox_id)
        except (SandboxUnavailable, SandboxExpired) as exc:
            raise NotFound(exc.message) from None  # E2B forgets sandboxes that ended
        if sandbox.state in FINAL:
            raise NotFound(f"sandbox {sandbox_id} has ended")
        return sandbox

    def owner_only(self, what: str) -> None:
        if self.caller.ref is not None:
            raise SandboxPermissionDenied(
                f"ref {self.caller.ref.id} works in its one sandbox: it cannot {what}")

    # -- the sandbox as E2B describes it ------------------------------------------------
    def access_token(self, sandbox_id: str) -> str:
        """The envd credential of the sandbox: the ref itself when a ref asked
        (revoking it closes the in-sandbox API too), else the daemon's HMAC."""
        if self.caller.ref is not None and self.caller.credential is not None:
            return self.caller.credential
        return envd_access_token(self.caller.secret, sandbox_id)

    @staticmethod
    def metadata_of(sandbox: Sandbox) -> dict[str, str]:
        return _metadata(sandbox.spec)

    def template_of(self, sandbox: Sandbox) -> str:
        return _template(sandbox.spec)

    def created(self, sandbox: Sandbox) -> dict[str, Any]:
        """The ``Sandbox`` model: create's and connect's answer."""
        return {
            "templateID": self.template_of(sandbox),
            "sandboxID": sandbox.id,
            "clientID": CLIENT_ID,
            "envdVersion": ENVD_VERSION,
            "envdAccessToken": self.access_token(sandbox.id),
        }

    async def listed(self, sandbox: Sandbox | SandboxRow) -> dict[str, Any]:
        """The ``ListedSandbox`` model, of a sandbox served here or (in a
        fleet) of another daemon's, as the store has it."""
        if isinstance(sandbox, SandboxRow):
            spec = _spec_of(sandbox)
            info: Mapping[str, Any] = {
                "created_at_unix": sandbox.created_at_unix,
                "deadline_unix": sandbox.deadline_unix, "state": sandbox.state}
        else:
            spec, info = sandbox.spec, await sandbox.info()
        provider = spec.provider if spec is not None else None
        cpus = getattr(provider, "cpus", None)
        started = info.get("created_at_unix")
        deadline = info.get("deadline_unix")
        metadata = {k: v for k, v in _metadata(spec).items() if not k.startswith("hutch.")}
        return {
            "templateID": _template(spec),
            "sandboxID": sandbox.id,
            "clientID": CLIENT_ID,
            "startedAt": _time(started),
            "endAt": _time(deadline if deadline is not None
                           else (started or time.time()) + self.daemon.engine.timeout_ceiling),
            "cpuCount": max(1, int(cpus)) if isinstance(cpus, int | float) else os.cpu_count(),
            "memoryMB": _memory_mb(getattr(provider, "memory", None)),
            "diskSizeMB": _memory_mb(getattr(provider, "disk", None))
            if getattr(provider, "disk", None) else 0,
            "state": E2B_STATE.get(str(info["state"]), "running"),
            "envdVersion": ENVD_VERSION,
            "metadata": metadata,
        }

    async def detail(self, sandbox: Sandbox) -> dict[str, Any]:
        """The ``SandboxDetail`` model (``GET /sandboxes/{id}``)."""
        return {**await self.listed(sandbox), "envdAccessToken": self.access_token(sandbox.id)}

    # -- operations ---------------------------------------------------------------------
    async def create(self, body: Mapping[str, Any]) -> Sandbox:
        self.owner_only("make sandboxes")
        template = body.get("templateID") or BASE_TEMPLATE
        if not isinstance(template, str):
            raise InvalidArgument("templateID must be a string")
        metadata = _string_map(body.get("metadata"), "metadata")
        if any(k.startswith("hutch.") for k in metadata):
            raise InvalidArgument("metadata keys starting with 'hutch.' are hutch's own")
        envs = _string_map(body.get("envVars"), "envVars")
        timeout = body.get("timeout", DEFAULT_TIMEOUT)
        if isinstance(timeout, bool) or not isinstance(timeout, int) or timeout <= 0:
            raise InvalidArgument(f"timeout must be a positive number of seconds, not {timeout!r}")
        for unsupported in ("mcp", "volumeMounts", "iam"):
            if body.get(unsupported):
                raise InvalidArgument(f"{unsupported} is not supported by hutch's E2B wire")
        flags: dict[str, Any] = {"metadata": {**metadata, TEMPLATE_KEY: template}}
        if template != BASE_TEMPLATE or hutch_image_rootfs(BASE_TEMPLATE) is not None:
            flags["image"] = template
        if envs:
            flags["env"] = envs
        if body.get("allow_internet_access") is False:
            flags["network"] = "none"
        if body.get("autoPause") is True:
            flags["on_timeout"] = "suspend"
        auto_resume = body.get("autoResume")
        if isinstance(auto_resume, Mapping) and auto_resume.get("enabled") is False:
            flags["auto_resume"] = False
        snapshot = await self._snapshot_named(template)
        if snapshot is not None:
            # A snapshot's ID is a template (E2B's create_snapshot): the
            # sandbox starts from its state, with its origin's settings.
            options = {k: v for k, v in flags.items() if k in ("metadata", "on_timeout",
                                                                "auto_resume")}
            sandbox = await self.daemon.create_from_snapshot(snapshot, options)
            await self._timed(sandbox, timeout)
            return sandbox
        spec = self.daemon.spec_from_request(flags)
        if getattr(spec.provider, "no_new_privileges", False):
            # E2B's templates' user has passwordless sudo (hutch image build
            # --sudo-user user), which no-new-privileges would stop.
            spec = spec.model_copy(update={
                "provider": spec.provider.model_copy(update={"no_new_privileges": False})})
        sandbox = await self.daemon.create_sandbox(spec)
        await self._timed(sandbox, timeout)
        return sandbox

    async def _timed(self, sandbox: Sandbox, timeout: float) -> None:
        """Give a new sandbox its deadline, or end it."""
        try:
            await sandbox.set_timeout(timeout)
        except BaseException:
            await self.daemon.delete_sandbox(sandbox.id)
            raise

    async def _snapshot_named(self, template: str) -> str | None:
        try:
            return (await self.daemon.get_snapshot(template)).id
        except HutchError:
            return None

    # -- snapshots and forks ------------------------------------------------------------
    async def snapshot(self, sandbox_id: str, body: Mapping[str, Any]) -> dict[str, Any]:
        """Capture the sandbox: its snapshot is a template for create."""
        self.owner_only("snapshot a sandbox")
        sandbox = await self.sandbox(sandbox_id)
        name = body.get("name")
        if name is not None and not isinstance(name, str):
            raise InvalidArgument("name must be a string")
        row = await self.daemon.snapshot_sandbox(sandbox.id, name)
        return snapshot_info(row.id, row.label)

    async def snapshots(self, query: Mapping[str, str]) -> list[dict[str, Any]]:
        self.owner_only("list snapshots")
        rows = [r for r in await self.daemon.list_snapshots()
                if (not query.get("sandboxID") or r.sandbox_id == query["sandboxID"])
                and (not query.get("name") or r.label == query["name"])]
        rows.sort(key=lambda r: r.created_at_unix, reverse=True)
        return [snapshot_info(r.id, r.label) for r in rows[:_limit(query.get("limit"))]]

    async def delete_snapshot(self, snapshot_id: str) -> None:
        self.owner_only("remove snapshots")
        await self.daemon.get_snapshot(snapshot_id)  # 404 for what is no snapshot
        await self.daemon.delete_snapshot(snapshot_id)

    async def fork(self, sandbox_id: str, body: Mapping[str, Any]) -> list[dict[str, Any]]:
        """``count`` sandboxes started from this one's state now."""
        self.owner_only("fork a sandbox")
        sandbox = await self.sandbox(sandbox_id)
        count = body.get("count", 1)
        timeout = body.get("timeout", DEFAULT_TIMEOUT)
        if isinstance(timeout, bool) or not isinstance(timeout, int) or timeout <= 0:
            raise InvalidArgument(f"timeout must be a positive number of seconds, not {timeout!r}")
        options = {k: v for k, v in sandbox.spec.options.model_dump().items()
                   if k in ("metadata", "on_timeout", "auto_resume")} if sandbox.spec else {}
        _, branches = await self.daemon.fork_sandbox(sandbox.id, None, count, options)
        results = []
        for branch in branches:
            await self._timed(branch, timeout)
            results.append({"sandbox": self.created(branch)})
        return results

    async def connect(self, sandbox_id: str, body: Mapping[str, Any]) -> tuple[Sandbox, bool]:
        """Resume the sandbox if it is paused; (it, whether it was resumed)."""
        sandbox = await self.sandbox(sandbox_id)
        resumed = sandbox.state.value in ("paused", "suspended")
        if resumed:
            await sandbox.resume()
        timeout = body.get("timeout")
        if isinstance(timeout, int) and not isinstance(timeout, bool) and timeout > 0:
            deadline = sandbox.status().deadline_unix
            if resumed or deadline is None or deadline < time.time() + timeout:
                await sandbox.set_timeout(timeout)
        elif resumed:
            await sandbox.set_timeout(DEFAULT_TIMEOUT)
        return sandbox, resumed

    async def pause(self, sandbox_id: str, body: Mapping[str, Any]) -> bool:
        """Pause (memory kept) or suspend (``memory: false``, or a sandbox that
        cannot pause); False when it already was."""
        sandbox = await self.sandbox(sandbox_id)
        if sandbox.state.value in ("paused", "suspended"):
            return False
        keep_memory = body.get("memory") is not False
        if keep_memory and sandbox.capabilities.pause:
            await sandbox.pause()
        else:
            await sandbox.suspend()
        # A paused E2B sandbox waits for its connect: its timeout no longer runs.
        await sandbox.set_timeout(self.daemon.engine.timeout_ceiling)
        return True

    async def kill(self, sandbox_id: str, session: str | None) -> None:
        ref = self.caller.ref
        if ref is not None:
            sandbox = await self.sandbox(sandbox_id)
            await self.daemon.detach(ref, sandbox.id, session)
            return
        await self.sandbox(sandbox_id)  # an ended one is 404, as E2B forgets them
        await self.daemon.delete_sandbox(sandbox_id)

    async def list(self, query: Mapping[str, str]) -> tuple[list[dict[str, Any]], str | None]:
        """One page of the caller's sandboxes, newest first unless ``order=asc``,
        and the token of the next page."""
        wanted_meta = _metadata_filter(query.get("metadata"))
        states = {s for s in (query.get("state") or "").split(",") if s}
        template = query.get("template")
        order = query.get("order") or "desc"
        if order not in ("asc", "desc"):
            raise InvalidArgument(f"order must be asc or desc, not {order!r}")
        limit = _limit(query.get("limit"))
        after = _cursor(query.get("nextToken"))
        started_after = query.get("startedAfter")
        since = _parse_time(started_after) if started_after else None
        ref = self.caller.ref
        rows: list[tuple[float, str, Sandbox | SandboxRow]] = []
        if self.daemon.store.shared:
            # A fleet's other daemons' sandboxes, as the store has them (none
            # ended: the store leaves those out): each listed once, whichever
            # daemon is asked.
            for row in await self.daemon.astore.list_sandboxes(not_held_by=self.daemon.daemon_id):
                if row.id in self.daemon.sandboxes or (
                        ref is not None
                        and await self.daemon.ref_target(ref, row.id) != row.id):
                    continue
                spec = _spec_of(row)
                state = E2B_STATE.get(row.state)
                if state is None or (states and state not in states):
                    continue
                metadata = _metadata(spec)
                if any(metadata.get(k) != v for k, v in wanted_meta.items()):
                    continue
                if template and _template(spec) != template:
                    continue
                if since is not None and row.created_at_unix <= since:
                    continue
                rows.append((row.created_at_unix, row.id, row))
        for sandbox_id in list(self.daemon.sandboxes):
            if ref is not None and await self.daemon.ref_target(ref, sandbox_id) != sandbox_id:
                continue
            sandbox = self.daemon.sandboxes.get(sandbox_id)
            if sandbox is None or sandbox.state in FINAL:
                continue
            state = E2B_STATE.get(sandbox.state.value)
            if state is None or (states and state not in states):
                continue
            metadata = self.metadata_of(sandbox)
            if any(metadata.get(k) != v for k, v in wanted_meta.items()):
                continue
            if template and self.template_of(sandbox) != template:
                continue
            created = sandbox.status().created_at_unix or 0.0
            if since is not None and created <= since:
                continue
            rows.append((created, sandbox.id, sandbox))
        rows.sort(key=lambda r: (r[0], r[1]), reverse=order == "desc")
        if after is not None:
            rows = [r for r in rows if ((r[0], r[1]) < after if order == "desc"
                                        else (r[0], r[1]) > after)]
        page = rows[:limit]
        next_token = _token(page[-1][0], page[-1][1]) if len(rows) > limit else None
        return [await self.listed(sandbox) for _, _, sandbox in page], next_token


# -- the sandbox as E2B describes it, from its spec ---------------------------------------


def _spec_of(row: SandboxRow) -> SandboxSpec | None:
    try:
        return SandboxSpec.model_validate(row.spec)
    except ValueError:
        return None


def _metadata(spec: SandboxSpec | None) -> dict[str, str]:
    return {} if spec is None else dict(spec.options.metadata)


def _template(spec: SandboxSpec | None) -> str:
    template = _metadata(spec).get(TEMPLATE_KEY)
    if template:
        return template
    image = getattr(spec.provider, "image", None) if spec is not None else None
    return str(image) if image else BASE_TEMPLATE


# -- request values -----------------------------------------------------------------------


def snapshot_info(snapshot_id: str, name: str | None) -> dict[str, Any]:
    """The ``SnapshotInfo`` model."""
    return {"snapshotID": snapshot_id, "names": [name] if name else []}


def _string_map(value: Any, name: str) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, Mapping) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    ):
        raise InvalidArgument(f"{name} must be an object of strings")
    return dict(value)


def _metadata_filter(value: str | None) -> dict[str, str]:
    """``metadata=k=v&k2=v2`` (each key and value percent-encoded once more,
    as the SDKs send it)."""
    if not value:
        return {}
    return {unquote(k): unquote(v) for k, v in parse_qsl(value, keep_blank_values=True)}


def _limit(value: str | None) -> int:
    if value is None or value == "":
        return MAX_PAGE
    if not value.isdigit() or not 0 < int(value) <= MAX_PAGE:
        raise InvalidArgument(f"limit must be an integer from 1 to {MAX_PAGE}")
    return int(value)


def _token(created: float, sandbox_id: str) -> str:
    return base64.urlsafe_b64encode(json.dumps([created, sandbox_id]).encode()).decode()


def _cursor(token: str | None) -> tuple[float, str] | None:
    if not token:
        return None
    try:
        created, sandbox_id = json.loads(base64.urlsafe_b64decode(token.encode()))
        return float(created), str(sandbox_id)
    except (binascii.Error, ValueError, TypeError):
        raise InvalidArgument("nextToken is not one this server gave") from None


def _parse_time(value: str) -> float:
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    except ValueError:
        raise InvalidArgument(f"startedAfter is not an RFC 3339 time: {value!r}") from None


async def _json_body(request: Request) -> dict[str, Any]:
    raw = await request.body()
    if not raw.strip():
        return {}
    try:
        body = json.loads(raw)
    except ValueError:
        raise InvalidArgument("the request body is not JSON") from None
    if not isinstance(body, dict):
        raise InvalidArgument("the request body must be a JSON object")
    return body


# -- the application ----------------------------------------------------------------------


def control_app() -> FastAPI:
    """The control plane's routes (v1 and v2 where the SDKs use both)."""
    app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)

    @app.exception_handler(HutchError)
    async def hutch_error(_: Request, exc: HutchError) -> JSONResponse:
        status, body = control_error(exc)
        return JSONResponse(body, status_code=status)

    @app.exception_handler(RequestValidationError)
    async def bad_request(_: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse(control_body(400, str(exc.errors())), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = f"no route {request.method} {request.url.path}" if exc.status_code in (
            404, 405) else str(exc.detail)
        return JSONResponse(control_body(exc.status_code, message), status_code=exc.status_code)

    def control(request: Request) -> Control:
        return Control(caller_of(request.scope))

    async def create(request: Request) -> JSONResponse:
        c = control(request)
        sandbox = await c.create(await _json_body(request))
        return JSONResponse(c.created(sandbox), status_code=201)

    async def connect(request: Request, sandbox_id: str) -> JSONResponse:
        c = control(request)
        sandbox, resumed = await c.connect(sandbox_id, await _json_body(request))
        return JSONResponse(c.created(sandbox), status_code=201 if resumed else 200)

    app.add_api_route("/sandboxes", create, methods=["POST"])
    app.add_api_route("/v2/sandboxes", create, methods=["POST"])
    app.add_api_route("/sandboxes/{sandbox_id}/connect", connect, methods=["POST"])
    app.add_api_route("/v2/sandboxes/{sandbox_id}/connect", connect, methods=["POST"])

    async def list_v2(request: Request) -> JSONResponse:
        items, next_token = await control(request).list(request.query_params)
        headers = {"x-next-token": next_token} if next_token else {}
        return JSONResponse(items, headers=headers)

    async def list_v1(request: Request) -> JSONResponse:
        query = {**request.query_params, "state": "running"}
        items, next_token = await control(request).list(query)
        headers = {"x-next-token": next_token} if next_token else {}
        return JSONResponse(items, headers=headers)

    app.add_api_route("/v2/sandboxes", list_v2, methods=["GET"])
    app.add_api_route("/sandboxes", list_v1, methods=["GET"])

    @app.get("/sandboxes/{sandbox_id}")
    async def get_sandbox(request: Request, sandbox_id: str) -> JSONResponse:
        c = control(request)
        return JSONResponse(await c.detail(await c.sandbox(sandbox_id)))

    @app.delete("/sandboxes/{sandbox_id}")
    async def kill(request: Request, sandbox_id: str) -> Response:
        await control(request).kill(sandbox_id, request.headers.get("x-hutch-session"))
        return Response(status_code=204)

    @app.post("/sandboxes/{sandbox_id}/timeout")
    async def set_timeout(request: Request, sandbox_id: str) -> Response:
        c = control(request)
        timeout = (await _json_body(request)).get("timeout")
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout < 0:
            raise InvalidArgument("timeout must be a number of seconds")
        await (await c.sandbox(sandbox_id)).set_timeout(timeout)
        return Response(status_code=204)

    @app.post("/sandboxes/{sandbox_id}/pause")
    async def pause(request: Request, sandbox_id: str) -> Response:
        c = control(request)
        if not await c.pause(sandbox_id, await _json_body(request)):
            return JSONResponse(control_body(409, f"sandbox {sandbox_id} is already paused"),
                                status_code=409)
        return Response(status_code=204)

    @app.post("/sandboxes/{sandbox_id}/resume")
    async def resume(request: Request, sandbox_id: str) -> JSONResponse:
        c = control(request)
        sandbox, resumed = await c.connect(sandbox_id, await _json_body(request))
        if not resumed:
            return JSONResponse(control_body(409, f"sandbox {sandbox_id} is already running"),
                                status_code=409)
        return JSONResponse(c.created(sandbox), status_code=201)

    @app.post("/sandboxes/{sandbox_id}/snapshots")
    async def snapshot(request: Request, sandbox_id: str) -> JSONResponse:
        c = control(request)
        return JSONResponse(await c.snapshot(sandbox_id, await _json_body(request)),
                            status_code=201)

    @app.get("/snapshots")
    async def snapshots(request: Request) -> JSONResponse:
        return JSONResponse(await control(request).snapshots(request.query_params))

    @app.delete("/templates/{template_id}")
    async def delete_snapshot(request: Request, template_id: str) -> Response:
        await control(request).delete_snapshot(template_id)
        return Response(status_code=204)

    @app.post("/sandboxes/{sandbox_id}/fork")
    async def fork(request: Request, sandbox_id: str) -> JSONResponse:
        c = control(request)
        return JSONResponse(await c.fork(sandbox_id, await _json_body(request)),
                            status_code=201)

    @app.get("/sandboxes/{sandbox_id}/metrics")
    async def metrics(request: Request, sandbox_id: str) -> JSONResponse:
        await control(request).sandbox(sandbox_id)
        return JSONResponse([])

    return app
