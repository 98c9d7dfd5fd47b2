"""The README is a test: every code block in it runs as a new user would paste
it. Shell blocks run in a fresh home against a real daemon of their own,
Python blocks run as files, TOML blocks are loaded as `hutch serve` loads
its hutch.toml, TypeScript blocks are compiled by tsc in a package that
depends on the SDK and run by node against a real daemon. A block that
cannot run says so in the README, with the reason, in a comment on the line
before it:

    <!-- readme-test: skip: REASON -->
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from tests.daemon_fixture import DaemonProcess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")

FENCE = re.compile(
    r"(?:<!--\s*readme-test:\s*(?P<directive>.*?)\s*-->\s*\n)?"
    r"^```(?P<language>[\w-]*)\n(?P<code>.*?)^```\s*$",
    flags=re.S | re.M,
)
RUNNERS = ("sh", "python", "toml", "ts")


@dataclass(frozen=True)
class Block:
    line: int
    language: str
    code: str
    #: Why it is not run, as the README says (None: it runs).
    skipped: str | None

    @property
    def name(self) -> str:
        return f"{self.language}-line{self.line}"


def readme_blocks(text: str | None = None) -> list[Block]:
    if text is None:
        with open(README, encoding="utf-8") as fh:
            text = fh.read()
    found = []
    for match in FENCE.finditer(text):
        directive = match["directive"]
        skipped = None
        if directive is not None:
            said = re.fullmatch(r"skip:\s*(.+)", directive, flags=re.S)
            assert said, f"unknown readme-test directive {directive!r} (skip: REASON)"
            skipped = said[1].strip()
        line = text.count("\n", 0, match.start("language")) + 1
        found.append(Block(line, match["language"], match["code"], skipped))
    return found


def test_the_parser_sees_markers_and_every_fence() -> None:
    text = ("a\n```sh\necho 1\n```\n\n<!-- readme-test: skip: needs a GPU -->\n"
            "```python\nprint(1)\n```\n")
    first, second = readme_blocks(text)
    assert (first.language, first.code, first.skipped) == ("sh", "echo 1\n", None)
    assert (second.language, second.skipped, second.line) == ("python", "needs a GPU", 7)


def test_every_block_is_run_or_says_why_not() -> None:
    blocks = readme_blocks()
    assert len(blocks) >= 8
    for block in blocks:
        assert block.language in RUNNERS or block.skipped, (
            f"README line {block.line}: a ```{block.language} block no test runs; "
            f"write it as one of {RUNNERS} or mark it <!-- readme-test: skip: REASON -->")
    # Every fence was found: an odd count of ``` lines would hide a block.
    with open(README, encoding="utf-8") as fh:
        fences = [line for line in fh if line.startswith("```")]
    assert len(fences) == 2 * len(blocks)


BLOCKS = readme_blocks()


def _params(language: str) -> list[object]:
    marks = {"sh": [pytest.mark.slow], "python": [pytest.mark.slow], "toml": [],
             "ts": [pytest.mark.slow]}[language]
    return [
        pytest.param(b, id=b.name, marks=[*marks, *(
            [pytest.mark.docker] if "docker" in b.code or "image build" in b.code else [])])
        for b in BLOCKS if b.language == language
    ]


def _skip_if_said(block: Block) -> None:
    if block.skipped:
        pytest.skip(f"README line {block.line}: {block.skipped}")


@pytest.fixture
def fresh() -> Iterator[str]:
    """A new user's home directory, which a clone of hutch is in."""
    home = tempfile.mkdtemp(prefix="hutch-readme-home-")
    yield home
    subprocess.run(["rm", "-rf", "--one-file-system", home], check=False)


def _clone(home: str) -> str:
    """A clone's directory as the README's commands see it: .venv/bin/hutch
    is this interpreter's hutch, README.md is the README."""
    clone = os.path.join(home, "hutch")
    bin_dir = os.path.join(clone, ".venv", "bin")
    os.makedirs(bin_dir)
    with open(os.path.join(bin_dir, "hutch"), "w") as fh:
        fh.write(f'#!/bin/sh\nexec {sys.executable} -m hutch.cli.main "$@"\n')
    os.chmod(os.path.join(bin_dir, "hutch"), 0o755)
    os.symlink(README, os.path.join(clone, "README.md"))
    return clone


@pytest.mark.parametrize("block", _params("sh"))
def test_shell_block_runs_as_pasted(block: Block, fresh: str) -> None:
    _skip_if_said(block)
    clone = _clone(fresh)
    # As scripts/quickstart.sh starts it: no token (it makes its own), local allowed.
    daemon = DaemonProcess(token=None, provider=None,
                           extra_args=["--allow-provider", "local"]).start()
    # No token given: the CLI finds the one the daemon made in its data directory.
    env = {k: v for k, v in os.environ.items() if k not in ("HUTCH_TOKEN", "COLUMNS")}
    env.update(HOME=fresh, HUTCH_URL=daemon.url, HUTCH_HOME=daemon.data_dir,
               PATH=os.path.join(clone, ".venv", "bin") + os.pathsep + os.environ["PATH"])
    try:
        ran = subprocess.run(["bash", "-euo", "pipefail", "-c", block.code], cwd=clone,
                             env=env, capture_output=True, text=True, timeout=1200,
                             stdin=subprocess.DEVNULL)
        assert ran.returncode == 0, (block.line, ran.stdout, ran.stderr)
        assert "Traceback" not in ran.stderr, ran.stderr
        if "print(6 * 7)" in block.code:
            assert "42\n" in ran.stdout  # the program given on stdin ran
    finally:
        # The daemon's home goes, with what the block built there (its images,
        # and their Docker images: tests/daemon_fixture.py images_of).
        daemon.close()


@pytest.mark.parametrize("block", _params("python"))
def test_python_block_runs_as_a_file(block: Block, fresh: str) -> None:
    _skip_if_said(block)
    program = os.path.join(fresh, "example.py")
    with open(program, "w") as fh:
        fh.write(block.code)
    data = os.path.join(fresh, "hutch-data")
    env = dict(os.environ, HOME=fresh, HUTCH_HOME=data)
    for name in ("HUTCH_URL", "HUTCH_TOKEN"):
        env.pop(name, None)
    ran = subprocess.run([sys.executable, program], capture_output=True, text=True,
                         timeout=600, cwd=fresh, env=env, stdin=subprocess.DEVNULL)
    assert ran.returncode == 0, (block.line, ran.stdout, ran.stderr)


@pytest.mark.parametrize("block", _params("toml"))
def test_toml_block_is_loaded_by_serve(block: Block, tmp_path: os.PathLike[str]) -> None:
    """Loaded as `hutch serve --config` loads it, before it listens: a block
    that is not valid TOML, or names a setting hutch does not know, fails."""
    _skip_if_said(block)
    from hutch.server import load_server_config

    path = os.path.join(tmp_path, "hutch.toml")
    with open(path, "w") as fh:
        fh.write(block.code)
    loaded = load_server_config(path)
    assert loaded, block.code


@pytest.mark.parametrize("block", _params("ts"))
def test_typescript_block_runs_against_a_daemon(block: Block, fresh: str) -> None:
    """Saved in an ES module package that depends on the SDK (a link, as
    ``npm install path/to/clients/typescript`` makes), compiled by the SDK's
    tsc and run by node, with a daemon as quickstart.sh starts it: no token
    given, the SDK finds the one the daemon made (HUTCH_HOME)."""
    _skip_if_said(block)
    from tests.test_typescript_sdk import build_sdk

    sdk = build_sdk()
    package = os.path.join(fresh, "app")
    os.makedirs(os.path.join(package, "node_modules"))
    os.symlink(sdk, os.path.join(package, "node_modules", "hutch"))
    with open(os.path.join(package, "package.json"), "w") as fh:
        fh.write('{"name": "app", "private": true, "type": "module"}\n')
    with open(os.path.join(package, "example.ts"), "w") as fh:
        fh.write(block.code)
    compiled = subprocess.run(
        [str(sdk / "node_modules" / ".bin" / "tsc"), "--strict", "--target", "es2022",
         "--module", "nodenext", "--moduleResolution", "nodenext",
         "--typeRoots", str(sdk / "node_modules" / "@types"), "--types", "node", "example.ts"],
        cwd=package, capture_output=True, text=True, timeout=300, check=False)
    assert compiled.returncode == 0, (block.line, compiled.stdout, compiled.stderr)
    daemon = DaemonProcess(token=None, provider=None,
                           extra_args=["--allow-provider", "local"]).start()
    env = {k: v for k, v in os.environ.items() if k not in ("HUTCH_TOKEN", "HUTCH_URL")}
    env.update(HOME=fresh, HUTCH_URL=daemon.url, HUTCH_HOME=daemon.data_dir)
    try:
        ran = subprocess.run(["node", "example.js"], cwd=package, env=env, capture_output=True,
                             text=True, timeout=600, stdin=subprocess.DEVNULL, check=False)
        assert ran.returncode == 0, (block.line, ran.stdout, ran.stderr)
        if "echo hello; exit 3" in block.code:
            assert ran.stdout.startswith('3 "hello\\n"\n'), ran.stdout
    finally:
        daemon.close()
