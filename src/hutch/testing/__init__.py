"""The conformance suite every provider runs, each case gated by the
capabilities the provider declares.

A provider (a third party's too) runs them on sandboxes it makes::

    from hutch.testing import CASES

    @pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__)
    async def test_conformance(case, my_sandbox):
        await case(my_sandbox)

The cases cover exec (foreground, streamed, background, timeouts, caps, a
running command's stdin), files (mkdir and rename too), watching a directory,
grep and glob, the sandbox's own surface (status, processes, preview
URL, paths, capabilities), and the lifecycle (pause, suspend/resume cycles,
snapshots, forks).
Each case takes one running sandbox (in-process ``hutch.Sandbox`` or a
client's remote sandbox) with the read-before-write guardrail off, and raises
``AssertionError`` when the provider falls short. Each leaves nothing behind:
every snapshot it makes is removed and every branch it starts is ended
(``Fork.close``), pass or fail. A case whose capability the
provider does not declare checks the refusal instead: the operation must fail
with ``capability_unsupported``. Nothing is skipped.

A runner may give one sandbox many cases: after each, ``ready_for_another_case``
empties its working directory and says whether it is as a fresh one would be
(running, nothing left open); when it says no, the runner makes another.
"""

from __future__ import annotations

from ._exec import EXEC_CASES
from ._fileops import FILE_OP_CASES
from ._files import FILE_CASES
from ._lifecycle import LIFECYCLE_CASES
from ._reuse import ready_for_another_case
from ._stdin import STDIN_CASES
from ._support import Case, raises, refused
from ._surface import SURFACE_CASES
from ._watching import WATCH_CASES

#: Every case, in the order they are best run.
CASES: list[Case] = [
    *FILE_CASES, *FILE_OP_CASES, *SURFACE_CASES, *EXEC_CASES, *STDIN_CASES, *WATCH_CASES,
    *LIFECYCLE_CASES,
]

__all__ = ["CASES", "EXEC_CASES", "FILE_CASES", "FILE_OP_CASES", "LIFECYCLE_CASES", "STDIN_CASES",
           "SURFACE_CASES", "WATCH_CASES", "Case", "raises", "ready_for_another_case",
           "refused"]
