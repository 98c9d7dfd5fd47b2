"""hutch: a self-hosted sandbox manager for AI agents.

    import hutch

    async with await hutch.create_sandbox("local", workdir="/tmp/work") as sb:
        result = await sb.exec("echo hello")
        await sb.write_text("notes.txt", "hi")
"""

from ._api import create_sandbox, create_sandbox_from_snapshot, create_sandbox_sync, remove_snapshot
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
    SandboxFileNotFound,
    SandboxIsADirectory,
    SandboxPermissionDenied,
    SandboxUnavailable,
    SetupFailed,
    StoreUnavailable,
    TimeoutExpired,
    TimeoutTooLarge,
    Unauthorized,
)
from ._process import ExitStatus, Process
from ._refs import attach, attach_sync
from ._sandbox import Sandbox
from ._snapshots import Fork, Snapshot, SnapshotDependent
from ._types import Capabilities, ExecResult, FileInfo, FileType, GrepMatch, OutputChunk
from .client import AsyncClient, Client
from .config import SandboxOptions, SandboxSpec
from .lifecycle.clock import RealClock, VirtualClock
from .lifecycle.engine import LifecycleEngine, SandboxStatus, default_engine
from .lifecycle.state import SandboxState

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
    "FileInfo",
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
    "ReadBeforeWrite",
    "ResourceExhausted",
    "RealClock",
    "Sandbox",
    "SandboxExpired",
    "SandboxFileNotFound",
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
