"""Making sandboxes in-process (no daemon): ``create_sandbox`` and its sync twin."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ._sandbox import Sandbox, new_sandbox_id
from ._sync import SyncProxy, run_sync_factory
from .config import SandboxOptions, SandboxSpec, resolve_spec
from .lifecycle.engine import LifecycleEngine, default_engine
from .providers.registry import get_provider


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
    backend_cls = get_provider(spec.provider.type)
    sid = sandbox_id or new_sandbox_id()
    backend = await backend_cls.create(spec.provider, sid)
    opts = spec.options
    sandbox = Sandbox(
        backend,
        sandbox_id=sid,
        read_before_write=opts.read_before_write,
        output_limit=opts.output_limit,
    )
    try:
        await (engine or default_engine()).attach(sandbox, opts)
    except BaseException:
        await backend.close()
        raise
    return sandbox


def create_sandbox_sync(provider: str | None = None, **kwargs: Any) -> SyncProxy:
    """``create_sandbox`` for synchronous code: the same sandbox behind a sync face."""
    return run_sync_factory(create_sandbox, provider, **kwargs)
