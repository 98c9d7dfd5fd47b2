"""Making sandboxes in-process (no daemon): ``create_sandbox`` and the rest.

Their sync twins (``create_sandbox_sync``) are generated, in
:mod:`hutch._sync_generated`."""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Mapping
from typing import Any

import anyio

from ._errors import HutchError, InvalidArgument
from ._sandbox import Sandbox, live_of, new_sandbox_id
from ._types import Snapshot
from .config import SandboxOptions, SandboxSpec, resolve_spec
from .lifecycle.engine import LifecycleEngine, default_engine
from .providers.base import SandboxBackend
from .providers.registry import get_provider
from .states import SandboxState


async def create_sandbox(
    provider: str | None = None,
    *,
    spec: SandboxSpec | None = None,
    options: SandboxOptions | Mapping[str, Any] | None = None,
    sandbox_id: str | None = None,
    engine: LifecycleEngine | None = None,
    **settings: Any,
) -> Sandbox:
    """Provision a sandbox and return it, running.

    ``create_sandbox("docker", image="hutch-test:bookworm", idle_timeout=60)``:
    keyword settings are the provider's settings and the sandbox options, as
    on the command line; or pass a whole ``spec``.
    """
    if spec is None:
        flags: dict[str, Any] = dict(settings)
        if provider is not None:
            flags["provider"] = provider
        if options is not None:
            flags["options"] = (
                options.model_dump() if isinstance(options, SandboxOptions) else dict(options)
            )
        spec = resolve_spec(flags=flags)
    backend_cls = get_provider(spec.provider_name)
    sid = sandbox_id or new_sandbox_id()
    backend = await _made(backend_cls, sid, backend_cls.create(spec.provider, sid))
    return await _track(backend, spec, engine)


async def _made(
    backend_cls: type[SandboxBackend], sandbox_id: str, making: Awaitable[SandboxBackend]
) -> SandboxBackend:
    """The sandbox ``making`` provisions; if it fails or is cancelled part-way,
    what it made goes now (shielded: a cancel would skip it), not never."""
    try:
        return await making
    except BaseException:
        with anyio.CancelScope(shield=True), contextlib.suppress(HutchError):
            await backend_cls.discard(sandbox_id)
        raise


async def _track(
    backend: Any,
    spec: SandboxSpec,
    engine: LifecycleEngine | None,
    state: SandboxState = SandboxState.RUNNING,
    *,
    created_unix: float | None = None,
    deadline_unix: float | None = None,
) -> Sandbox:
    opts = spec.options
    engine = engine or default_engine()
    sandbox = Sandbox(
        backend,
        sandbox_id=backend.sandbox_id,
        read_before_write=opts.read_before_write,
        output_limit=opts.output_limit,
        # Branches join the engine that tracks their origin (its clock, its timers).
        factory=InProcessFactory(engine),
    )
    sandbox.spec = spec
    try:
        await engine.attach(
            live_of(sandbox), opts, state=state, created_unix=created_unix,
            deadline_unix=deadline_unix,
        )
    except BaseException:
        with anyio.CancelScope(shield=True):
            await backend.close()
        raise
    return sandbox


async def adopt_sandbox(
    backend: SandboxBackend,
    spec: SandboxSpec,
    engine: LifecycleEngine | None = None,
    *,
    state: SandboxState = SandboxState.RUNNING,
    created_unix: float | None = None,
    deadline_unix: float | None = None,
) -> Sandbox:
    """A sandbox for ``backend``, one an earlier process made and this one
    found again (``SandboxBackend.reconnect``), tracked like a new one, in
    the ``state`` it was found in (a suspended one is resumed by its next
    operation, or by ``resume``), with its time limits as recorded: when it
    was made (``created_unix``: max_lifetime counts from there) and its
    set_timeout deadline (``deadline_unix``)."""
    return await _track(backend, spec, engine, state,
                        created_unix=created_unix, deadline_unix=deadline_unix)


def spec_for_attach(
    snapshot: Snapshot, options: SandboxOptions | Mapping[str, Any] | None
) -> SandboxSpec:
    """The settings a sandbox started from ``snapshot`` gets: its origin's,
    with ``options`` (sandbox options) replacing the origin's where given."""
    if not snapshot.spec:
        raise InvalidArgument(f"snapshot {snapshot.id} does not say what it was taken of")
    spec = SandboxSpec.model_validate(dict(snapshot.spec))
    if options:
        given = options.model_dump(exclude_unset=True) if isinstance(
            options, SandboxOptions
        ) else dict(options)
        merged = {**spec.options.model_dump(), **given}
        spec = spec.model_copy(update={"options": SandboxOptions.model_validate(merged)})
    return spec


async def create_sandbox_from_snapshot(
    snapshot: Snapshot,
    *,
    options: SandboxOptions | Mapping[str, Any] | None = None,
    sandbox_id: str | None = None,
    engine: LifecycleEngine | None = None,
) -> Sandbox:
    """A new sandbox started from ``snapshot`` (a fork's ``attach``)."""
    if snapshot.handle is None:
        raise InvalidArgument(
            f"snapshot {snapshot.id} is held by a daemon: attach through its client"
        )
    spec = spec_for_attach(snapshot, options)
    backend_cls = get_provider(snapshot.provider)
    sid = sandbox_id or new_sandbox_id()
    backend = await _made(
        backend_cls, sid, backend_cls.create_from_snapshot(spec.provider, sid, snapshot.handle))
    sandbox = await _track(backend, spec, engine)
    sandbox.base_snapshot_id = sandbox.origin_snapshot_id = snapshot.id
    return sandbox


async def remove_snapshot(snapshot: Snapshot) -> None:
    """Free a snapshot's provider storage (in-process; the daemon also
    refuses while something depends on it). Idempotent."""
    if snapshot.handle is None:
        raise InvalidArgument(
            f"snapshot {snapshot.id} is held by a daemon: remove it through its client"
        )
    await get_provider(snapshot.provider).remove_snapshot(snapshot.handle)


class InProcessFactory:
    """Starts a fork's branches in this process, tracked by ``engine``, and
    frees its snapshot (the :class:`~hutch._snapshots.SandboxFactory` of the
    sandboxes made here)."""

    def __init__(self, engine: LifecycleEngine) -> None:
        self.engine = engine

    async def from_snapshot(
        self, snapshot: Snapshot, options: Mapping[str, Any] | None
    ) -> Sandbox:
        return await create_sandbox_from_snapshot(snapshot, options=options, engine=self.engine)

    async def remove_snapshot(self, snapshot: Snapshot) -> None:
        await remove_snapshot(snapshot)

