"""What a provider's settings mean for the host, declared where they are defined.

A provider's config model marks its settings with these, in ``Annotated``
metadata; the daemon reads the marks and never a provider's field names:

- :class:`ReachesHost`: the setting reaches the host (binds host paths,
  shares the host's network, restores capabilities). Through the daemon only
  the operator may set it to a value that does; in-process use, where the
  caller is the operator, keeps it.
- :class:`Limit`: the setting is a resource limit of one kind (memory, CPUs,
  pids, disk); the daemon fills it with its default when a request leaves it
  unset and refuses a value over its ceiling.

For example::

    class MyConfig(BaseModel):
        mounts: Annotated[list[str], ReachesHost("binds host paths into the sandbox")] = []
        memory: Annotated[str | None, Limit("memory", parse_bytes, format_bytes)] = None
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel

LimitKind = Literal["memory", "cpus", "pids", "disk"]
LIMIT_KINDS: tuple[LimitKind, ...] = ("memory", "cpus", "pids", "disk")


def _unset(value: Any) -> bool:
    return value is None or value == [] or value == {} or value == ""


@dataclass(frozen=True)
class ReachesHost:
    """A setting that reaches the host, unless its value is one of the safe ones."""

    #: What the setting does to the host, for the refusal's message.
    why: str
    #: Whether a value leaves the host alone (by default: unset or empty).
    is_safe: Callable[[Any], bool] = _unset


@dataclass(frozen=True)
class Limit:
    """A resource limit: ``measure`` turns the setting's value into the kind's
    unit (bytes, CPUs, processes), ``express`` turns such a number back."""

    kind: LimitKind
    measure: Callable[[Any], float] = float
    express: Callable[[float], Any] = float


def _marked(config: BaseModel, mark: type[Any]) -> Iterator[tuple[str, Any]]:
    for name, field in type(config).model_fields.items():
        for meta in field.metadata:
            if isinstance(meta, mark):
                yield name, meta


def host_reaching(config: BaseModel) -> dict[str, str]:
    """The settings of ``config`` whose values reach the host: name -> why."""
    return {
        name: mark.why for name, mark in _marked(config, ReachesHost)
        if not mark.is_safe(getattr(config, name))
    }


def limits(config: BaseModel) -> dict[LimitKind, tuple[str, Limit]]:
    """The resource limits ``config`` declares: kind -> (setting name, mark)."""
    return {mark.kind: (name, mark) for name, mark in _marked(config, Limit)}


_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([bkmgt]?)(?:i?b)?\s*$", re.IGNORECASE)


def parse_bytes(value: Any) -> float:
    """``512m``, ``2g``, ``1.5GiB`` or a number of bytes, as bytes."""
    if isinstance(value, bool):
        raise ValueError(f"not a size: {value!r}")
    if isinstance(value, int | float):
        number = float(value)
    else:
        match = _SIZE.match(str(value))
        if match is None:
            raise ValueError(f"not a size: {value!r} (use 512m, 2g, ...)")
        number = float(match.group(1)) * _UNITS[match.group(2).lower()]
    if not 0 < number < math.inf:
        raise ValueError(f"not a size: {value!r}")
    return number


def format_bytes(number: float) -> str:
    """Bytes as Docker takes and people read them: ``2g``, ``512m``, ``1000b``."""
    whole = int(number)
    for suffix in ("t", "g", "m", "k"):
        if whole % _UNITS[suffix] == 0:
            return f"{whole // _UNITS[suffix]}{suffix}"
    return f"{whole}b"


def keeps_dropped(required: list[str]) -> Callable[[Any], bool]:
    """For a capability drop list: safe while it still drops all of ``required``."""
    wanted = {c.upper().removeprefix("CAP_") for c in required}

    def safe(value: Any) -> bool:
        dropped = {str(c).upper().removeprefix("CAP_") for c in value or []}
        return "ALL" in dropped or wanted <= dropped

    return safe


def one_of(*safe_values: Any) -> Callable[[Any], bool]:
    return lambda value: value in safe_values


def no_key_prefix(prefix: str) -> Callable[[Any], bool]:
    """For a mapping (labels): safe while no key starts with ``prefix`` (any case)."""
    wanted = prefix.lower()
    return lambda value: not any(str(key).lower().startswith(wanted) for key in value or {})
