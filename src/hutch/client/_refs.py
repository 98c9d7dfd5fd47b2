"""What the client's operations hand back for their faces to wrap (a
``*Ref`` becomes the face's own object: a sandbox, a fork, a process, a
watcher), and the marks that tell ``scripts/gen_sync.py`` what kind of
method each operation of :mod:`._core` makes on the faces."""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

from ._http import Call

if TYPE_CHECKING:
    from .._types import Snapshot

# -- references the drivers turn into facade objects ------------------------------------
# Named tuples, not data classes: read once by the driver that wraps them, and
# a third of the cost to make at import (every command of the CLI imports them).


class SandboxRef(NamedTuple):
    info: dict[str, Any]


class BranchRef(NamedTuple):
    """A sandbox a fork's ``attach`` started: it joins that fork's ``branches``."""

    fork: Any
    info: dict[str, Any]


class ForkRef(NamedTuple):
    snapshot: Snapshot
    sandboxes: list[dict[str, Any]]


@dataclass
class RemoteEnsured:
    """What a client's ``ensure`` gives: the sandbox (a client sandbox), the
    path taken (``resumed``, ``restored`` or ``created``) and each step's seconds."""

    sandbox: Any
    path: str
    steps: list[dict[str, Any]]


class ProcessRef(NamedTuple):
    sandbox_id: str
    info: dict[str, Any]


class WatcherRef(NamedTuple):
    sandbox_id: str
    info: dict[str, Any]


# -- the marks ---------------------------------------------------------------------------


OpFunction = TypeVar("OpFunction", bound=Callable[..., Generator[Call, Any, Any]])


def op(fn: OpFunction) -> OpFunction:
    """An operation: its faces' methods return what it returns
    (``scripts/gen_sync.py`` writes them from these marks)."""
    return fn


def stream_op(fn: OpFunction) -> OpFunction:
    """A streamed operation: its faces' methods iterate its events."""
    return fn


Function = TypeVar("Function", bound=Callable[..., Any])


def terminal_op(fn: Function) -> Function:
    """A terminal's first message: its faces' methods open the terminal with
    it (a context manager; ``async with`` on the async face)."""
    return fn
