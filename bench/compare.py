"""Compare this checkout's benches with another commit's, in one run.

``.venv/bin/python bench/compare.py [--ref REF] [--rounds N] [bench[:arg,...] ...]``

It checks ``REF`` (default bc2d03a, main before issue 21's redesign) out
detached in a temporary directory and builds that code's agent; what that
code depends on and this environment lacks (bc2d03a's CLI was built on
typer) is installed once beside it (:func:`site_for`), so that its CLI and
startup benches run too. Each round
then runs each bench present in both twice at once: this checkout's script,
on the old code and on the new (``PYTHONPATH``), so both sides measure
alike, in lockstep (``_turns.Turns``: one runs while the other waits, and
they switch between two samples every 50 ms or so, the first mover flipped
each round), so that a machine whose speed drifts weighs on both alike
(fork's runs one side after the other: :data:`ONE_AFTER_THE_OTHER`). It
matches the rows each prints (``_common.row``) by bench, section and name,
and prints per row the medians over the rounds of hutch's figure, old and
new, the median of the rounds' new/old, both floors (a floor that moved
says the machine did), the new hutch/floor ratio over the old one (which
cancels load), in how many rounds new was the slower, the 90 % interval of
new/old (from the rounds' paired ratios, see :func:`interval`), and a
verdict read off that interval (:func:`verdict`): better, within 5 %,
WORSE, or unsettled when the interval holds both 1.05 and less (the
rounds disagree more than 5 %: run more of them). ``fork:docker``
runs ``bench_fork.py docker`` (a bench's own arguments, both sides alike). Each bench's raw
output goes to stderr as it comes; ``--log FILE...`` tables saved ones.
It will not run from a process that ignores or blocks a signal (``nohup``):
the rule is hutch's own (``inherits_signal_state``).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import os
import pathlib
import re
import select
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import tomllib
from typing import IO, NamedTuple

from hutch.providers._signals import inherits_signal_state

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _turns import TURNS_ENV

HERE = pathlib.Path(__file__).resolve().parent
NEW = HERE.parent
DEFAULT_REF = "bc2d03a"
#: Where an old tree's dependencies this environment lacks are installed,
#: one directory per list of them (typer, say: bc2d03a's CLI was built on it).
SITES = pathlib.Path("/var/cache/hutch/bench-sites")
TOLERANCE = 0.05
#: A row: its name, hutch's figure and the floor's, in one unit (ms, s, MiB; or /s, a rate).
_ROW = re.compile(r"^\s*(?P<name>\S.*?)\s+(?P<hutch>[\d.]+)(?P<unit>ms|s|/s|MiB)"
                  r"(?:\s+(?P<floor>[\d.]+)(?P=unit))?(?:\s.*)?$")

Key = tuple[str, str, str, str]  # bench, section, row name, unit


#: One side's figures for one row: (hutch ms, floor ms) by the round that printed it.
Figures = dict[int, tuple[float, float]]


def parse(bench: str, output: str) -> dict[Key, tuple[float, float]]:
    """The rows a bench printed: (hutch ms, floor ms) by bench, section and name."""
    rows: dict[Key, tuple[float, float]] = {}
    section = ""
    for line in output.splitlines():
        if line.startswith("== "):
            section = line[3:].strip()
            continue
        found = _ROW.match(line)
        if found is None or line.startswith("measure "):
            continue
        try:
            figures = float(found["hutch"]), float(found["floor"] or 0)
        except ValueError:
            continue
        name = found["name"].strip()
        rows[(bench, section, name, found["unit"])] = figures
    return rows


def checkout(ref: str, into: pathlib.Path) -> pathlib.Path:
    tree = into / "old"
    subprocess.run(["git", "-C", str(NEW), "worktree", "add", "--detach", "-q", str(tree), ref],
                   check=True)
    return tree


class Code(NamedTuple):
    """The code one side runs: a tree's ``src``, and the directory holding
    what that tree depends on and this environment lacks (``site``), if any."""

    tree: pathlib.Path
    site: pathlib.Path | None = None

    def pythonpath(self) -> str:
        return os.pathsep.join(str(p) for p in (self.tree / "src", self.site) if p is not None)


def site_for(tree: pathlib.Path, sites: pathlib.Path = SITES) -> pathlib.Path | None:
    """A directory holding what ``tree``'s ``[project] dependencies`` need and
    this environment lacks, installed there once, or None when it lacks
    nothing. Only the missing distributions go there (pip's own answer to
    what installing them here would add), not those this environment has:
    the old side imports the same httpx, click and rich as the new."""
    declared = tomllib.loads((tree / "pyproject.toml").read_text())["project"].get(
        "dependencies", [])
    where = sites / hashlib.sha256("\n".join(sorted(declared)).encode()).hexdigest()[:16]
    if (where / ".complete").exists():
        return where if any(p.name != ".complete" for p in where.iterdir()) else None
    report = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--report", "-",
         *declared], capture_output=True, text=True, check=True).stdout
    pins = [f"{item['metadata']['name']}=={item['metadata']['version']}"
            for item in json.loads(report)["install"]]
    if pins:
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                        "--target", str(where), *pins], check=True)
    where.mkdir(parents=True, exist_ok=True)
    (where / ".complete").touch()
    return where if pins else None


class _Twin:
    """One side of a run: its bench process and, in lockstep, the pipe end
    that gives it a turn and the one it says its turn is done on (EOF: it
    ended)."""

    def __init__(self, code: Code, script: pathlib.Path, args: list[str], lockstep: bool) -> None:
        go_read, self.go = os.pipe()
        self.done, done_write = os.pipe()
        env = dict(os.environ, PYTHONPATH=code.pythonpath())
        if lockstep:
            env[TURNS_ENV] = f"{go_read},{done_write}"
        env.pop("HUTCH_HOME", None)
        # This checkout's bench on that tree's code: both sides measure alike.
        self.child = subprocess.Popen(
            [sys.executable, str(script), *args], cwd=code.tree, env=env,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            pass_fds=(go_read, done_write) if lockstep else ())
        os.close(go_read)
        os.close(done_write)
        self.output: list[str] = []
        self.errors: list[str] = []
        self._readers = [threading.Thread(target=self._drain, args=(stream, into))
                         for stream, into in ((self.child.stdout, self.output),
                                              (self.child.stderr, self.errors))]
        for reader in self._readers:
            reader.start()

    @staticmethod
    def _drain(stream: IO[str] | None, into: list[str]) -> None:
        assert stream is not None
        into.append(stream.read())

    def give_turn(self) -> None:
        with contextlib.suppress(BrokenPipeError):  # it ended: its done pipe says so
            os.write(self.go, b".")

    def wait_turn_done(self) -> bool:
        """False once it has ended (a process it forked may hold the pipe on)."""
        while not select.select([self.done], [], [], 1.0)[0]:
            if self.child.poll() is not None:
                return False
        return os.read(self.done, 1) == b"."

    def finish(self, tree: pathlib.Path, script: pathlib.Path) -> str:
        os.close(self.go)
        os.close(self.done)
        self.child.wait()
        for reader in self._readers:
            reader.join()
        if self.child.returncode != 0:
            tail = "\n".join("".join(self.errors).splitlines()[-15:])
            print(f"!! {script.name} on {tree} failed ({self.child.returncode}):\n{tail}",
                  file=sys.stderr)
        return "".join(self.output)

    def interrupt(self) -> None:
        # The bench removes what it made on SIGINT (its own finally); a closed
        # go pipe lets one waiting for its turn run on to that.
        self.child.send_signal(signal.SIGINT)
        with contextlib.suppress(OSError):
            os.close(self.go)


#: Benches run one side after the other, not in lockstep: the kernel's work
#: for what one made (writing back 10 000-file trees, docker's commits)
#: goes on through the other's turns, and was timed as the other's (a
#: ``cp -a`` floor 9x its twin's).
ONE_AFTER_THE_OTHER = frozenset({"fork"})


def run_twins(
    codes: list[Code], script: pathlib.Path, args: list[str], lockstep: bool = True
) -> tuple[list[str], int]:
    """A bench ``script``'s output on each side's code, the two run in lockstep
    (``_turns.Turns``): only one runs at a time, and they take turns, the
    first in ``codes`` first, until both have ended; and how many turns.
    Without ``lockstep``, the first runs to its end, then the second."""
    if not lockstep:
        outputs = []
        for code in codes:
            alone = _Twin(code, script, args, lockstep=False)
            try:
                alone.child.wait()
            except BaseException:
                alone.interrupt()
                alone.child.wait()
                raise
            outputs.append(alone.finish(code.tree, script))
        return outputs, len(codes)
    twins = [_Twin(code, script, args, lockstep=True) for code in codes]
    turns = 0
    try:
        live = list(range(len(twins)))
        holder = 0
        twins[holder].give_turn()
        while live:
            turns += 1
            if not twins[holder].wait_turn_done():
                live.remove(holder)
            after = [i for i in live if i != holder]
            holder = after[0] if after else holder
            if holder in live:
                twins[holder].give_turn()
    except BaseException:
        for twin in twins:
            twin.interrupt()
        for twin in twins:
            twin.child.wait()
        raise
    return [twin.finish(code.tree, script) for twin, code in zip(twins, codes, strict=True)], turns


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def build_agent(tree: pathlib.Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(tree / "src"))
    subprocess.run([sys.executable, "-m", "hutch.providers.agent"], cwd=tree, env=env,
                   capture_output=True, check=False)


#: Student's t, two-sided 90 %, by degrees of freedom (rounds - 1); a number
#: of rounds between two listed takes the smaller's (the wider interval).
_T90 = {1: 6.314, 2: 2.920, 3: 2.353, 4: 2.132, 5: 2.015, 6: 1.943, 7: 1.895, 8: 1.860,
        9: 1.833, 10: 1.812, 12: 1.782, 15: 1.753, 20: 1.725, 30: 1.697}


def interval(ratios: list[float]) -> tuple[float, float] | None:
    """The 90 % interval of the typical new/old (their geometric mean), from
    each round's paired new/old: a t interval on their logarithms, since a
    round's load scales both sides alike. None under two rounds."""
    if len(ratios) < 2 or not all(0 < r < math.inf for r in ratios):
        return None
    logs = [math.log(r) for r in ratios]
    t = _T90[max(df for df in _T90 if df <= len(logs) - 1)]
    half = t * statistics.stdev(logs) / math.sqrt(len(logs))
    mean = statistics.fmean(logs)
    return math.exp(mean - half), math.exp(mean + half)


def verdict(bounds: tuple[float, float] | None, floor_bounds: tuple[float, float] | None) -> str:
    """``bounds``: new/old's interval; ``floor_bounds``: that of new/old each
    over its round's floor. Within 5 % only when the whole interval is."""
    if bounds is None:
        return "unsettled (one round)"
    low, high = bounds
    if high < 1 - TOLERANCE:
        return "better"
    if high <= 1 + TOLERANCE:
        return "within 5%"
    if low > 1 + TOLERANCE:
        if floor_bounds is not None and floor_bounds[1] <= 1 + TOLERANCE:
            return "worse, its floor too"  # the machine's load moved, most likely
        return "WORSE"
    return "unsettled"


def _cost(figure: float, unit: str) -> float:
    return 1 / figure if unit == "/s" else figure


def _medians(old: Figures, new: Figures, rounds: list[int]) -> tuple[float, ...]:
    """Old hutch, new hutch, old floor, new floor: each a median over ``rounds``."""
    return tuple(statistics.median(side[i][at] for i in rounds)
                 for at, side in ((0, old), (0, new), (1, old), (1, new)))


def table(old: dict[Key, Figures], new: dict[Key, Figures]) -> None:
    print(f"{'row':<52} {'old':>9} {'new':>9} {'new/old':>7} {'old flr':>9} {'new flr':>9}"
          f" {'ratio/':>7} {'slower':>6} {'90% interval':>13}  verdict")
    shown = ""
    for key in sorted(old.keys() & new.keys(), key=list(old).index):
        bench, section, name, unit = key
        if f"{bench}: {section}" != shown:
            shown = f"{bench}: {section}"
            print(f"-- {shown}")
        o, n = old[key], new[key]
        # Each round's new/old, paired: both ran under that round's load.
        rounds = sorted(o.keys() & n.keys())
        if not rounds:
            continue
        # A rate's cost is its inverse: new/old > 1 is worse either way.
        changes = [_cost(n[i][0], unit) / _cost(o[i][0], unit) if o[i][0] and n[i][0]
                   else math.inf for i in rounds]
        change = statistics.median(changes)
        ratios = [_cost(n[i][0] / n[i][1], unit) / _cost(o[i][0] / o[i][1], unit)
                  for i in rounds if n[i][1] and o[i][1] and o[i][0] and n[i][0]]
        ratio = statistics.median(ratios) if ratios else None
        shown_ratio = f"{ratio:>6.2f}x" if ratio is not None else f"{'-':>7}"
        slower = sum(_cost(n[i][0], unit) > _cost(o[i][0], unit) for i in rounds)
        mid = _medians(o, n, rounds)
        bounds = interval(changes)
        shown_bounds = f"{bounds[0]:.2f}-{bounds[1]:.2f}x" if bounds else "-"
        label = f"{name} ({unit})"
        print(f"{label[:52]:<52} {mid[0]:>9.3f} {mid[1]:>9.3f} {change:>6.2f}x "
              f"{mid[2]:>9.3f} {mid[3]:>9.3f} {shown_ratio} {f'{slower}/{len(rounds)}':>6} "
              f"{shown_bounds:>13}  {verdict(bounds, interval(ratios))}")
    for key in old.keys() - new.keys():
        print(f"only before: {' / '.join(key[:3])}")
    for key in new.keys() - old.keys():
        print(f"only now: {' / '.join(key[:3])}")


def from_logs(logs: list[str]) -> tuple[dict[Key, Figures], dict[Key, Figures]]:
    """The old and new rows of saved runs' stderr (an interrupted run's too)."""
    sides: dict[str, dict[Key, Figures]] = {"old": {}, "new": {}}
    offset = 0  # each log's rounds after the ones before: runs pool
    for log in logs:
        last = 0
        for block in log.split("\n## round ")[1:]:
            head, _, output = block.partition("\n")
            found = re.match(r"(\d+): (\w+) \((old|new)\)", head)
            if found is None:
                continue
            last = max(last, int(found[1]))
            for key, figures in parse(found[2], output).items():
                sides[found[3]].setdefault(key, {})[offset + int(found[1]) - 1] = figures
        offset += last
    return sides["old"], sides["new"]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("benches", nargs="*",
                        help="bench names, each with its arguments after a colon, comma-"
                             "separated (fork:docker); default: all both have")
    parser.add_argument("--ref", default=DEFAULT_REF)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--log", nargs="+", metavar="FILE",
                        help="run nothing: table the rows of saved runs' stderr, rounds pooled")
    args = parser.parse_args(argv)
    if args.log:
        table(*from_logs([pathlib.Path(p).read_text() for p in args.log]))
        return 0
    if inherits_signal_state():
        # hutch's exec starts a command with every signal at its default, by one
        # exec more when the caller ignores or blocks any (nohup ignores SIGHUP);
        # bc2d03a's passed them on. The two would time different work.
        print("compare: this process ignores or blocks a signal (nohup?): run it from a"
              " shell that does neither, or the old and new execs differ", file=sys.stderr)
        return 2
    if subprocess.run(["git", "-C", str(NEW), "rev-parse", "-q", "--verify",
                       f"{args.ref}^{{commit}}"], capture_output=True).returncode != 0:
        print(f"compare: {args.ref!r} names no commit here", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _interrupt)  # a kill still removes the checkout
    with tempfile.TemporaryDirectory(prefix="hutch-compare-", dir="/var/tmp") as scratch:
        tree = checkout(args.ref, pathlib.Path(scratch))
        try:
            ours = {p.stem.removeprefix("bench_") for p in HERE.glob("bench_*.py")}
            theirs = {p.stem.removeprefix("bench_") for p in (tree / "bench").glob("bench_*.py")}
            asked = {b.partition(":")[0]: [a for a in b.partition(":")[2].split(",") if a]
                     for b in args.benches} or {b: [] for b in sorted(ours & theirs)}
            for name in set(asked) - (ours & theirs):
                print(f"!! {name}: not a bench in both", file=sys.stderr)
            benches = {b: a for b, a in asked.items() if b in ours & theirs}
            build_agent(tree)
            build_agent(NEW)
            ref_code = Code(tree, site_for(tree))
            old: dict[Key, Figures] = {}
            new: dict[Key, Figures] = {}
            for turn in range(args.rounds):
                for bench, bench_args in benches.items():
                    sides = [(ref_code, old), (Code(NEW), new)]
                    if turn % 2:
                        sides.reverse()  # who moves first, flipped each round
                    outputs, turns = run_twins([where for where, _ in sides],
                                               HERE / f"bench_{bench}.py", bench_args,
                                               lockstep=bench not in ONE_AFTER_THE_OTHER)
                    for (_, into), output in zip(sides, outputs, strict=True):
                        # The raw rows on stderr, as they come: the table is stdout's.
                        print(f"\n## round {turn + 1}: {bench} ("
                              f"{'old' if into is old else 'new'}), {turns} turns{output}",
                              file=sys.stderr, flush=True)
                        for key, figures in parse(bench, output).items():
                            into.setdefault(key, {})[turn] = figures
            print(f"\n{args.ref} (old) beside {NEW} (new), {args.rounds} rounds, ms")
            table(old, new)
        finally:
            subprocess.run(["git", "-C", str(NEW), "worktree", "remove", "--force", str(tree)],
                           check=False)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
