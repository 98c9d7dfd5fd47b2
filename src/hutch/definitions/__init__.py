"""Sandbox definitions (SPEC §6): a named recipe for a sandbox, one sandbox
per thread made once and reused, a snapshot after setup, and ``ensure``."""

from .._errors import SetupFailed
from .ensure import (
    Definitions,
    Ensured,
    LocalHost,
    SandboxHost,
    Step,
    label_for,
    open_definitions,
)
from .model import (
    Definition,
    DirSource,
    GitSource,
    Lifecycle,
    WorkspaceSpec,
    definitions_from_config,
    load_definitions,
    parse_duration,
)

__all__ = [
    "Definition", "Definitions", "DirSource", "Ensured", "GitSource", "Lifecycle", "LocalHost",
    "SandboxHost", "SetupFailed", "Step", "WorkspaceSpec", "definitions_from_config",
    "label_for", "load_definitions", "open_definitions", "parse_duration",
]
