"""Conformance: the packaged suite (``hutch.testing``) once on every provider,
in-process and through the daemon; each case asks the sandbox's capabilities
what it may expect."""

from __future__ import annotations

from typing import Any

import pytest

from hutch.testing import CASES, Case

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.__name__.removeprefix("check_"))
async def test_case(sandbox: Any, case: Case) -> None:
    await case(sandbox)
