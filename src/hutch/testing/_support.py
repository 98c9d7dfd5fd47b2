"""What the cases share: refusal checks and an expected-error context manager
(the suite runs under any test runner, so it does not lean on pytest's)."""

from __future__ import annotations

import inspect
import re
from collections.abc import Awaitable, Callable
from types import TracebackType
from typing import Any

import hutch

Case = Callable[[Any], Awaitable[None]]


async def refused(call: Awaitable[Any]) -> None:
    """``call`` must fail with capability_unsupported."""
    try:
        await call
    except hutch.CapabilityUnsupported:
        return
    raise AssertionError("an operation the provider does not declare did not refuse")


async def runs_processes(sandbox: Any) -> bool:
    """Whether ``sandbox`` declares processes; if not, its exec must refuse."""
    if sandbox.capabilities.processes:
        return True
    await refused(sandbox.exec(["true"]))
    return False


async def settle(value: Any) -> Any:
    """In-process status() and processes() are plain calls; remote ones are awaited."""
    return await value if inspect.isawaitable(value) else value


class raises:
    """The block must raise one of ``types``; with ``match`` its message must
    match that regex, with ``code`` its hutch code must be that. The error is
    kept as ``.value``."""

    def __init__(
        self, *types: type[BaseException], match: str | None = None, code: str | None = None
    ) -> None:
        self.types = types
        self.match = match
        self.code = code
        self.value: BaseException | None = None

    def __enter__(self) -> raises:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        names = " or ".join(t.__name__ for t in self.types)
        if error is None:
            raise AssertionError(f"expected {names}, nothing was raised")
        if not isinstance(error, self.types):
            return False
        if self.match is not None and not re.search(self.match, str(error)):
            raise AssertionError(f"{names} said {str(error)!r}, not {self.match!r}") from error
        if self.code is not None and getattr(error, "code", None) != self.code:
            raise AssertionError(
                f"{names} had code {getattr(error, 'code', None)!r}, not {self.code!r}"
            ) from error
        self.value = error
        return True
