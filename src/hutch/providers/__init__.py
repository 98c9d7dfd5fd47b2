"""Sandbox providers: one interface (:mod:`.base`), many backends."""

from .._types import ProviderSnapshot
from .base import (
    BackendProcess,
    ProcessRequest,
    PtyProcess,
    SandboxBackend,
    SandboxRuntime,
)
from .registry import available_providers, get_provider, register_provider

__all__ = [
    "BackendProcess",
    "ProcessRequest",
    "ProviderSnapshot",
    "PtyProcess",
    "SandboxBackend",
    "SandboxRuntime",
    "available_providers",
    "get_provider",
    "register_provider",
]
