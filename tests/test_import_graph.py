"""No import circle among the modules of the four packages: a module's imports of meshy modules, read with
`ast` (module-level and inside functions; not those under `if TYPE_CHECKING:`), form a graph with no cycle.

Importing `meshy.a.b` runs the package `meshy.a`'s __init__ first, so an import edge leads to the module
and to each package above it that the importer is not itself inside (those are being imported already);
`from meshy.a import name` leads to meshy.a's __init__, and through it to whatever that __init__ imports
(a package that re-exports counts as importing what it re-exports); a name the __init__ exports lazily
(PEP 562: `_EXPORTS`, module -> names, as meshy.dataplane's) leads to the module that holds it."""

import ast
from collections.abc import Iterator
from pathlib import Path

PACKAGES = Path(__file__).resolve().parents[1] / "packages"


def module_files() -> dict[str, Path]:
    """Every module of the packages by dotted name (a package by its own name, for its __init__)."""
    modules = {}
    for path in PACKAGES.glob("*/src/meshy/**/*.py"):
        parts = path.relative_to(PACKAGES).with_suffix("").parts[2:]  # after <package>/src/
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(node: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """The import statements under `node`, at any depth, leaving out `if TYPE_CHECKING:` bodies."""
    for child in ast.iter_child_nodes(node):
        kept = child.orelse if isinstance(child, ast.If) and _is_type_checking(child) else [child]
        for statement in kept:
            if isinstance(statement, ast.Import | ast.ImportFrom):
                yield statement
            else:
                yield from _imports(statement)


def lazy_exports(tree: ast.Module) -> dict[str, str]:
    """name -> module for the names a package's __init__ imports on first use (its `_EXPORTS` table)."""
    for statement in tree.body:
        if (
            isinstance(statement, ast.Assign)
            and [getattr(t, "id", None) for t in statement.targets] == ["_EXPORTS"]
            and isinstance(statement.value, ast.Dict)
        ):
            table = ast.literal_eval(statement.value)
            return {exported: module for module, names in table.items() for exported in names}
    return {}


def _imported_names(
    name: str, path: Path, statement: ast.Import | ast.ImportFrom, lazy: dict[str, dict[str, str]]
) -> list[str]:
    """The dotted names a statement imports: `meshy.a.b` for `import meshy.a.b`; for `from meshy.a import b`,
    meshy.a and meshy.a.b (which counts where it is a module), or the module meshy.a exports b from lazily."""
    if isinstance(statement, ast.Import):
        return [alias.name for alias in statement.names]
    base = statement.module or ""
    if statement.level:
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        anchor = package[: len(package) - statement.level + 1]
        base = ".".join(anchor + ([base] if base else []))
    exported = lazy.get(base, {})
    return [base] + [exported.get(alias.name, f"{base}.{alias.name}") for alias in statement.names]


def import_graph() -> dict[str, set[str]]:
    """module -> the meshy modules importing it runs."""
    modules = module_files()
    trees = {name: ast.parse(path.read_text(encoding="utf-8"), filename=str(path)) for name, path in modules.items()}
    lazy = {name: lazy_exports(tree) for name, tree in trees.items() if modules[name].name == "__init__.py"}
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        tree = trees[name]
        inside = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 2)}  # itself and its packages
        for statement in _imports(tree):
            for target in _imported_names(name, path, statement, lazy):
                parts = target.split(".")
                for i in range(2, len(parts) + 1):
                    step = ".".join(parts[:i])
                    if step in modules and step not in inside:
                        graph[name].add(step)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph, as the modules along it (the first one again at the end), or None."""
    state: dict[str, str] = {}  # "open": on the path being walked; "done": every path from it walked
    for start in sorted(graph):
        if start in state:
            continue
        path, branches = [start], [iter(sorted(graph[start]))]
        state[start] = "open"
        while branches:
            step = next(branches[-1], None)
            if step is None:
                branches.pop()
                state[path.pop()] = "done"
            elif state.get(step) == "open":
                return [*path[path.index(step) :], step]
            elif step not in state:
                path.append(step)
                branches.append(iter(sorted(graph[step])))
                state[step] = "open"
    return None


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Cycles of the graph until none is left, each found with the last edge of the ones before it cut."""
    graph = {name: set(targets) for name, targets in graph.items()}
    found = []
    while (cycle := find_cycle(graph)) is not None:
        found.append(cycle)
        graph[cycle[-2]].discard(cycle[-1])
    return found


def test_the_import_graph_is_read():
    graph = import_graph()
    assert len(graph) > 100, "the packages' modules were found"
    assert "meshy.recipes.recipe.spec" in graph["meshy.recipes.recipe"], "an __init__ imports what it re-exports"
    assert "meshy.dataplane.errors" in graph["meshy.recipes.recipe.dataflow"], "SchemaError, exported lazily"


def test_no_module_imports_itself_through_others():
    found = cycles(import_graph())
    assert not found, "import cycles among the meshy modules:\n" + "\n".join(" -> ".join(c) for c in found)


# The packages' layers: each imports only the packages below it.
BELOW = {
    "meshy.dataplane": set(),
    "meshy.train": {"meshy.dataplane"},
    "meshy.infer": {"meshy.dataplane"},
    "meshy.recipes": {"meshy.dataplane", "meshy.train", "meshy.infer"},
}


def test_each_package_imports_only_the_packages_below_it():
    def package(module: str) -> str:
        return ".".join(module.split(".")[:2])

    upward = sorted(
        (module, target)
        for module, targets in import_graph().items()
        for target in targets
        if package(target) != package(module) and package(target) not in BELOW[package(module)]
    )
    assert upward == []


def test_a_cycle_is_found_and_named():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set()}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_imports_inside_functions_count_and_type_checking_ones_do_not():
    tree = ast.parse(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    import meshy.a\nelse:\n    import meshy.b\n"
        "def f():\n    from meshy.c import d\n"
    )
    assert [ast.unparse(s) for s in _imports(tree)] == [
        "from typing import TYPE_CHECKING",
        "import meshy.b",
        "from meshy.c import d",
    ]
