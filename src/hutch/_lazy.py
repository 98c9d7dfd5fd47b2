"""A library imported at its first use, not at its importer's.

Every daemon loads every provider at its start (its operator policy reads
their settings; its reconcile asks each what it holds), and most never talk
to an SSH host, a Kubernetes cluster or E2B: asyncssh, lightkube, httpx2 and
E2B's SDK cost about half a second of each start between them. A daemon forwards
to another over HTTP only in a fleet (httpx, which brings its own command
line's rich and pygments). Whether the library is installed is still known
at the importer's import (``find_spec``), so a missing one names what to
install, as before.

Use, with the real module for the type checker::

    if TYPE_CHECKING:
        import asyncssh
    else:
        asyncssh = lazy_module("asyncssh")
"""

from __future__ import annotations

import importlib
import importlib.util
import types
from typing import Any


class _LazyModule(types.ModuleType):
    """Stands for a module until an attribute is read from it: then imports
    it (the import system's lock makes that once, whatever the threads) and
    takes its namespace, so later reads are plain lookups."""

    def __getattr__(self, attr: str) -> Any:
        module = importlib.import_module(self.__name__)
        self.__dict__.update(module.__dict__)
        return getattr(module, attr)


def lazy_module(name: str) -> types.ModuleType:
    """``name``, imported when first used; ``ModuleNotFoundError`` now if its
    distribution is not installed (the top-level name is looked up, which
    imports nothing: looking up a submodule would import its parents)."""
    top = name.partition(".")[0]
    if importlib.util.find_spec(top) is None:
        raise ModuleNotFoundError(f"No module named {top!r}", name=top)
    return _LazyModule(name)
