"""Bench: what the hutch command and the SDK cost to start.

``hutch --help`` (as ``python -m hutch.cli.main`` and as the ``hutch``
console script) against an interpreter that imports nothing (``python -c
pass``): it is printed from the command table with no CLI library, HTTP
client, provider or server, so what is left above the floor is hutch's
package and the help's layout. Goal: 100 ms at most. The console script is
written for each tree measured as pip writes it from that tree's
``[project.scripts]`` (the one installed in the environment names this
tree's entry point, which another commit may not have).

``hutch ls`` against a daemon holding no sandbox, and ``import hutch.client``,
against ``python -c "import httpx"``: the client's own cost above the HTTP
library it is built on. Goal: ``ls`` ≤ 1.5 times ``import httpx``. Both
are measured in the same run, turn about; beside the ratio of their medians
the row gives the ratio run by run (its median and middle half), which a
machine whose load moves during the run sways less.

A new process each run, so the figures include the interpreter's start and
every import, as a person or a script pays them. Each is given as wall time
and as CPU time (user + system), the steadier figure on a shared machine.
With ``HUTCH_BASELINE_SRC`` naming another checkout's ``src`` (today's main,
say), each hutch row is measured for it too, in the same run.
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import tomllib
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from tests.daemon_fixture import DaemonProcess

import hutch
from _common import header, median_ms, row, run
from _common import timed_command as timed

RUNS = 21
#: The hutch the timed commands run: the one this bench imports, not the
#: checkout the script lies in (compare.py runs it on another commit's code).
OURS = os.path.dirname(os.path.dirname(os.path.abspath(hutch.__file__)))


def sampled(measures: dict[str, Callable[[], float]]) -> dict[str, list[float]]:
    """Each measure's runs, taken in turn (one of each, then again), so that
    a machine that slows down or speeds up moves them all alike."""
    samples: dict[str, list[float]] = {name: [] for name in measures}
    for measure in measures.values():
        measure()  # warm: the page cache, the bytecode cache, the daemon's first answer
    for _ in range(RUNS):
        for name, measure in measures.items():
            samples[name].append(measure())
    return samples


def paired_ratio(ours: list[float], floor: list[float]) -> str:
    """The ratio run by run (each of ours over the floor's run beside it):
    its median and middle half, steadier than the medians' ratio while the
    machine's load moves, and the spread says how far to trust either."""
    ratios = sorted(o / f for o, f in zip(ours, floor, strict=True))
    quarter = len(ratios) // 4
    return (f"paired {statistics.median(ratios):.2f}x "
            f"({ratios[quarter]:.2f}-{ratios[-1 - quarter]:.2f})")


def with_src(env: dict[str, str], src: str) -> dict[str, str]:
    """``env`` with ``src``'s hutch first on the path; what the path held
    stays after it (compare.py puts an old tree's missing dependencies there)."""
    inherited = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    return dict(env, PYTHONPATH=os.pathsep.join([os.path.abspath(src), *inherited]))


def console_script(src: str, directory: str) -> str:
    """The ``hutch`` console script of the tree whose ``src`` this is, as pip
    writes it from the tree's ``[project.scripts]``, in ``directory``."""
    with open(os.path.join(src, "..", "pyproject.toml"), "rb") as fh:
        entry = tomllib.load(fh)["project"]["scripts"]["hutch"]
    module, _, attr = entry.partition(":")
    path = os.path.join(directory, "hutch")
    with open(path, "w") as fh:
        fh.write(f"#!{sys.executable}\nimport re\nimport sys\nfrom {module} import {attr}\n"
                 "if __name__ == '__main__':\n"
                 "    sys.argv[0] = re.sub(r'(-script\\.pyw|\\.exe)?$', '', sys.argv[0])\n"
                 f"    sys.exit({attr}())\n")
    os.chmod(path, 0o755)
    return path


async def main() -> None:
    daemon = DaemonProcess().start()
    scripts: dict[str, str] = {}
    try:
        env = dict(os.environ, HUTCH_URL=daemon.url, HUTCH_TOKEN=daemon.token, COLUMNS="100")
        # Each run finds its modules' bytecode compiled, as an installed hutch
        # has it (pip compiles on install): with PYTHONDONTWRITEBYTECODE the
        # warm-up run could not write it, and every run would compile every
        # module changed since its cache was written (the floors' packages
        # are compiled: the rows would not compare like with like).
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        python = sys.executable
        sources = {"": OURS}
        if os.environ.get("HUTCH_BASELINE_SRC"):
            sources[" (baseline)"] = os.environ["HUTCH_BASELINE_SRC"]
        for tag, src in sources.items():
            scripts[tag] = console_script(src, tempfile.mkdtemp(prefix="hutch-bench-script-"))
        for cpu in (False, True):
            kind = "CPU time" if cpu else "wall time"
            measures = {
                "pass": timed([python, "-c", "pass"], env, cpu),
                "httpx": timed([python, "-c", "import httpx"], env, cpu),
            }
            for tag, src in sources.items():
                ours = with_src(env, src)
                measures["help" + tag] = timed([python, "-m", "hutch.cli.main", "--help"],
                                               ours, cpu)
                measures["script" + tag] = timed([scripts[tag], "--help"], ours, cpu)
                measures["ls" + tag] = timed([python, "-m", "hutch.cli.main", "ls"], ours, cpu)
                measures["client" + tag] = timed([python, "-c", "import hutch.client"], ours,
                                                 cpu)
            samples = sampled(measures)
            got = {name: median_ms(found) for name, found in samples.items()}
            header(f"the hutch command's start, {kind} (a new process each run, {RUNS} runs)")
            for tag in sources:
                row(f"hutch --help{tag} vs python -c pass", got["help" + tag], got["pass"],
                    "goal: <= 100 ms")
                row(f"hutch --help (console script){tag} vs pass", got["script" + tag],
                    got["pass"], "goal: <= 100 ms")
                row(f"hutch ls, empty daemon{tag} vs import httpx", got["ls" + tag],
                    got["httpx"],
                    f"goal: <= 1.5x; {paired_ratio(samples['ls' + tag], samples['httpx'])}")
                row(f"import hutch.client{tag} vs import httpx", got["client" + tag],
                    got["httpx"])
    finally:
        daemon.close()
        for script in scripts.values():
            shutil.rmtree(os.path.dirname(script), ignore_errors=True)


if __name__ == "__main__":
    run(main)
