"""hutch: a self-hosted sandbox manager for AI agents.

    import hutch

    async with await hutch.create_sandbox("local", workdir="/tmp/work") as sb:
        result = await sb.exec("echo hello")
        await sb.write_text("notes.txt", "hi")
"""

from ._api import create_sandbox, create_sandbox_sync
from ._errors import (
    CapabilityUnsupported,
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
    SandboxExpired,
    SandboxFileNotFound,
    SandboxIsADirectory,
    SandboxPermissionDenied,
    SandboxUnavailable,
    TimeoutExpired,
    TimeoutTooLarge,
    Unauthorized,
)
from ._process import ExitStatus, Process
from ._sandbox import Sandbox
from ._types import Capabilities, ExecResult, FileInfo, FileType, GrepMatch, OutputChunk
from .config import SandboxOptions, SandboxSpec

__version__ = "0.1.0"

__all__ = [
    "Capabilities",
    "CapabilityUnsupported",
    "ExecResult",
    "ExecTimeout",
    "ExitStatus",
    "FileInfo",
    "FileType",
    "GrepMatch",
    "HutchError",
    "IdleTimeoutExpired",
    "InvalidArgument",
    "InvalidState",
    "MaxLifetimeExceeded",
    "NotFound",
    "OutputChunk",
    "OutputLimitExceeded",
    "Process",
    "ProviderError",
    "ReadBeforeWrite",
    "Sandbox",
    "SandboxExpired",
    "SandboxFileNotFound",
    "SandboxIsADirectory",
    "SandboxOptions",
    "SandboxPermissionDenied",
    "SandboxSpec",
    "SandboxUnavailable",
    "TimeoutExpired",
    "TimeoutTooLarge",
    "Unauthorized",
    "create_sandbox",
    "create_sandbox_sync",
]
