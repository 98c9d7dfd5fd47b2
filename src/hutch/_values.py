"""Rules every value a caller hands hutch meets, whatever the entry (HTTP,
the SDK in-process): text that can reach a system call, and a command's size.

A string a caller sends may hold what no file name, argument, environment
variable or image name can: a lone UTF-16 surrogate (valid in a Python
string and in JSON's ``\\ud800``, but no UTF-8 encodes it) or a NUL byte
(the end of a C string). Each is refused here with ``invalid_argument``
naming the field, before anything is made, rather than failing deep in a
provider.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from ._errors import InvalidArgument

_SURROGATE = re.compile("[\ud800-\udfff]")

#: The longest single argument (a shell command is one: ``bash -c CMD``) the
#: Linux kernel passes to a program (MAX_ARG_STRLEN, 32 pages), bytes.
MAX_ARG_BYTES = 128 * 1024 - 1
#: The most a command (its arguments and the variables it is given) may
#: hold, bytes: three quarters of the kernel's usual total (a quarter of an
#: 8 MiB stack), the rest left for the sandbox's own environment. A command
#: of 1 MiB of arguments (inspect_ai's provider check sends 16 of 64 KiB)
#: must fit with room to spare.
MAX_COMMAND_BYTES = 1536 * 1024


def text_problem(text: str, *, nul: bool = True) -> str | None:
    """What makes ``text`` unfit to reach the system, or None."""
    found = _SURROGATE.search(text)
    if found is not None:
        return (f"is not valid text: a lone surrogate (U+{ord(found.group()):04X}) "
                f"at character {found.start()}")
    if nul and "\0" in text:
        return f"contains a NUL byte at character {text.index(chr(0))}"
    return None


def text_problems(value: Any, where: str, *, nul: bool = True) -> Iterator[str]:
    """``"where.key: problem"`` for every string in ``value`` (nested in
    mappings and sequences, keys included) that :func:`text_problem` refuses."""
    if isinstance(value, str):
        problem = text_problem(value, nul=nul)
        if problem is not None:
            yield f"{where or 'value'} {problem}"
    elif isinstance(value, Mapping):
        for key, item in value.items():
            inner = f"{where}.{key}" if where else str(key)
            if isinstance(key, str):
                problem = text_problem(key, nul=nul)
                if problem is not None:
                    yield f"a key of {where or 'the settings'} {problem}"
                    continue
            yield from text_problems(item, inner, nul=nul)
    elif isinstance(value, Sequence) and not isinstance(value, bytes | bytearray):
        for index, item in enumerate(value):
            yield from text_problems(item, f"{where}[{index}]", nul=nul)


def check_text(value: Any, where: str, *, nul: bool = True) -> None:
    """InvalidArgument naming the field when ``value`` holds unfit text."""
    for problem in text_problems(value, where, nul=nul):
        raise InvalidArgument(problem)


def check_command(argv: Sequence[str], env: Mapping[str, str]) -> None:
    """InvalidArgument unless ``argv`` and ``env`` are text a program can be
    given, within the kernel's limits (:data:`MAX_ARG_BYTES` an argument,
    :data:`MAX_COMMAND_BYTES` in all)."""
    check_text(list(argv), "cmd")
    check_text(dict(env), "env")
    for key in env:
        if not key or "=" in key:
            raise InvalidArgument(f"env: {key!r} is not a variable name")
    total = 0
    for index, arg in enumerate(argv):
        size = len(arg.encode())
        if size > MAX_ARG_BYTES:
            raise InvalidArgument(
                f"cmd[{index}] is {size} bytes, over the {MAX_ARG_BYTES}-byte cap on one "
                "argument (a shell command is one): write a long script to a file and "
                "run that, or send it as stdin"
            )
        total += size + 1
    total += sum(len(k.encode()) + len(v.encode()) + 2 for k, v in env.items())
    if total > MAX_COMMAND_BYTES:
        raise InvalidArgument(
            f"cmd and env hold {total} bytes, over the cap of {MAX_COMMAND_BYTES} bytes a "
            "command may carry: write large inputs to a file, or send them as stdin"
        )
