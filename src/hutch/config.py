"""Configuration: each provider's settings validated by its own ``config_model``
(found through the provider registry, so a provider registered at run time or
by the ``hutch.providers`` entry point is configured like a built-in one),
sandbox options, and the precedence rule

    command-line flag > run config file (hutch.toml) > server defaults > built-in (local
    in-process, the daemon's default provider through it; docker for a request that
    names an image where that one takes none)

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
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    SerializeAsAny,
    ValidationError,
)

from ._errors import InvalidArgument
from ._types import MAX_DURATION, MAX_OUTPUT_LIMIT
from .providers.base import ProviderSettings
from .providers.local import LocalConfig
from .providers.registry import available_providers, get_provider, provider_known


def _by_registry(value: Any) -> Any:
    """Provider settings as a mapping are validated by that provider's model."""
    if isinstance(value, Mapping):
        return parse_provider_config(value)
    return value


#: Any provider's settings: an instance of its own ``config_model``.
ProviderConfig = Annotated[SerializeAsAny[ProviderSettings], BeforeValidator(_by_registry)]

DEFAULT_PROVIDER = "local"
#: The provider of a request that names an image and no provider, where no
#: layer names one either: the built-in default has no images.
IMAGE_PROVIDER = "docker"
CONFIG_FILE_NAME = "hutch.toml"


MetadataKey = Annotated[str, Field(min_length=1, max_length=256)]
MetadataValue = Annotated[str, Field(max_length=4096)]


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
    #: What the set_timeout deadline does when it passes: end the sandbox
    #: (``terminate``), or ``suspend`` it until a resume (E2B's autoPause;
    #: where the provider cannot suspend, it ends all the same).
    on_timeout: Literal["terminate", "suspend"] = "terminate"
    #: A caller's own labels, kept with the sandbox and given back with it
    #: (E2B's ``metadata``, which its lists filter on).
    metadata: dict[MetadataKey, MetadataValue] = Field(default_factory=dict, max_length=64)


OPTION_KEYS = frozenset(SandboxOptions.model_fields)


class SandboxSpec(BaseModel):
    """A whole request for a sandbox: provider settings and options."""

    model_config = ConfigDict(extra="forbid")

    #: An instance of the provider's own ``config_model`` (its ``type`` names it).
    provider: ProviderConfig = Field(default_factory=LocalConfig)
    options: SandboxOptions = Field(default_factory=SandboxOptions)

    @property
    def provider_name(self) -> str:
        """The registry name of the provider these settings are for."""
        return self.provider.type


def parse_provider_config(data: Mapping[str, Any]) -> ProviderSettings:
    """``data`` (with its ``type``) validated by that provider's ``config_model``."""
    name = data.get("type")
    if not isinstance(name, str):
        raise InvalidArgument("provider settings need a 'type' naming the provider")
    model = get_provider(name).config_model
    try:
        return model.model_validate(dict(data))
    except ValidationError as exc:
        raise InvalidArgument(f"bad {name} settings: {_short(exc)}") from None


def _short(exc: ValidationError) -> str:
    """Each error as ``field: what is wrong`` (a check of the whole model
    names its field in its own message)."""
    def one(error: Any) -> str:
        message = str(error["msg"]).removeprefix("Value error, ")
        where = ".".join(str(p) for p in error["loc"])
        return f"{where}: {message}" if where else message

    return "; ".join(one(e) for e in exc.errors())


def _normalize_layer(layer: Mapping[str, Any] | None) -> dict[str, Any]:
    """Turn a flat or nested layer into ``{provider, options, providers}``."""
    if not layer:
        return {"provider": None, "options": {}, "providers": {}}
    layer = dict(layer)
    provider = layer.pop("provider", None)
    if provider is not None and not isinstance(provider, str):
        # Not a name to fall back from: 0, {} and [] are mistakes, not "unset".
        raise InvalidArgument(
            f"provider must be a provider's name (a string), not {type(provider).__name__}"
        )
    nested = layer.pop("providers", None) or {}
    options = layer.pop("options", None) or {}
    for key, table in (("providers", nested), ("options", options)):
        if not isinstance(table, Mapping):
            raise InvalidArgument(f"{key} must be a table (an object), not {type(table).__name__}")
    nested, options = dict(nested), dict(options)
    loose: dict[str, Any] = {}
    for key, value in layer.items():
        if value is None:
            continue
        if key in OPTION_KEYS:
            options[key] = value
        else:
            loose[key] = value
    return {"provider": provider, "options": options, "providers": nested, "loose": loose}


def _takes_images(provider: str) -> bool:
    try:
        return "image" in get_provider(provider).config_model.model_fields
    except InvalidArgument:  # unknown, or not installed here
        return False


def _provider_of(layers: list[dict[str, Any]], default: str) -> str:
    named = [str(layer["provider"]) for layer in layers if layer["provider"]]
    if named:
        return named[-1]
    if any("image" in layer.get("loose", {}) for layer in layers) and not _takes_images(default):
        return IMAGE_PROVIDER
    return default


def requested_provider(
    *,
    flags: Mapping[str, Any] | None = None,
    config_file: Mapping[str, Any] | None = None,
    server_defaults: Mapping[str, Any] | None = None,
    default_provider: str = DEFAULT_PROVIDER,
) -> str:
    """The name of the provider :func:`resolve_spec` would choose for these
    layers, before any of its settings is checked."""
    layers = [_normalize_layer(x) for x in (server_defaults, config_file, flags)]
    return _provider_of(layers, default_provider)


def resolve_spec(
    *,
    flags: Mapping[str, Any] | None = None,
    config_file: Mapping[str, Any] | None = None,
    server_defaults: Mapping[str, Any] | None = None,
    default_provider: str = DEFAULT_PROVIDER,
) -> SandboxSpec:
    """Merge the layers by precedence into one validated :class:`SandboxSpec`.

    ``default_provider`` is the provider where no layer names one (a request
    that names only an image gets :data:`IMAGE_PROVIDER` where it takes no
    images): ``local`` in-process, the daemon's own default through it."""
    layers = [_normalize_layer(x) for x in (server_defaults, config_file, flags)]  # low -> high
    provider = _provider_of(layers, default_provider)
    settings: dict[str, Any] = {}
    options: dict[str, Any] = {}
    for layer in layers:
        own = layer["providers"].get(provider) or {}
        if not isinstance(own, Mapping):
            raise InvalidArgument(f"providers.{provider} must be a table of its settings")
        settings.update(own)
        settings.update(layer.get("loose", {}))
        options.update(layer["options"])
    settings["type"] = provider
    try:
        opts = SandboxOptions.model_validate(options)
    except ValidationError as exc:
        raise InvalidArgument(f"bad sandbox options: {_short(exc)}") from None
    if not provider_known(provider):
        raise InvalidArgument(
            f"unknown provider {provider!r}; available: {', '.join(available_providers())}"
        )
    return SandboxSpec(provider=parse_provider_config(settings), options=opts)


def load_config_file(path: str | Path | None = None) -> dict[str, Any]:
    """The run config file: ``path``, else ``./hutch.toml`` if present, else empty."""
    return sandbox_layer(load_config_data(path))


def sandbox_layer(data: Mapping[str, Any]) -> dict[str, Any]:
    """The sandbox settings of a parsed ``hutch.toml``: its ``[sandbox]`` and
    ``[providers]`` tables, as one layer for :func:`resolve_spec`."""
    return {**data.get("sandbox", {}), "providers": data.get("providers", {})}


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
