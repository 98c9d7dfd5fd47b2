"""Conformance: the package's capability-gated cases (``hutch.testing``) on
every provider of the suite, in-process and through the daemon."""

from __future__ import annotations

from typing import Any

import pytest

from hutch.testing import CASES, Case

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.__name__.removeprefix("check_"))
async def test_case(files_sandbox: Any, case: Case) -> None:
    await case(files_sandbox)
