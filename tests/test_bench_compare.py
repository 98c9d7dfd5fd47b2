"""bench/compare.py: it refuses a run whose old and new sides would time
different work, and reads a verdict off the rounds' paired ratios."""

from __future__ import annotations

import importlib.util
import itertools
import math
import pathlib
import signal
import subprocess
import sys
import zipfile
from typing import Any

import pytest

COMPARE = pathlib.Path(__file__).resolve().parent.parent / "bench" / "compare.py"


def _ignore_hangup() -> None:
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # what nohup does


def _ignore_none() -> None:
    # The suite itself may run under nohup: the child starts with none ignored.
    for number in signal.valid_signals():
        if signal.getsignal(number) is signal.SIG_IGN:
            signal.signal(number, signal.SIG_DFL)


def test_a_compare_started_with_a_signal_ignored_is_refused_before_any_checkout() -> None:
    # Main's exec resets an ignored signal by one exec more; bc2d03a's did not, so
    # under nohup the in-process exec row compared unlike work (1.41x, none of it real).
    ran = subprocess.run([sys.executable, str(COMPARE), "--ref", "no-such-ref", "fork"],
                         preexec_fn=_ignore_hangup, capture_output=True, text=True, timeout=60)
    assert ran.returncode == 2
    assert "ignores or blocks a signal" in ran.stderr
    assert "no-such-ref" not in ran.stderr  # refused before it looked for the commit


def test_a_compare_with_no_signal_ignored_goes_on_and_tells_a_ref_that_names_no_commit() -> None:
    ran = subprocess.run([sys.executable, str(COMPARE), "--ref", "no-such-ref", "fork"],
                         preexec_fn=_ignore_none, capture_output=True, text=True, timeout=60)
    assert "ignores" not in ran.stderr
    assert ran.returncode == 2
    assert ran.stderr.strip() == "compare: 'no-such-ref' names no commit here"


def _compare_module() -> Any:
    spec = importlib.util.spec_from_file_location("bench_compare", COMPARE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_verdict_is_read_off_the_interval_of_the_rounds_paired_ratios() -> None:
    compare = _compare_module()
    # Rounds that agree: within 5 % only when all of the interval is.
    steady = compare.interval([1.01, 1.03, 0.99, 1.02, 1.00, 1.02])
    assert steady is not None and 0.99 < steady[0] < steady[1] < 1.04
    assert compare.verdict(steady, None) == "within 5%"
    # A median inside 5 % is not enough when the rounds disagree by more.
    scattered = compare.interval([0.90, 1.04, 1.30, 0.95, 1.20, 1.03])
    assert scattered is not None and scattered[0] < 1.05 < scattered[1]
    assert compare.verdict(scattered, None) == "unsettled"
    # Slower in every round, by more than 5 %: worse, whatever the floor did.
    slower = compare.interval([1.20, 1.25, 1.22, 1.18])
    assert slower is not None and slower[0] > 1.05
    assert compare.verdict(slower, None) == "WORSE"
    assert compare.verdict(slower, compare.interval([1.0, 1.01, 0.99, 1.0])) == (
        "worse, its floor too")
    assert compare.verdict(compare.interval([0.80, 0.85, 0.82]), None) == "better"
    # One round has no interval; a round whose figure was missing neither.
    assert compare.interval([1.0]) is None and compare.verdict(None, None).startswith("unsettled")
    assert compare.interval([1.0, math.inf]) is None


def test_the_table_tells_each_rows_interval_and_verdict(capsys: pytest.CaptureFixture[str]) -> None:
    compare = _compare_module()
    key = ("local", "local provider", "exec round trip (true)", "ms")
    old = {key: {i: (2.0, 1.0) for i in range(4)}}
    new = {key: {i: (2.0 * r, 1.0) for i, r in enumerate([1.3, 1.25, 1.28, 1.31])}}
    compare.table(old, new)
    row = next(line for line in capsys.readouterr().out.splitlines()
               if line.startswith("exec round trip"))
    assert row.endswith("WORSE") and " 4/4 " in row
    low, high = (float(x) for x in row.split()[-2].rstrip("x").split("-"))
    assert 1.2 < low < 1.28 < high < 1.35


#: A bench stand-in: it logs each of its steps (its side, the step, when it
#: began and ended) and takes a turn after each, as a bench does between samples.
_TWIN_SCRIPT = """
import os, subprocess, sys, time
sys.path.insert(0, {bench!r})
import _turns
from _turns import TURNS_ENV, Turns
turns = Turns(os.environ.pop(TURNS_ENV, None))
_turns.TURN_S = 0.0  # a turn after every step
side = os.path.basename(os.path.dirname(os.environ["PYTHONPATH"].split(os.pathsep)[0]))
steps = int(sys.argv[1]) if side == "old" else 5
# What a bench starts is not its twin: no turns, no pipe ends.
leaked = subprocess.run(["sh", "-c", "echo ${{HUTCH_BENCH_TURNS:-none}}; ls /proc/self/fd"],
                        capture_output=True, text=True).stdout.split()
for step in range(steps):
    began = time.perf_counter()
    time.sleep(0.02)
    with open({log!r}, "a") as log:
        log.write(f"{{side}} {{step}} {{began}} {{time.perf_counter()}}\\n")
    turns.take()
print(f"{{side}} ran {{steps}} steps, leaked {{leaked}}")
sys.exit(3 if side == "old" and steps < 5 else 0)
"""


def _twins(
    tmp_path: pathlib.Path, sides: tuple[str, str]
) -> tuple[pathlib.Path, list[pathlib.Path]]:
    """The stand-in's script and the two trees it runs on (``sides``, in the
    order given); its steps go to ``steps.log`` beside them."""
    script = tmp_path / "bench_twin.py"
    script.write_text(_TWIN_SCRIPT.format(bench=str(COMPARE.parent),
                                          log=str(tmp_path / "steps.log")))
    trees = [tmp_path / side for side in sides]
    for tree in trees:
        (tree / "src").mkdir(parents=True)
    return script, trees


def _steps(tmp_path: pathlib.Path) -> list[list[str]]:
    """The stand-ins' steps, each (side, step, began, ended), checked never
    to overlap: each began after the one before it ended."""
    steps = [line.split() for line in (tmp_path / "steps.log").read_text().splitlines()]
    for before, after in itertools.pairwise(steps):
        assert float(after[2]) >= float(before[3])
    return steps


@pytest.mark.parametrize("old_steps", [5, 2])
def test_twins_take_turns_and_one_that_ends_early_leaves_the_other_to_run_on(
    tmp_path: pathlib.Path, old_steps: int, capsys: pytest.CaptureFixture[str]
) -> None:
    compare = _compare_module()
    script, trees = _twins(tmp_path, ("old", "new"))
    outputs, turns = compare.run_twins([compare.Code(t) for t in trees], script, [str(old_steps)])
    assert outputs[0].startswith(f"old ran {old_steps} steps, leaked ['none', '0', '1', '2'")
    assert outputs[1].startswith("new ran 5 steps, leaked ['none', '0', '1', '2'")
    for output in outputs:  # sh's own 0, 1, 2 and ls's directory: nothing more
        assert len(output.split("leaked ")[1].split(",")) == 5
    steps = _steps(tmp_path)  # never both at once
    # Old first, then strictly by turns while both run, the new alone after.
    expected = [(side, str(n)) for n in range(old_steps) for side in ("old", "new")]
    expected += [("new", str(n)) for n in range(old_steps, 5)]
    assert [(side, n) for side, n, *_ in steps] == expected
    assert turns >= 2 * old_steps
    failed = capsys.readouterr().err
    assert ("bench_twin.py on" in failed and "failed (3)" in failed) == (old_steps < 5)


def test_a_bench_run_one_after_the_other_runs_each_side_whole_in_turn(
    tmp_path: pathlib.Path,
) -> None:
    # fork's: the kernel's work for one side's trees would land in the other's turns.
    compare = _compare_module()
    assert "fork" in compare.ONE_AFTER_THE_OTHER
    script, trees = _twins(tmp_path, ("new", "old"))
    outputs, _ = compare.run_twins([compare.Code(t) for t in trees], script, ["5"],
                                   lockstep=False)
    assert [output.split(", leaked")[0] for output in outputs] == [
        "new ran 5 steps", "old ran 5 steps"]
    assert [(side, n) for side, n, *_ in _steps(tmp_path)] == (
        [("new", str(n)) for n in range(5)] + [("old", str(n)) for n in range(5)])


def _wheel(into: pathlib.Path, name: str, version: str) -> None:
    """A wheel of one empty module ``name``, as pip installs it."""
    info = f"{name}-{version}.dist-info"
    with zipfile.ZipFile(into / f"{name}-{version}-py3-none-any.whl", "w") as wheel:
        wheel.writestr(f"{name}/__init__.py", f"VERSION = {version!r}\n")
        wheel.writestr(f"{info}/METADATA",
                       f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        wheel.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: hand\n"
                                        "Root-Is-Purelib: true\nTag: py3-none-any\n")
        wheel.writestr(f"{info}/RECORD", "")


def test_the_old_trees_missing_dependencies_go_beside_it_and_nothing_this_environment_has(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # bc2d03a's CLI imports typer, which today's environment lacks: its CLI and
    # startup benches failed, and compared nothing.
    compare = _compare_module()
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    _wheel(wheels, "hutch_bench_standin", "1.2")
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # nothing but the wheel here
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheels))
    tree = tmp_path / "old"
    tree.mkdir()
    (tree / "pyproject.toml").write_text(
        '[project]\nname = "old"\ndependencies = ["httpx>=0.20", "hutch_bench_standin>=1"]\n')
    site = compare.site_for(tree, tmp_path / "sites")
    assert site is not None
    found = subprocess.run(
        [sys.executable, "-c", "import hutch_bench_standin, httpx; "
         "print(hutch_bench_standin.VERSION, httpx.__file__)"],
        env={"PYTHONPATH": compare.Code(tree, site).pythonpath(), "PATH": "/usr/bin:/bin"},
        capture_output=True, text=True, check=True).stdout.split()
    assert found[0] == "1.2"
    assert not found[1].startswith(str(site))  # httpx: this environment's own
    assert sorted(p.name for p in site.iterdir() if not p.name.startswith(".")) == [
        "hutch_bench_standin", "hutch_bench_standin-1.2.dist-info"]
    # Installed once: the next run finds it without pip (here it could not).
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "none"))
    assert compare.site_for(tree, tmp_path / "sites") == site
    # A tree that needs nothing more gets no site.
    (tree / "pyproject.toml").write_text('[project]\nname = "old"\ndependencies = ["httpx"]\n')
    assert compare.site_for(tree, tmp_path / "sites") is None
