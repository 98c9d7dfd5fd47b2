"""E2B's errors (the SDK's exceptions, envd's Connect codes) as hutch's typed ones."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from ..._errors import (
    HutchError,
    InvalidArgument,
    ProviderError,
    SandboxFileExists,
    SandboxFileNotFound,
    SandboxPermissionDenied,
    SandboxUnavailable,
)


class E2BSandboxGone(SandboxUnavailable):
    """E2B says it has no such sandbox: gone, where a service that does not
    answer (a plain :class:`SandboxUnavailable`) cannot tell. Its wire code
    stays ``sandbox_unavailable``."""


#: envd's Connect codes and the hutch error of each (a file operation's).
BY_CODE: dict[str, type[HutchError]] = {
    "not_found": SandboxFileNotFound,
    "permission_denied": SandboxPermissionDenied,
    "invalid_argument": InvalidArgument,
    "already_exists": SandboxFileExists,
    "unavailable": SandboxUnavailable,
}


@contextmanager
def mapped(what: str) -> Iterator[None]:
    """Raise what E2B raised inside as hutch's typed error, saying ``what`` failed."""
    try:
        yield
    except HutchError:
        raise
    except Exception as exc:
        translated = _translated(what, exc)
        if translated is None:
            raise
        raise translated from None


def _translated(what: str, exc: Exception) -> HutchError | None:
    """hutch's error for one of the SDK's, else None. The SDK is imported
    here, not at the module's import (see sandbox.py): an error of its was
    raised by it, so it is loaded already."""
    import httpx
    from connectrpc.errors import ConnectError
    from e2b.exceptions import (
        AuthenticationException,
        InvalidArgumentException,
        NotEnoughSpaceException,
        NotFoundException,
        SandboxException,
        SandboxNotFoundException,
        SandboxNotRunningException,
        SandboxUnreachableException,
    )

    if isinstance(exc, ConnectError):
        return BY_CODE.get(exc.code.value, ProviderError)(f"{what}: {exc.message}")
    if isinstance(exc, SandboxNotFoundException):
        return E2BSandboxGone(f"{what}: E2B has no such sandbox ({exc})")
    if isinstance(exc, httpx.TransportError):
        return SandboxUnavailable(f"{what}: E2B cannot be reached ({exc})")
    if isinstance(exc, NotFoundException):
        return SandboxFileNotFound(f"{what}: {exc}")
    if isinstance(exc, (SandboxNotRunningException, SandboxUnreachableException)):
        return SandboxUnavailable(f"{what}: {exc}")
    if isinstance(exc, InvalidArgumentException):
        return InvalidArgument(f"{what}: {exc}")
    if isinstance(exc, NotEnoughSpaceException):
        return ProviderError(f"{what}: E2B's sandbox is out of space ({exc})")
    if isinstance(exc, AuthenticationException):
        return ProviderError(f"{what}: E2B refused the API key ({exc})")
    if isinstance(exc, SandboxException):
        return ProviderError(f"{what}: {exc}")
    return None
