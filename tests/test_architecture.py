"""The import graph has no cycle (issue 21 cut the last knot). Layer rules
are import-linter contracts in pyproject.toml, run by the test command; this
test is the no-cycle rule they cannot state."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import grimp
import pytest


def _components(graph: grimp.ImportGraph) -> list[set[str]]:
    """Tarjan's strongly connected components of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []
    counter = 0

    def visit(root: str) -> None:
        nonlocal counter
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append(
                        (child, iter(sorted(graph.find_modules_directly_imported_by(child))))
                    )
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    component = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.add(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(component)

    for module in sorted(graph.modules):
        if module not in index:
            visit(module)
    return found


def test_no_import_cycle() -> None:
    graph = grimp.build_graph("hutch", exclude_type_checking_imports=True)
    cycles = [sorted(c) for c in _components(graph)]
    assert cycles == [], "modules that import each other in a circle (docs/architecture.md)"


def test_only_the_cli_imports_the_http_server() -> None:
    """The HTTP server is the top of the house: nothing but the CLI (and the
    server itself) imports it; the daemon's core is :mod:`hutch.daemon`."""
    graph = grimp.build_graph("hutch", exclude_type_checking_imports=True)
    importers = {
        importer
        for module in graph.modules
        if module == "hutch.server" or module.startswith("hutch.server.")
        for importer in graph.find_modules_that_directly_import(module)
    }
    outside = sorted(m for m in importers
                     if not m.startswith(("hutch.server.", "hutch.cli.")) and m not in
                     ("hutch.server", "hutch.cli"))
    assert outside == []


def test_no_import_contract_carries_an_ignore_list() -> None:
    """Issue 21: the contracts hold with no exception left; a wrong-way
    import is fixed where it is, never listed."""
    import tomllib

    with open(os.path.join(os.path.dirname(__file__), "..", "pyproject.toml"), "rb") as file:
        linter = tomllib.load(file)["tool"]["importlinter"]
    excused = {contract["id"]: contract["ignore_imports"]
               for contract in linter["contracts"] if contract.get("ignore_imports")}
    assert excused == {}


#: Issue 21: no module of hutch's source grows past this many lines.
MODULE_LINES = 800


def test_no_module_is_longer_than_its_bound() -> None:
    root = pathlib.Path(__file__).resolve().parent.parent / "src" / "hutch"
    sizes = {str(path.relative_to(root)): len(path.read_text().splitlines())
             for path in root.rglob("*.py")}
    assert "providers/base.py" in sizes  # the walk found the source
    assert {name: n for name, n in sizes.items() if n > MODULE_LINES} == {}


#: What the client and the command must not load: the in-process core and
#: everything under it (issue 21: "light where it should be").
HEAVY = ("hutch.providers", "hutch.lifecycle", "hutch.server", "hutch.daemon", "hutch.store",
         "hutch.core", "hutch.definitions", "hutch.config", "hutch.images", "hutch._sandbox",
         "hutch._snapshots", "hutch._process", "hutch._api")


def loaded_by(code: str) -> list[str]:
    """The modules a fresh interpreter holds after running ``code``."""
    done = subprocess.run(
        [sys.executable, "-c", f"{code}\nimport sys, json\nprint(json.dumps(sorted(sys.modules)))"],
        capture_output=True, text=True, timeout=120, check=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    modules: list[str] = json.loads(done.stdout.splitlines()[-1])
    return modules


def heavy(modules: list[str]) -> list[str]:
    return [m for m in modules if any(m == h or m.startswith(h + ".") for h in HEAVY)]


def test_import_hutch_client_loads_no_provider_lifecycle_or_server() -> None:
    modules = loaded_by("import hutch.client")
    assert "hutch.client" in modules
    assert heavy(modules) == []


def test_import_hutch_client_leaves_the_wire_models_for_the_first_answer() -> None:
    # The client decodes answers through hutch.wire (pydantic), imported by the
    # first answer it decodes: a command that decodes none does not pay for it.
    modules = loaded_by("import hutch.client")
    assert [m for m in modules if m in ("hutch.wire", "pydantic.main")] == []


def test_import_hutch_loads_its_names_on_first_use() -> None:
    modules = loaded_by("import hutch")
    assert [m for m in modules if m.startswith("hutch")] == ["hutch"]
    used = loaded_by("import hutch\nhutch.Client")
    assert "hutch.client" in used and heavy(used) == []


def test_hutch_help_loads_no_cli_library_http_client_provider_or_server() -> None:
    """``hutch --help`` (and ``hutch`` alone) is printed from the command
    table: no click (most of what it cost), no command module, no HTTP client."""
    for argv in (["hutch", "--help"], ["hutch"]):
        modules = loaded_by(
            f"import sys\nsys.argv = {argv!r}\nfrom hutch.cli.main import main\n"
            "try:\n    main()\nexcept SystemExit:\n    pass"
        )
        cli = sorted(m for m in modules if m.startswith("hutch.cli."))
        assert cli == ["hutch.cli._commands", "hutch.cli._help", "hutch.cli.main"], argv
        assert [m for m in modules if m.split(".")[0] in ("click", "typing", "httpx")] == []
        assert heavy(modules) == []


def test_the_groups_help_builds_no_command_and_loads_no_rich() -> None:
    """The click group's own help (``hutch --version`` and every command go
    through the group) lists the commands from the table without importing
    them, and draws its panels without rich (whose import and layout cost more
    than the rest of it) or pydantic (typer's coercion)."""
    modules = loaded_by(
        "from hutch.cli.main import app\n"
        "try:\n    app(['--help'])\nexcept SystemExit:\n    pass"
    )
    cli = sorted(m for m in modules if m.startswith("hutch.cli."))
    assert cli == ["hutch.cli._app", "hutch.cli._commands", "hutch.cli._common",
                   "hutch.cli._help", "hutch.cli.main"]
    assert [m for m in modules if m.split(".")[0] in ("rich", "typer", "pydantic")] == []
    assert heavy(modules) == []
    assert [m for m in modules if m == "httpx" or m.startswith("hutch.client")] == []


def test_a_daemon_s_start_and_first_answer_load_no_client_library_it_does_not_use(
    tmp_path: pathlib.Path,
) -> None:
    """A daemon's start loads every provider (its operator policy reads their
    settings, its reconcile asks each what it holds): the E2B SDK, asyncssh,
    lightkube and httpx2 (about a second of imports between them) wait for
    the first call that talks to E2B, an SSH host or a cluster; httpx (with
    its command line's rich and pygments) for the first forward to another
    daemon of a fleet or to a sandbox's port."""
    modules = loaded_by(
        "import asyncio\n"
        "from hutch.server.app import create_app\n"
        "from hutch.server.settings import ServerSettings\n"
        f"app = create_app(ServerSettings(data_dir={str(tmp_path)!r}, token='t'))\n"
        "sent = []\n"
        "async def receive():\n"
        "    return {'type': 'http.request', 'body': b'', 'more_body': False}\n"
        "async def send(message):\n"
        "    sent.append(message)\n"
        "async def main():\n"
        "    async with app.router.lifespan_context(app):\n"
        "        await app({'type': 'http', 'asgi': {'version': '3.0'}, 'http_version': '1.1',\n"
        "                   'method': 'GET', 'scheme': 'http', 'path': '/v1/sandboxes',\n"
        "                   'raw_path': b'/v1/sandboxes', 'query_string': b'', 'root_path': '',\n"
        "                   'headers': [(b'authorization', b'Bearer t'), (b'host', b'h')],\n"
        "                   'client': ('127.0.0.1', 1), 'server': ('127.0.0.1', 2)},\n"
        "                  receive, send)\n"
        "asyncio.run(main())\n"
        "assert sent[0]['status'] == 200, sent\n"
    )
    for provider in ("e2b.sandbox", "ssh.provider", "kubernetes.sandbox"):
        assert f"hutch.providers.{provider}" in modules
    unused = ("e2b", "connectrpc", "asyncssh", "lightkube", "httpx2", "httpx", "rich", "pygments")
    assert [m for m in modules if m.split(".")[0] in unused] == []


@pytest.mark.parametrize(("provider", "library", "hint"), [
    ("e2b", "e2b", "pip install 'hutch[e2b]'"),
    ("ssh", "asyncssh", "pip install asyncssh"),
    ("kubernetes", "lightkube", "pip install 'hutch[kubernetes]'"),
    ("kubernetes", "httpx2", "pip install 'hutch[kubernetes]'"),
])
def test_a_provider_whose_client_library_is_missing_names_what_to_install(
    provider: str, library: str, hint: str,
) -> None:
    # A module set to None in sys.modules is one Python cannot import.
    done = subprocess.run(
        [sys.executable, "-c",
         f"import sys\nsys.modules[{library!r}] = None\n"
         "from hutch.providers.registry import get_provider\n"
         f"get_provider({provider!r})"],
        capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert done.returncode == 1
    assert f"provider {provider!r} needs a dependency that is missing ({library})" in done.stderr
    assert hint in done.stderr
