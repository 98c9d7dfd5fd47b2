"""Configuration: per-provider models as a discriminated union, sandbox options,
and the precedence rule

    command-line flag > run config file (hutch.toml) > server defaults > built-in (local)

Each layer is a mapping of the same shape as ``hutch.toml``::

    provider = "docker"              # which provider
    idle_suspend_after = 300         # sandbox options (see SandboxOptions)

    [providers.docker]               # settings of one provider
    image = "hutch-test:bookworm"

A flat mapping (as command-line flags give) is also accepted: keys that are
sandbox options go to the options, the rest to the chosen provider.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from ._errors import InvalidArgument
from ._types import MAX_DURATION, MAX_OUTPUT_LIMIT
from .providers.bubblewrap import BubblewrapConfig
from .providers.docker import DockerConfig
from .providers.local import LocalConfig
from .providers.ssh.config import SshConfig
from .providers.virtual import VirtualConfig

ProviderConfig = Annotated[
    LocalConfig | VirtualConfig | DockerConfig | SshConfig | BubblewrapConfig,
    Field(discriminator="type"),
]
_provider_adapter: TypeAdapter[Any] = TypeAdapter(ProviderConfig)
#: The providers whose settings this module knows (the ``type`` of each model).
CONFIGURED_PROVIDERS: tuple[str, ...] = tuple(
    sorted(
        str(model.model_fields["type"].default)
        for model in (LocalConfig, VirtualConfig, DockerConfig, SshConfig, BubblewrapConfig)
    )
)

DEFAULT_PROVIDER = "local"
CONFIG_FILE_NAME = "hutch.toml"


class SandboxOptions(BaseModel):
    """What hutch does around a sandbox, whatever provider runs it.

    No time limit is implicit: unset means none.
    """

    # Finite and bounded: a deadline no clock can reach would be stored, and
    # then break every listing that has to render it.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    #: Suspend after this many seconds idle (work-aware); unset: never.
    idle_suspend_after: float | None = Field(default=None, gt=0, le=MAX_DURATION)
    #: Resume a suspended sandbox on its next operation (else sandbox_unavailable).
    auto_resume: bool = True
    #: Terminate after this many seconds idle (work-aware).
    idle_timeout: float | None = Field(default=None, gt=0, le=MAX_DURATION)
    #: Terminate this many seconds after start, whatever the activity.
    max_lifetime: float | None = Field(default=None, gt=0, le=MAX_DURATION)
    #: Refuse to overwrite or delete a file this session has not read.
    read_before_write: bool = True
    #: Cap on one command's output, bytes.
    output_limit: int = Field(default=16 * 1024 * 1024, gt=0, le=MAX_OUTPUT_LIMIT)


OPTION_KEYS = frozenset(SandboxOptions.model_fields)


class SandboxSpec(BaseModel):
    """A whole request for a sandbox: provider settings and options."""

    model_config = ConfigDict(extra="forbid")

    provider: ProviderConfig = Field(default_factory=LocalConfig)
    options: SandboxOptions = Field(default_factory=SandboxOptions)


def parse_provider_config(data: Mapping[str, Any]) -> Any:
    try:
        return _provider_adapter.validate_python(dict(data))
    except ValidationError as exc:
        raise InvalidArgument(f"bad provider settings: {_short(exc)}") from None


def _short(exc: ValidationError) -> str:
    return "; ".join(
        f"{'.'.join(str(p) for p in e['loc']) or 'value'}: {e['msg']}" for e in exc.errors()
    )


def _normalize_layer(layer: Mapping[str, Any] | None) -> dict[str, Any]:
    """Turn a flat or nested layer into ``{provider, options, providers}``."""
    if not layer:
        return {"provider": None, "options": {}, "providers": {}}
    layer = dict(layer)
    provider = layer.pop("provider", None)
    nested = dict(layer.pop("providers", {}) or {})
    options = dict(layer.pop("options", {}) or {})
    loose: dict[str, Any] = {}
    for key, value in layer.items():
        if value is None:
            continue
        if key in OPTION_KEYS:
            options[key] = value
        else:
            loose[key] = value
    return {"provider": provider, "options": options, "providers": nested, "loose": loose}


def resolve_spec(
    *,
    flags: Mapping[str, Any] | None = None,
    config_file: Mapping[str, Any] | None = None,
    server_defaults: Mapping[str, Any] | None = None,
) -> SandboxSpec:
    """Merge the layers by precedence into one validated :class:`SandboxSpec`."""
    layers = [_normalize_layer(x) for x in (server_defaults, config_file, flags)]  # low -> high
    provider = DEFAULT_PROVIDER
    for layer in layers:
        if layer["provider"]:
            provider = str(layer["provider"])
    settings: dict[str, Any] = {}
    options: dict[str, Any] = {}
    for layer in layers:
        settings.update(layer["providers"].get(provider, {}) or {})
        settings.update(layer.get("loose", {}))
        options.update(layer["options"])
    settings["type"] = provider
    try:
        opts = SandboxOptions.model_validate(options)
    except ValidationError as exc:
        raise InvalidArgument(f"bad sandbox options: {_short(exc)}") from None
    if provider not in CONFIGURED_PROVIDERS:
        raise InvalidArgument(
            f"unknown provider {provider!r}; available: {', '.join(CONFIGURED_PROVIDERS)}"
        )
    return SandboxSpec(provider=parse_provider_config(settings), options=opts)


def load_config_file(path: str | Path | None = None) -> dict[str, Any]:
    """The run config file: ``path``, else ``./hutch.toml`` if present, else empty."""
    data = load_config_data(path)
    sandbox = data.get("sandbox", {})
    return {**sandbox, "providers": data.get("providers", {})}


def load_config_data(path: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    """The whole parsed ``hutch.toml`` (``path``, else ``./hutch.toml``), or empty."""
    candidate = Path(path) if path is not None else Path.cwd() / CONFIG_FILE_NAME
    if not candidate.exists():
        if path is not None:
            raise InvalidArgument(f"config file {candidate} does not exist")
        return {}
    try:
        data = tomllib.loads(candidate.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise InvalidArgument(f"config file {candidate} is not valid TOML: {exc}") from None
    return data
