"""hutch._lazy: a library imported at its first use."""

from __future__ import annotations

import subprocess
import sys

import pytest

from hutch._lazy import lazy_module


def test_a_missing_library_is_told_at_once_by_its_top_level_name() -> None:
    with pytest.raises(ModuleNotFoundError) as raised:
        lazy_module("no_such_library_here.sub")
    assert raised.value.name == "no_such_library_here"


def test_the_library_is_imported_at_its_first_attribute_not_before() -> None:
    code = (
        "import sys, threading\n"
        "from hutch._lazy import lazy_module\n"
        "tomllib = lazy_module('tomllib')\n"
        "assert 'tomllib' not in sys.modules\n"
        "found = []\n"
        "threads = [threading.Thread(target=lambda: found.append(tomllib.loads)) "
        "for _ in range(8)]\n"
        "[t.start() for t in threads]\n"
        "[t.join() for t in threads]\n"
        "import tomllib as real\n"
        "assert found == [real.loads] * 8, found\n"
        "assert tomllib.loads('a = 1') == {'a': 1}\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr


def test_a_submodule_stands_for_itself() -> None:
    parsers = lazy_module("email.parser")
    assert parsers.BytesParser is __import__("email.parser").parser.BytesParser
