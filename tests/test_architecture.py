"""The import graph's cycles: none but today's known knot (issue 21), which may
only shrink. Layer rules are import-linter contracts in pyproject.toml, run by
the test command; this test is the no-cycle rule they cannot state."""

from __future__ import annotations

import grimp

#: Modules that import each other in a circle today, by strongly connected
#: component. The redesign removes them; a new cycle, or a module joining
#: one, fails this test.
KNOWN_CYCLES: list[set[str]] = []


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


def test_no_import_cycle_beyond_the_known_knot() -> None:
    graph = grimp.build_graph("hutch", exclude_type_checking_imports=True)
    components = _components(graph)
    new = [sorted(c) for c in components if not any(c <= known for known in KNOWN_CYCLES)]
    assert new == [], "import cycles beyond the known knot (docs/architecture.md)"


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
