"""Paths inside a sandbox, as callers give them: one rule for the in-process
sandbox and the client that checks before it sends (a module of its own, so
that the client does not import the providers to use it)."""

from __future__ import annotations

import posixpath

from ._errors import InvalidArgument
from ._values import text_problem


def join_path(workdir: str, path: str) -> str:
    """Resolve ``path`` against ``workdir`` inside the sandbox (POSIX rules)."""
    if not path:
        path = "."
    return posixpath.normpath(posixpath.join(workdir, path))


def within(path: str, directory: str) -> bool:
    """Whether the absolute ``path`` is ``directory`` or lies below it, by
    name (``/a//b/.`` is ``/a/b``; POSIX's leading ``//`` is ``/``)."""
    def plain(p: str) -> str:
        return "/" + posixpath.normpath(p).lstrip("/")

    path, directory = plain(path), plain(directory)
    return path == directory or path.startswith(directory.rstrip("/") + "/")


def sandbox_path(workdir: str, path: object) -> str:
    """A caller's ``path`` checked (a string, no NUL byte: InvalidArgument
    otherwise) and resolved against ``workdir``."""
    if not isinstance(path, str):
        raise InvalidArgument(f"path must be a string, not {type(path).__name__}")
    problem = text_problem(path)
    if problem is not None:
        raise InvalidArgument(f"path {path!r} {problem}")
    return join_path(workdir, path)
