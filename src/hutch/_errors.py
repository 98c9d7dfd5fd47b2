"""Every error hutch raises, with a stable machine-readable ``code``.

The tree::

    HutchError                         code            HTTP
    ├── NotFound (LookupError)          not_found         404
    ├── SandboxFileNotFound (FileNotFoundError)
    │                                   file_not_found    404
    ├── SandboxIsADirectory (IsADirectoryError)
    │                                   is_a_directory    400
    ├── SandboxPermissionDenied (PermissionError)
    │                                   permission_denied 403
    ├── SandboxFileExists (FileExistsError)
    │                                   file_exists       409
    ├── SandboxNotADirectory (NotADirectoryError)
    │                                   not_a_directory   400
    ├── ExecTimeout (TimeoutError)      exec_timeout      408
    ├── OutputLimitExceeded             output_limit_exceeded 413
    ├── SandboxUnavailable              sandbox_unavailable   409
    ├── ReadBeforeWrite                 read_before_write     409
    ├── StdinClosed                     stdin_closed          409
    ├── InvalidState                    invalid_state         409
    ├── TimeoutTooLarge                 timeout_too_large     400
    ├── InvalidArgument (ValueError)    invalid_argument      400
    ├── SandboxExpired                  (abstract: 410)
    │   ├── IdleTimeoutExpired          idle_timeout          410
    │   ├── MaxLifetimeExceeded         max_lifetime_exceeded 410
    │   └── TimeoutExpired              timeout_expired       410
    ├── Unauthorized                    unauthorized          401
    ├── CapabilityUnsupported (NotImplementedError)
    │                                   capability_unsupported 501
    ├── SetupFailed                     setup_failed          422
    ├── ResourceExhausted               resource_exhausted    429
    ├── ProviderError                   provider_error        502
    ├── StoreUnavailable                store_unavailable     503
    └── DaemonBusy                      daemon_busy           503

Subclasses that match a built-in also derive from it, so ``except
FileNotFoundError`` works on a sandbox file exactly as on a host file. The
same table drives the HTTP server (code -> status) and the client (code ->
class), so the wire and the library cannot drift apart.

On the wire an error is :meth:`HutchError.wire`: ``{"code", "message"}``
and the fields of its :meth:`~HutchError.details` (``SetupFailed``: ``step``,
``exit_code``, ``output_tail``); :func:`error_from_wire` rebuilds the typed
error, details and all.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar


class HutchError(Exception):
    """Root of every hutch error. ``code`` is stable and travels on the wire."""

    code: ClassVar[str] = "hutch_error"
    http_status: ClassVar[int] = 500

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message

    def details(self) -> dict[str, Any]:
        """What this error carries beyond its message (JSON values), by name."""
        return {}

    @classmethod
    def from_details(cls, message: str, details: Mapping[str, Any]) -> HutchError:
        """The error again from its message and :meth:`details`."""
        return cls(message)

    def wire(self) -> dict[str, Any]:
        """The error as the daemon sends it (inside ``{"error": ...}``)."""
        return {**self.details(), "code": self.code, "message": self.message}

    def __reduce__(self) -> tuple[Any, tuple[type[HutchError], str, dict[str, Any]]]:
        # OSError subclasses pickle their args in odd ways; keep the message
        # and the details.
        return (_rebuild, (type(self), self.message, self.details()))


def _rebuild(cls: type[HutchError], message: str, details: Mapping[str, Any]) -> HutchError:
    return cls.from_details(message, details)


class NotFound(HutchError, LookupError):
    code = "not_found"
    http_status = 404


class SandboxFileNotFound(HutchError, FileNotFoundError):
    code = "file_not_found"
    http_status = 404


class SandboxIsADirectory(HutchError, IsADirectoryError):
    code = "is_a_directory"
    http_status = 400


class SandboxPermissionDenied(HutchError, PermissionError):
    code = "permission_denied"
    http_status = 403


class SandboxFileExists(HutchError, FileExistsError):
    """A mkdir or a rename found something already where it would put its own."""

    code = "file_exists"
    http_status = 409


class SandboxNotADirectory(HutchError, NotADirectoryError):
    """A path goes through (or must be) a directory, and a file is there."""

    code = "not_a_directory"
    http_status = 400


class ExecTimeout(HutchError, TimeoutError):
    code = "exec_timeout"
    http_status = 408


class OutputLimitExceeded(HutchError):
    code = "output_limit_exceeded"
    http_status = 413


class SandboxUnavailable(HutchError):
    code = "sandbox_unavailable"
    http_status = 409


class ReadBeforeWrite(HutchError):
    code = "read_before_write"
    http_status = 409


class StdinClosed(HutchError):
    """A write to (or close of) a background command's stdin that cannot be
    done: the command was started without its stdin kept open, its stdin
    was closed, or it has ended."""

    code = "stdin_closed"
    http_status = 409


class InvalidState(HutchError):
    """An illegal lifecycle transition (pause a suspended sandbox, ...)."""

    code = "invalid_state"
    http_status = 409


class TimeoutTooLarge(HutchError):
    code = "timeout_too_large"
    http_status = 400


class InvalidArgument(HutchError, ValueError):
    code = "invalid_argument"
    http_status = 400


class NoSuchUser(InvalidArgument):
    """A command asked to run as a user the sandbox does not have. Never seen
    by callers of exec: as on every other execution API, such a command is
    one that failed to start (exit 126, the reason on stderr); elsewhere (a
    PTY) it is the ``invalid_argument`` it derives from."""


class SandboxExpired(HutchError):
    """A sandbox terminated because it crossed a time bound."""

    code = "sandbox_expired"
    http_status = 410


class IdleTimeoutExpired(SandboxExpired):
    code = "idle_timeout"


class MaxLifetimeExceeded(SandboxExpired):
    code = "max_lifetime_exceeded"


class TimeoutExpired(SandboxExpired):
    code = "timeout_expired"


class Unauthorized(HutchError):
    code = "unauthorized"
    http_status = 401


class CapabilityUnsupported(HutchError, NotImplementedError):
    code = "capability_unsupported"
    http_status = 501

    @classmethod
    def for_provider(cls, provider: str, capability: str) -> CapabilityUnsupported:
        return cls(f"provider {provider!r} does not support {capability!r}")


class ProviderError(HutchError):
    code = "provider_error"
    http_status = 502


class KillIncomplete(ProviderError):
    """Processes of a command outlived the kill of its whole tree (held in
    the kernel past the bound a kill waits): said, never waited for forever.
    Travels as ``provider_error``."""


class ResourceExhausted(HutchError):
    """The sandbox is sound but full: a command could not start because its
    pids limit is reached (the kernel said EAGAIN to the fork). It starts
    once something in the sandbox ends. Or the daemon is: it serves as many
    sandboxes as its operator allows (``max_sandboxes``); a create succeeds
    once one ends.

    429, as gRPC's RESOURCE_EXHAUSTED maps to HTTP: the caller has used up
    its own quota and may retry once it frees some. Not 502 (the provider
    did not fail) nor 503 (hutch is not unavailable: everything else in the
    sandbox, files included, still answers)."""

    code = "resource_exhausted"
    http_status = 429


class StoreUnavailable(HutchError):
    """The daemon's state store cannot record a change (its disk is full, its
    file is unwritable): the change was not made, or was put back."""

    code = "store_unavailable"
    http_status = 503


class DaemonBusy(HutchError):
    """The daemon holds as much of callers' bytes in memory as its budget
    allows (see hutch._membudget): this call's were refused, nothing was
    done, and it may be tried again once others end. 503, as a server too
    busy for a request says: no fault of the caller's nor of the sandbox's."""

    code = "daemon_busy"
    http_status = 503


class SetupFailed(HutchError):
    """A setup step exited non-zero: its exit code and the tail of its output.
    Nothing of that run is recorded as a good snapshot."""

    code = "setup_failed"
    http_status = 422

    def __init__(
        self,
        message: str,
        *,
        step: str | None = None,
        exit_code: int | None = None,
        output_tail: str = "",
    ) -> None:
        super().__init__(message)
        self.step = step
        self.exit_code = exit_code
        self.output_tail = output_tail

    def details(self) -> dict[str, Any]:
        return {"step": self.step, "exit_code": self.exit_code, "output_tail": self.output_tail}

    @classmethod
    def from_details(cls, message: str, details: Mapping[str, Any]) -> SetupFailed:
        step, exit_code, tail = (details.get(k) for k in ("step", "exit_code", "output_tail"))
        return cls(
            message,
            step=step if isinstance(step, str) else None,
            exit_code=exit_code if isinstance(exit_code, int) else None,
            output_tail=tail if isinstance(tail, str) else "",
        )


def _all_subclasses(root: type[HutchError]) -> list[type[HutchError]]:
    out: list[type[HutchError]] = []
    subclasses: list[type[HutchError]] = root.__subclasses__()
    for sub in subclasses:
        out.append(sub)
        out.extend(_all_subclasses(sub))
    return out


_ALL_ERRORS: list[type[HutchError]] = [HutchError, *_all_subclasses(HutchError)]
#: Only a class that declares its own code stands for it on the wire (a
#: refinement such as NoSuchUser travels as its parent's code).
ERRORS_BY_CODE: dict[str, type[HutchError]] = {
    cls.code: cls for cls in _ALL_ERRORS if "code" in cls.__dict__
}


def error_from_code(code: str, message: str) -> HutchError:
    """Rebuild the typed error of ``code`` (unknown codes become the root)."""
    return error_from_wire({"code": code, "message": message})


def error_from_wire(error: Mapping[str, Any]) -> HutchError:
    """Rebuild the typed error a server sent as :meth:`HutchError.wire`,
    with its details (unknown codes become the root)."""
    cls = ERRORS_BY_CODE.get(str(error.get("code")), HutchError)
    return cls.from_details(str(error.get("message")), error)
