"""E2B's errors (the SDK's exceptions, envd's Connect codes) as hutch's typed ones."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

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

from ..._errors import (
    HutchError,
    InvalidArgument,
    ProviderError,
    SandboxFileExists,
    SandboxFileNotFound,
    SandboxPermissionDenied,
    SandboxUnavailable,
)

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
    except ConnectError as exc:
        raise BY_CODE.get(exc.code.value, ProviderError)(f"{what}: {exc.message}") from None
    except SandboxNotFoundException as exc:
        raise SandboxUnavailable(f"{what}: E2B has no such sandbox ({exc})") from None
    except NotFoundException as exc:
        raise SandboxFileNotFound(f"{what}: {exc}") from None
    except (SandboxNotRunningException, SandboxUnreachableException) as exc:
        raise SandboxUnavailable(f"{what}: {exc}") from None
    except InvalidArgumentException as exc:
        raise InvalidArgument(f"{what}: {exc}") from None
    except NotEnoughSpaceException as exc:
        raise ProviderError(f"{what}: E2B's sandbox is out of space ({exc})") from None
    except AuthenticationException as exc:
        raise ProviderError(f"{what}: E2B refused the API key ({exc})") from None
    except SandboxException as exc:
        raise ProviderError(f"{what}: {exc}") from None
