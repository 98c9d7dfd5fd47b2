"""The in-process ref server, found through a registry.

An owner's first ref starts serving its sandbox to other processes (see
:mod:`hutch.server.owner`). The sandbox knows that server only as a
:class:`RefServer`, and finds how to start one through :func:`ref_serving`:
the HTTP layer registers itself when it is imported, and is imported by
name here only when a first ref is handed out, so the core never imports
the server (and a program that hands out no ref never loads it).
"""

from __future__ import annotations

import asyncio
import importlib
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from .._errors import HutchError

if TYPE_CHECKING:
    from ..store import RefRow

#: The sandbox a server serves (``hutch.Sandbox``; a parameter, so that the
#: core's seams need not import the sandbox class).
SandboxT = TypeVar("SandboxT")
SandboxT_co = TypeVar("SandboxT_co", covariant=True)

#: The module that registers the ref serving when it is imported.
DEFAULT_SERVING = "hutch.server.owner"


class RefServer(Protocol[SandboxT_co]):
    """One in-process sandbox served to the holders of its refs."""

    @property
    def sandbox(self) -> SandboxT_co:
        """The owner's sandbox it serves."""

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The loop it serves on: the owner's, where its sandbox's operations run."""

    async def hand_out(self, expires_in: float | None) -> str:
        """A new ref: a credential for this sandbox, carrying this server's address."""

    async def revoke(self, ref: str) -> None:
        """End a ref (the ref itself, or its id)."""

    async def check(self, ref: str) -> RefRow:
        """The ref's row if it is one of this sandbox's, unrevoked and unexpired."""

    def open_refs(self) -> list[RefRow]:
        """The sandbox's refs that still work."""

    def refs_json(self) -> list[dict[str, Any]]:
        """The sandbox's refs as SandboxInfo lists them."""

    def attachments(self) -> list[dict[str, Any]]:
        """The sessions of other processes attached through this server."""

    async def close(self) -> None:
        """Stop answering and remove what it made."""


class RefServing(Protocol[SandboxT]):
    """How this process serves its sandboxes to their refs' holders."""

    async def start(self, sandbox: SandboxT) -> RefServer[SandboxT]:
        """Start serving ``sandbox``."""

    def served_here(self, ref: str) -> RefServer[SandboxT] | None:
        """The server in this process that handed ``ref`` out, if any."""


_serving: RefServing[Any] | None = None


def register_ref_serving(serving: RefServing[Any]) -> None:
    """Make ``serving`` the one that serves this process's refs (the HTTP
    layer calls it when imported)."""
    global _serving
    _serving = serving


def ref_serving() -> RefServing[Any]:
    """The registered serving, its module imported on first use."""
    if _serving is None:
        importlib.import_module(DEFAULT_SERVING)
    if _serving is None:
        raise HutchError(f"{DEFAULT_SERVING} registered no ref serving")
    return _serving


def served_here(ref: str) -> RefServer[Any] | None:
    """The server in this process that handed ``ref`` out, if any. Nothing
    registered: no ref was handed out here, and nothing is loaded to say so."""
    return None if _serving is None else _serving.served_here(ref)
