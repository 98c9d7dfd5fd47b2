"""What a provider's settings mean for the host, declared where they are defined.

A provider's config model marks its settings with these, in ``Annotated``
metadata; the daemon reads the marks and never a provider's field names:

- :class:`ReachesHost`: the setting reaches the host (binds host paths,
  shares the host's network, restores capabilities). Through the daemon only
  the operator may set it to a value that does; in-process use, where the
  caller is the operator, keeps it.
- :class:`HostPath`: the setting names a path on the host; through the
  daemon it must be absolute (the daemon's working directory is no caller's).
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
import posixpath
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, StrictInt, StrictStr

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
    #: Instead of ``is_safe``, where it depends on other settings too: whether
    #: the whole config leaves the host alone as far as this setting goes.
    safe_in: Callable[[Any], bool] | None = None

    def reaches(self, config: BaseModel, value: Any) -> bool:
        if self.safe_in is not None:
            return not self.safe_in(config)
        return not self.is_safe(value)


@dataclass(frozen=True)
class OperatorsChoice(ReachesHost):
    """A setting that spends what the operator holds rather than the host
    (a cluster's namespaces, nodes, storage classes and registry secrets,
    reached with the operator's credentials): refused through the daemon as
    a host-reaching setting is, allowed by name alike."""


@dataclass(frozen=True)
class HostPath:
    """A setting that names a path on the host. In process a relative one
    is the caller's (its working directory); through the daemon it would be
    the daemon's, which no client knows, so there it must be absolute."""


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
        if mark.reaches(config, getattr(config, name))
    }


def relative_host_paths(config: BaseModel) -> list[str]:
    """The settings of ``config`` naming a host path that is not absolute
    (``~`` included: it is the daemon user's home there)."""
    return [
        name for name, _mark in _marked(config, HostPath)
        if isinstance(value := getattr(config, name), str) and not value.startswith("/")
    ]


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


#: The most a size setting may say: 1 PiB.
MAX_SIZE = 1 << 50
#: The longest a size setting may be written (``1.5GiB``, with room to spare).
_MAX_SIZE_TEXT = 32


def _size_setting(least: int, what: str) -> Callable[[str | int], str | int]:
    """A check of a size setting (``512m``, ``2g`` or bytes): a ValueError,
    which the config model reports under the field's name, unless it is a
    size from ``least`` (``what`` says why) to :data:`MAX_SIZE`."""

    def check(value: str | int) -> str | int:
        if isinstance(value, str) and len(value) > _MAX_SIZE_TEXT:
            raise ValueError(f"not a size: {value[:_MAX_SIZE_TEXT]!r}... (use 512m, 2g, ...)")
        number = parse_bytes(value)
        if number < least:
            raise ValueError(f"{value!r} is below {format_bytes(least)}, {what}")
        if number > MAX_SIZE:
            raise ValueError(f"{value!r} is over {format_bytes(MAX_SIZE)}")
        return value

    return check


#: A memory limit: ``512m``, ``2g`` or bytes, at least 6 MiB (the least
#: Docker takes; a sandbox with less cannot start its shell).
MemorySize = Annotated[
    StrictStr | StrictInt, AfterValidator(_size_setting(6 << 20, "the least a sandbox runs in"))
]
#: A disk cap: ``10g`` or bytes, at least 1 MiB (the least a file system
#: of its own is made in).
DiskSize = Annotated[
    StrictStr | StrictInt, AfterValidator(_size_setting(1 << 20, "the least a disk cap holds"))
]


def _no_bool(value: Any) -> Any:
    if isinstance(value, bool):
        raise ValueError("a number, not true or false")
    return value


#: A count or amount (CPUs, processes) that a JSON ``true`` must not pass for.
NotBool = BeforeValidator(_no_bool)

#: Where a sandbox's working directory may not be: the kernel's own file
#: systems and hutch's (at or below these), ...
_RESERVED_TREES = ("/proc", "/sys", "/dev", "/.hutch")
#: ... and the directories a system runs from (these exactly: their
#: subdirectories are free), which a working directory would hide.
_SYSTEM_DIRECTORIES = frozenset({
    "/", "/bin", "/boot", "/etc", "/lib", "/lib32", "/lib64", "/libx32", "/run", "/sbin",
    "/usr", "/var",
})


def sandbox_directory(value: str) -> str:
    """A working directory inside a sandbox, checked (ValueError otherwise)
    and normalized: absolute, not over a file system of the kernel's
    (``/proc``, ``/sys``, ``/dev``) or hutch's own, not one the system runs from."""
    if not value.startswith("/"):
        raise ValueError(f"{value!r} is not an absolute path")
    if "\0" in value or len(value) > 4096:
        raise ValueError(f"{value[:64]!r} is not a directory path")
    normal = "/" + posixpath.normpath(value).lstrip("/")
    for tree in _RESERVED_TREES:
        if normal == tree or normal.startswith(tree + "/"):
            raise ValueError(f"{value!r} is in {tree}, the kernel's or hutch's own; "
                             "choose a directory of the sandbox's own (/workspace)")
    if normal in _SYSTEM_DIRECTORIES:
        raise ValueError(f"{value!r} would hide a directory the system runs from; "
                         "choose one of the sandbox's own (/workspace)")
    return normal


#: A working directory inside a sandbox (see :func:`sandbox_directory`).
SandboxDirectory = Annotated[str, AfterValidator(sandbox_directory)]


_IMAGE_REFERENCE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/:@+-]{0,511}")


def image_reference(value: str) -> str:
    """An image's name (a hutch image, or a Docker reference such as
    ``registry:5000/team/app:1.2@sha256:...``), checked: ValueError for what
    no image is called (white space, a leading dash or dot, a ``..`` or
    empty path segment), which would otherwise be sent on to the Engine
    inside a URL."""
    segments = value.split("/")
    if (not _IMAGE_REFERENCE.fullmatch(value)
            or any(segment in ("", ".", "..") for segment in segments)):
        raise ValueError(f"{value[:64]!r} is not an image name (as registry/name:tag)")
    return value


#: An image's name (see :func:`image_reference`).
ImageName = Annotated[str, AfterValidator(image_reference)]


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
