"""A sandbox definition: what a sandbox is made of and how long it lives.

The same fields in Python, in ``hutch.toml`` (``[definitions.NAME]``) and as
JSON on the wire (``PUT /v1/definitions/{id}``)::

    [definitions.repo-agent]
    provider = { type = "docker", image = "hutch-test:bookworm" }
    workspace = { source = { git = "file:///srv/repo", ref = "main" },
                  setup = ["pip install -e ."] }
    lifecycle = { reuse = "thread", keep_alive = "30m", snapshot_max_age = "24h" }

Durations are seconds (a number) or a number with a unit: ``90s``, ``30m``,
``24h``, ``7d``.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
)

from .._errors import InvalidArgument
from .._types import MAX_DURATION
from ..config import ProviderConfig, SandboxSpec, load_config_data, parse_provider_config

DEFINITION_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$")
_UNIT_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, None: 1.0}
#: Most setup steps, and longest one, a definition may carry.
MAX_SETUP_STEPS = 100
MAX_STEP_CHARS = 16 * 1024


def parse_duration(value: object) -> float:
    """Seconds from ``30``, ``30.5``, ``"90s"``, ``"30m"``, ``"24h"``, ``"7d"``."""
    if isinstance(value, bool):
        raise ValueError("a duration is a number of seconds or a string like 30m")
    if isinstance(value, int | float):
        seconds = float(value)
    elif isinstance(value, str):
        match = _DURATION.match(value)
        if match is None:
            raise ValueError(f"{value!r} is not a duration (write it like 90s, 30m, 24h, 7d)")
        seconds = float(match.group(1)) * _UNIT_SECONDS[match.group(2)]
    else:
        raise ValueError("a duration is a number of seconds or a string like 30m")
    if not 0 < seconds <= MAX_DURATION:
        raise ValueError(f"a duration must be above 0 and at most {MAX_DURATION:g} s")
    return seconds


Duration = Annotated[float, BeforeValidator(parse_duration)]


class GitSource(BaseModel):
    """A git repository cloned into the working directory (``ref``: a branch,
    tag or commit; unset: the repository's default branch)."""

    model_config = ConfigDict(extra="forbid")
    git: str = Field(min_length=1, max_length=4096)
    ref: str | None = Field(default=None, min_length=1, max_length=256)

    @field_validator("ref")
    @classmethod
    def _plain_ref(cls, ref: str | None) -> str | None:
        # Passed to git as an argument: never an option.
        if ref is not None and (ref.startswith("-") or any(c in ref for c in "\0\n ")):
            raise ValueError(f"{ref!r} is not a branch, tag or commit name")
        return ref

    @field_validator("git")
    @classmethod
    def _plain_url(cls, url: str) -> str:
        if url.startswith("-") or "\0" in url or "\n" in url:
            raise ValueError(f"{url!r} is not a repository URL")
        return url


class DirSource(BaseModel):
    """A directory on the host, copied into the working directory."""

    model_config = ConfigDict(extra="forbid")
    dir: str = Field(min_length=1, max_length=4096)

    @field_validator("dir")
    @classmethod
    def _absolute(cls, path: str) -> str:
        if not path.startswith("/") or "\0" in path:
            raise ValueError(f"{path!r} is not an absolute host path")
        return path


class WorkspaceSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    source: GitSource | DirSource | None = None
    setup: list[Annotated[str, Field(min_length=1, max_length=MAX_STEP_CHARS)]] = Field(
        default_factory=list, max_length=MAX_SETUP_STEPS
    )


class Lifecycle(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    #: ``thread``: one sandbox per thread id, resumed run after run;
    #: ``none``: a fresh sandbox every run (from the setup snapshot when there is one).
    reuse: Literal["thread", "none"] = "thread"
    #: ``after-setup``: snapshot once setup finishes (where the provider can
    #: snapshot; skipped silently where it cannot); ``none``: never.
    snapshot: Literal["after-setup", "none"] = "after-setup"
    #: Keep the sandbox warm this long idle between runs, then suspend it
    #: (where the provider can; else it is reaped). Unset: no limit.
    keep_alive: Duration | None = None
    #: The run's end (``complete``) destroys the sandbox; false keeps it for the next run.
    destroy_on_complete: bool = False
    #: A snapshot older than this is stale: it is not restored, setup runs again.
    snapshot_max_age: Duration | None = None
    #: The sandbox ends this long after it was made, whatever its use, in
    #: every program that finds it (reaped with ``max_lifetime_exceeded``). Unset: never.
    max_lifetime: Duration | None = None


class Definition(BaseModel):
    """A named recipe for a sandbox: provider, workspace, lifecycle, tenant."""

    model_config = ConfigDict(extra="forbid")
    id: str
    provider: ProviderConfig = Field(
        default_factory=lambda: parse_provider_config({"type": "local"})
    )
    workspace: WorkspaceSpec = Field(default_factory=WorkspaceSpec)
    lifecycle: Lifecycle = Field(default_factory=Lifecycle)
    tenant: str | None = Field(default=None, max_length=256)

    @field_validator("id")
    @classmethod
    def _id(cls, value: str) -> str:
        if not DEFINITION_ID.fullmatch(value):
            raise ValueError(
                f"{value!r} is not a definition id (letters, digits, '.', '_', '-'; at most 63)"
            )
        return value

    @classmethod
    def parse(cls, data: Mapping[str, Any], *, definition_id: str | None = None) -> Definition:
        """Validate ``data``; a bad field is an ``InvalidArgument`` naming it."""
        if not isinstance(data, Mapping):
            raise InvalidArgument(f"a definition is a mapping, not {type(data).__name__}")
        raw = dict(data)
        if definition_id is not None:
            if raw.get("id", definition_id) != definition_id:
                raise InvalidArgument(
                    f"definition id {raw['id']!r} differs from its name {definition_id!r}"
                )
            raw["id"] = definition_id
        if isinstance(raw.get("provider"), str):
            raw["provider"] = {"type": raw["provider"]}
        try:
            return cls.model_validate(raw)
        except ValidationError as exc:
            name = raw.get("id", definition_id)
            raise InvalidArgument(f"definition {name!r}: {_fields(exc)}") from None

    def spec(self) -> SandboxSpec:
        """The sandbox settings this definition makes sandboxes with."""
        return SandboxSpec(provider=self.provider)

    def workspace_hash(self) -> str:
        """What makes two environments the same: the source, the setup steps,
        and the provider's settings (its image or root file system among them)."""
        return _digest({
            "source": self.workspace.source.model_dump() if self.workspace.source else None,
            "setup": self.workspace.setup,
            "provider": self.provider.model_dump(mode="json"),
        })

    def instance_key(self, thread_id: str, tenant: str | None = None) -> str:
        """The key of the sandbox one thread of this definition runs in: change
        the thread, the definition, the provider, the workspace or the tenant
        and it changes, so a stale environment is never resumed for another."""
        return _digest({
            "thread": thread_id,
            "definition": self.id,
            "provider": self.provider.type,
            "workspace": self.workspace_hash(),
            "tenant": tenant if tenant is not None else self.tenant,
        })[:32]


def _digest(value: object) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()


def _fields(exc: ValidationError) -> str:
    return "; ".join(
        f"{'.'.join(str(p) for p in e['loc']) or 'value'}: {e['msg']}" for e in exc.errors()
    )


def load_definitions(path: str | os.PathLike[str] | None = None) -> dict[str, Definition]:
    """The definitions of a ``hutch.toml`` (``path``, else ``./hutch.toml``)."""
    return definitions_from_config(load_config_data(path))


def definitions_from_config(data: Mapping[str, Any]) -> dict[str, Definition]:
    """The ``[definitions.NAME]`` tables of a parsed ``hutch.toml``."""
    tables = data.get("definitions") or {}
    if not isinstance(tables, Mapping):
        raise InvalidArgument("[definitions] must be a table of [definitions.NAME] tables")
    return {name: Definition.parse(table, definition_id=name) for name, table in tables.items()}
