"""Providers by name: built-ins imported lazily, third parties by entry point.

A third-party provider registers a :class:`SandboxBackend` subclass under the
``hutch.providers`` entry-point group::

    [project.entry-points."hutch.providers"]
    myprovider = "my_package.module:MySandbox"
"""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points

from .._errors import InvalidArgument
from .base import SandboxBackend

#: name -> (import path, what to install if the import fails)
BUILTIN_PROVIDERS: dict[str, tuple[str, str | None]] = {
    "local": ("hutch.providers.local:LocalSandbox", None),
    "virtual": ("hutch.providers.virtual:VirtualSandbox", None),
    "docker": ("hutch.providers.docker:DockerSandbox", "pip install 'hutch[docker]'"),
    "ssh": ("hutch.providers.ssh.provider:SshSandbox", "pip install asyncssh"),
    "bubblewrap": ("hutch.providers.bubblewrap:BubblewrapSandbox", None),
    "e2b": ("hutch.providers.e2b:E2BSandbox", "pip install 'hutch[e2b]'"),
    "gvisor": ("hutch.providers.gvisor:GvisorSandbox", None),
    "kubernetes": ("hutch.providers.kubernetes:KubernetesSandbox",
                   "pip install 'hutch[kubernetes]'"),
}

ENTRY_POINT_GROUP = "hutch.providers"

_loaded: dict[str, type[SandboxBackend]] = {}


def _import(target: str) -> type[SandboxBackend]:
    module_name, _, attr = target.partition(":")
    cls = getattr(importlib.import_module(module_name), attr)
    if not (isinstance(cls, type) and issubclass(cls, SandboxBackend)):
        raise InvalidArgument(f"{target} is not a SandboxBackend subclass")
    return cls


def available_providers() -> list[str]:
    names = set(BUILTIN_PROVIDERS) | set(_loaded)
    names.update(ep.name for ep in entry_points(group=ENTRY_POINT_GROUP))
    return sorted(names)


def provider_known(name: str) -> bool:
    """Whether ``name`` is a provider here: the built-ins and those registered
    are known without reading every installed distribution's entry points
    (which costs milliseconds on each sandbox made)."""
    if name in BUILTIN_PROVIDERS or name in _loaded:
        return True
    return any(ep.name == name for ep in entry_points(group=ENTRY_POINT_GROUP))


def register_provider(name: str, cls: type[SandboxBackend]) -> None:
    """Register a provider class at run time (tests, embedding applications)."""
    _loaded[name] = cls


def get_provider(name: str) -> type[SandboxBackend]:
    """The backend class for ``name``; ``InvalidArgument`` naming what to install."""
    if name in _loaded:
        return _loaded[name]
    if name in BUILTIN_PROVIDERS:
        target, hint = BUILTIN_PROVIDERS[name]
        try:
            cls = _import(target)
        except ImportError as exc:
            raise InvalidArgument(
                f"provider {name!r} needs a dependency that is missing ({exc.name})"
                + (f": {hint}" if hint else "")
            ) from exc
    else:
        matches = [ep for ep in entry_points(group=ENTRY_POINT_GROUP) if ep.name == name]
        if not matches:
            raise InvalidArgument(
                f"unknown provider {name!r}; available: {', '.join(available_providers())}"
            )
        cls = matches[0].load()
        if not (isinstance(cls, type) and issubclass(cls, SandboxBackend)):
            raise InvalidArgument(f"entry point {name!r} is not a SandboxBackend subclass")
    _loaded[name] = cls
    return cls


#: The providers a sandbox gets where no one named one (a daemon whose
#: operator chose none, the inspect_ai environment), by preference: the
#: first whose engine answers here, else the last. Never one that runs on
#: the host: that is the operator's choice to make.
ISOLATING_DEFAULTS = ("docker", "bubblewrap")


def pick_default_provider() -> str:
    """The first of :data:`ISOLATING_DEFAULTS` whose engine answers, else the last."""
    for name in ISOLATING_DEFAULTS[:-1]:
        try:
            provider = get_provider(name)
        except InvalidArgument:  # its client library is not installed
            continue
        if not provider.capabilities.runs_on_host and provider.answers_here():
            return name
    return ISOLATING_DEFAULTS[-1]
