"""A host command ended by hutch (its output cap, a timeout) leaves no pipe
or subprocess transport open: what it wrote and nobody read is drained to
the pipes' end, so the transport closes, rather than staying paused on a
full buffer until garbage collection finds it (with a ResourceWarning whose
import of tracemalloc, inside another import, breaks Python 3.11's import
locks: gh-91351)."""

from __future__ import annotations

import gc
import warnings

import pytest

import hutch


def _unclosed(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught
            if issubclass(w.category, ResourceWarning)
            and "unclosed transport <_Unix" in str(w.message)]


@pytest.mark.anyio
@pytest.mark.parametrize("command", [
    pytest.param(("head -c 3000000 /dev/zero", {"output_limit": 1_000_000}), id="output_cap"),
    pytest.param(("head -c 3000000 /dev/zero; sleep 30", {"timeout": 1}), id="timeout"),
])
async def test_a_command_hutch_ends_leaves_no_transport_open(
    command: tuple[str, dict[str, float]],
) -> None:
    line, options = command
    gc.collect()  # what earlier tests of this process left is not this one's
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        async with await hutch.create_sandbox("local") as sandbox:
            with pytest.raises((hutch.OutputLimitExceeded, TimeoutError)):
                await sandbox.exec(line, **options)  # type: ignore[arg-type]
        gc.collect()
    assert _unclosed(caught) == []
