"""hutch: a self-hosted sandbox manager for AI agents.

    import hutch

    async with await hutch.create_sandbox("local", workdir="/tmp/work") as sb:
        result = await sb.exec("echo hello")
        await sb.write_text("notes.txt", "hi")
"""

#: As typing.TYPE_CHECKING (type checkers take the name as true), without
#: importing typing, which costs ``hutch --help`` a tenth of its time.
TYPE_CHECKING = False

if TYPE_CHECKING:  # the names, for type checkers; at run time each is imported on first use
    from ._api import (
        create_sandbox,
        create_sandbox_from_snapshot,
        remove_snapshot,
    )
    from ._attach import attach, attach_sync
    from ._errors import (
        CapabilityUnsupported,
        DaemonBusy,
        ExecTimeout,
        HutchError,
        IdleTimeoutExpired,
        InvalidArgument,
        InvalidState,
        MaxLifetimeExceeded,
        NotFound,
        OutputLimitExceeded,
        ProviderError,
        ReadBeforeWrite,
        ResourceExhausted,
        SandboxExpired,
        SandboxFileExists,
        SandboxFileNotFound,
        SandboxIsADirectory,
        SandboxNotADirectory,
        SandboxPermissionDenied,
        SandboxUnavailable,
        SetupFailed,
        StdinClosed,
        StoreUnavailable,
        TimeoutExpired,
        TimeoutTooLarge,
        Unauthorized,
    )
    from ._process import Process
    from ._sandbox import Sandbox
    from ._snapshots import Fork
    from ._sync_generated import (
        SyncFork,
        SyncProcess,
        SyncPtyProcess,
        SyncSandbox,
        create_sandbox_sync,
    )
    from ._types import (
        Capabilities,
        ExecResult,
        ExitStatus,
        FileEvent,
        FileInfo,
        FileType,
        GrepMatch,
        OutputChunk,
        Snapshot,
        SnapshotDependent,
    )
    from ._watch import Watcher
    from .client import AsyncClient, Client
    from .config import SandboxOptions, SandboxSpec
    from .lifecycle.clock import RealClock, VirtualClock
    from .lifecycle.engine import LifecycleEngine, default_engine
    from .states import SandboxState, SandboxStatus

_LAZY = {
    "create_sandbox": "._api",
    "create_sandbox_from_snapshot": "._api",
    "create_sandbox_sync": "._sync_generated",
    "SyncFork": "._sync_generated",
    "SyncProcess": "._sync_generated",
    "SyncPtyProcess": "._sync_generated",
    "SyncSandbox": "._sync_generated",
    "remove_snapshot": "._api",
    "CapabilityUnsupported": "._errors",
    "DaemonBusy": "._errors",
    "ExecTimeout": "._errors",
    "HutchError": "._errors",
    "IdleTimeoutExpired": "._errors",
    "InvalidArgument": "._errors",
    "InvalidState": "._errors",
    "MaxLifetimeExceeded": "._errors",
    "NotFound": "._errors",
    "OutputLimitExceeded": "._errors",
    "ProviderError": "._errors",
    "ReadBeforeWrite": "._errors",
    "ResourceExhausted": "._errors",
    "SandboxExpired": "._errors",
    "SandboxFileExists": "._errors",
    "SandboxFileNotFound": "._errors",
    "SandboxNotADirectory": "._errors",
    "StdinClosed": "._errors",
    "SandboxIsADirectory": "._errors",
    "SandboxPermissionDenied": "._errors",
    "SandboxUnavailable": "._errors",
    "SetupFailed": "._errors",
    "StoreUnavailable": "._errors",
    "TimeoutExpired": "._errors",
    "TimeoutTooLarge": "._errors",
    "Unauthorized": "._errors",
    "ExitStatus": "._types",
    "Process": "._process",
    "attach": "._attach",
    "attach_sync": "._attach",
    "Sandbox": "._sandbox",
    "Fork": "._snapshots",
    "Snapshot": "._types",
    "SnapshotDependent": "._types",
    "Capabilities": "._types",
    "ExecResult": "._types",
    "FileEvent": "._types",
    "FileInfo": "._types",
    "Watcher": "._watch",
    "FileType": "._types",
    "GrepMatch": "._types",
    "OutputChunk": "._types",
    "AsyncClient": ".client",
    "Client": ".client",
    "SandboxOptions": ".config",
    "SandboxSpec": ".config",
    "RealClock": ".lifecycle.clock",
    "VirtualClock": ".lifecycle.clock",
    "LifecycleEngine": ".lifecycle.engine",
    "SandboxStatus": ".states",
    "default_engine": ".lifecycle.engine",
    "SandboxState": ".states",
}

__version__ = "0.1.0"

__all__ = [
    "Fork",
    "Snapshot",
    "SnapshotDependent",
    "create_sandbox_from_snapshot",
    "remove_snapshot",
    "AsyncClient",
    "Client",
    "Capabilities",
    "CapabilityUnsupported",
    "ExecResult",
    "ExecTimeout",
    "DaemonBusy",
    "ExitStatus",
    "FileEvent",
    "FileInfo",
    "Watcher",
    "FileType",
    "GrepMatch",
    "HutchError",
    "IdleTimeoutExpired",
    "InvalidArgument",
    "InvalidState",
    "LifecycleEngine",
    "MaxLifetimeExceeded",
    "NotFound",
    "OutputChunk",
    "OutputLimitExceeded",
    "Process",
    "ProviderError",
    "SetupFailed",
    "StoreUnavailable",
    "SyncFork",
    "SyncProcess",
    "SyncPtyProcess",
    "SyncSandbox",
    "ReadBeforeWrite",
    "ResourceExhausted",
    "RealClock",
    "Sandbox",
    "SandboxExpired",
    "SandboxFileExists",
    "SandboxFileNotFound",
    "SandboxNotADirectory",
    "StdinClosed",
    "SandboxIsADirectory",
    "SandboxOptions",
    "SandboxPermissionDenied",
    "SandboxSpec",
    "SandboxState",
    "SandboxStatus",
    "SandboxUnavailable",
    "TimeoutExpired",
    "TimeoutTooLarge",
    "Unauthorized",
    "VirtualClock",
    "attach",
    "attach_sync",
    "create_sandbox",
    "create_sandbox_sync",
    "default_engine",
]


def __getattr__(name: str) -> object:
    """Import what a name needs on first use: ``import hutch`` stays cheap for
    the CLI and the client, which need neither the providers nor the engine.
    A submodule (``hutch.client``) is there as an attribute too, as it was
    when this package imported everything."""
    from importlib import import_module

    module = _LAZY.get(name)
    if module is None:
        try:
            return import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    value = getattr(import_module(module, __name__), name)
    globals()[name] = value
    return value
