"""A command's output spool dropped without a close (a background command's
handle nobody reads, a sandbox's commands forgotten at its end) gives its
share of the memory budget back and closes its file when it is collected:
the budget does not shrink for good, and no ResourceWarning is left."""

from __future__ import annotations

import gc
import warnings
from collections.abc import Iterator

import pytest

from hutch import _membudget
from hutch._membudget import Spool


@pytest.fixture
def budget() -> Iterator[_membudget.MemoryBudget]:
    """A budget of the test's own (the process's is shared with the rest of the run)."""
    previous = _membudget.budget().total
    _membudget.configure(total=10_000_000)
    try:
        yield _membudget.budget()
    finally:
        _membudget.configure(total=previous)


@pytest.mark.parametrize("memory_max", [pytest.param(100_000, id="in_memory"),
                                        pytest.param(10, id="on_disk")])
def test_a_spool_dropped_unclosed_gives_its_share_back_without_a_warning(
    budget: _membudget.MemoryBudget, memory_max: int,
) -> None:
    gc.collect()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        spool = Spool(memory_max=memory_max)
        spool.write(b"x" * 1000)
        assert budget.held == (0 if spool.on_disk else 1000)
        del spool
        gc.collect()
    assert budget.held == 0
    assert [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)] == []


def test_a_closed_spool_is_not_given_back_twice(budget: _membudget.MemoryBudget) -> None:
    spool = Spool()
    spool.write(b"z" * 10)
    other = Spool()
    other.write(b"w" * 5)
    spool.close()
    assert budget.held == 5
    del spool
    gc.collect()
    assert budget.held == 5
    other.close()
    assert budget.held == 0
