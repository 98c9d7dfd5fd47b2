"""The operator's rules for what API clients may ask of the daemon.

Provider-neutral: it reads the marks each provider puts on its config model
(:mod:`hutch.providers.policy`), never a provider's field names.

- A setting that reaches the host (host mounts, a host working directory,
  the host's network, restored capabilities) is refused with
  ``permission_denied`` unless the operator allows it by name (``hutch serve
  --allow NAME``, or ``allow = [...]`` under ``[server]`` in hutch.toml) or
  set it themselves in the server's sandbox defaults.
- A provider that runs on the host itself (its ``runs_on_host`` capability:
  ``local``, ``ssh``) is refused with ``permission_denied`` unless the operator
  allows it (``hutch serve --allow-provider NAME``, or ``providers = [...]``
  under ``[server]``) or made it the daemon's default provider.
- A request that names no provider gets the operator's default provider
  (``[sandbox] provider`` in hutch.toml, or ``hutch serve --provider``), else
  the first of ``providers.registry.ISOLATING_DEFAULTS`` whose engine answers
  (``pick_default_provider``, the rule every caller shares): never one that
  runs on the host unless the operator chose it.
- Resource limits a request leaves unset get the server's defaults; a value
  over the operator's ceiling is refused with ``invalid_argument``.
- The daemon serves at most ``max_sandboxes`` at once (``[server]`` in
  hutch.toml; unset: no limit), the runtimes warm pools keep ready included
  (hutch.daemon.pools): past it a create is ``resource_exhausted``.
"""

from __future__ import annotations

import math
import os
from collections.abc import Collection, Mapping
from typing import Any

from pydantic import BaseModel

from .._errors import InvalidArgument, SandboxPermissionDenied
from ..providers.policy import (
    LIMIT_KINDS,
    ReachesHost,
    format_bytes,
    host_reaching,
    limits,
    parse_bytes,
    relative_host_paths,
)
from ..providers.registry import available_providers, get_provider, provider_known

#: Limits a sandbox made through the daemon gets when neither the request nor
#: the operator says otherwise (each where its provider declares the limit;
#: the ``disk_limit`` capability says whether disk is).
DEFAULT_LIMITS: dict[str, float] = {
    "memory": 2 * 1024**3,
    "cpus": 1.0,
    "pids": 1024,
    "disk": 4 * 1024**3,
}
#: The most a request may ask for unless the operator raises it.
DEFAULT_CEILINGS: dict[str, float] = {
    "memory": 16 * 1024**3,
    "cpus": float(os.cpu_count() or 1),
    "pids": 32768,
    "disk": 256 * 1024**3,
}

_HOW_TO_ALLOW_PROVIDER = (
    "start the daemon with `hutch serve --allow-provider {name}`, or add \"{name}\" to "
    "`providers` under [server] in hutch.toml"
)

_HOW_TO_ALLOW = (
    "start the daemon with `hutch serve --allow {name}`, or add \"{name}\" to `allow` "
    "under [server] in hutch.toml"
)


def host_reaching_setting_names() -> set[str]:
    """Every setting any known provider marks as reaching the host."""
    names: set[str] = set()
    for provider in available_providers():
        try:
            model = get_provider(provider).config_model
        except Exception:  # a broken third-party entry point names nothing
            continue
        for name, field in model.model_fields.items():
            if any(isinstance(m, ReachesHost) for m in field.metadata):
                names.add(name)
    return names


def parse_limit(kind: str, value: Any) -> float:
    """An operator's limit as a number in its kind's unit (bytes, CPUs, processes)."""
    if kind not in LIMIT_KINDS:
        raise InvalidArgument(f"unknown limit {kind!r}; known: {', '.join(LIMIT_KINDS)}")
    try:
        number = parse_bytes(value) if kind in ("memory", "disk") else float(value)
    except (TypeError, ValueError) as exc:
        raise InvalidArgument(f"limit {kind}: {exc}") from None
    if not 0 < number < math.inf:
        raise InvalidArgument(f"limit {kind} must be a positive number, got {value!r}")
    return number


def _shown(kind: str, number: float) -> str:
    return format_bytes(number) if kind in ("memory", "disk") else f"{number:g}"


class OperatorPolicy:
    def __init__(
        self,
        allow: Collection[str] = (),
        limit_defaults: Mapping[str, Any] | None = None,
        limit_ceilings: Mapping[str, Any] | None = None,
        providers: Collection[str] = (),
        *,
        max_sandboxes: int | None = None,
    ) -> None:
        if max_sandboxes is not None and max_sandboxes < 1:
            raise InvalidArgument(f"max_sandboxes must be 1 or more, got {max_sandboxes}")
        #: The most sandboxes served at once, pooled ones included (None: no limit).
        self.max_sandboxes = max_sandboxes
        unknown_providers = sorted(p for p in set(providers) if not provider_known(p))
        if unknown_providers:
            raise InvalidArgument(
                f"cannot allow provider {', '.join(unknown_providers)}: no such provider "
                f"(available: {', '.join(available_providers())})"
            )
        #: Providers that run on the host which API clients may nonetheless use.
        self.providers = frozenset(providers)
        known = host_reaching_setting_names()
        unknown = sorted(set(allow) - known)
        if unknown:
            raise InvalidArgument(
                f"cannot allow {', '.join(unknown)}: not a setting that reaches the host "
                f"(those are: {', '.join(sorted(known))})"
            )
        self.allow = frozenset(allow)
        self.defaults: dict[str, float] = dict(DEFAULT_LIMITS)
        self.defaults.update({k: parse_limit(k, v) for k, v in (limit_defaults or {}).items()})
        self.ceilings: dict[str, float] = dict(DEFAULT_CEILINGS)
        self.ceilings.update({k: parse_limit(k, v) for k, v in (limit_ceilings or {}).items()})
        for kind, default in self.defaults.items():
            ceiling = self.ceilings.get(kind)
            if ceiling is not None and default > ceiling:
                raise InvalidArgument(
                    f"default {kind} limit {_shown(kind, default)} is over its ceiling "
                    f"{_shown(kind, ceiling)}"
                )

    def admit_provider(self, name: str, default: str | None) -> None:
        """Refuse provider ``name`` to an API client if it runs on the host and
        the operator neither allowed it nor made it the ``default``."""
        if name in self.providers or name == default:
            return
        try:
            provider = get_provider(name)
        except InvalidArgument:
            return  # unknown, or not installed: resolve_spec says which
        if provider.capabilities.runs_on_host:
            raise SandboxPermissionDenied(
                f"provider {name!r} runs commands on the host itself, not in a sandbox of "
                f"their own; through the daemon only its operator may hand it out. To allow "
                f"it, " + _HOW_TO_ALLOW_PROVIDER.format(name=name)
            )

    def admit(self, requested: BaseModel, operators: BaseModel | None) -> BaseModel:
        """``requested`` (a provider config a client asked for) as the daemon runs
        it: refused if it reaches the host beyond what the operator set
        (``operators``: the same provider's config from the server defaults
        alone) or allowed, limits filled in and held to their ceilings."""
        for name in relative_host_paths(requested):
            raise InvalidArgument(
                f"the {getattr(requested, 'type', 'provider')} setting {name!r} is "
                f"{getattr(requested, name)!r}, a path on the daemon's host that is not "
                "absolute: the daemon's working directory is not the caller's; give an "
                "absolute path"
            )
        operator_set = host_reaching(operators) if operators is not None else {}
        for name, why in host_reaching(requested).items():
            if name in self.allow:
                continue
            if (name in operator_set and operators is not None
                    and name in operators.model_fields_set
                    and getattr(requested, name) == getattr(operators, name)):
                continue  # the operator's own setting (not a default nobody set)
            raise SandboxPermissionDenied(
                f"the {getattr(requested, 'type', 'provider')} setting {name!r} {why}; "
                f"through the daemon only its operator may set it. To allow it, "
                + _HOW_TO_ALLOW.format(name=name)
            )
        updates: dict[str, Any] = {}
        for kind, (name, mark) in limits(requested).items():
            value = getattr(requested, name)
            if name in requested.model_fields_set and value is not None:
                measured = mark.measure(value)
                ceiling = self.ceilings.get(kind)
                if ceiling is not None and measured > ceiling:
                    raise InvalidArgument(
                        f"{name} {value} is over this daemon's ceiling of "
                        f"{_shown(kind, ceiling)} ({kind}); the operator sets ceilings under "
                        "[server.ceilings] in hutch.toml"
                    )
            elif kind in self.defaults:
                updates[name] = mark.express(self.defaults[kind])
        return requested.model_copy(update=updates) if updates else requested
