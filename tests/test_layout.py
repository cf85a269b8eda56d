"""The package's layering, read from its imports (ast, nothing imported): what may import what."""

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "jaxkv"
ORACLES = {"torch", "transformers"}  # test and benchmark oracles only: the base install never has them


def imports(path: pathlib.Path) -> set[str]:
    """Every module `path` imports, at the top or inside functions (absolute names)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def library_files():
    return [p for p in sorted(PACKAGE.rglob("*.py")) if "bench" not in p.relative_to(PACKAGE).parts]


def test_only_the_benchmarks_import_torch_or_transformers():
    offenders = {str(p.relative_to(PACKAGE)): sorted(n for n in imports(p) if n.split(".")[0] in ORACLES)
                 for p in library_files()}
    assert {f: names for f, names in offenders.items() if names} == {}
    # the check sees the benchmarks' own imports (inside functions), so it can fail
    assert "torch" in imports(PACKAGE / "bench" / "decode.py")


def test_the_library_never_imports_the_benchmarks():
    offenders = {str(p.relative_to(PACKAGE)): sorted(n for n in imports(p) if n.startswith("jaxkv.bench"))
                 for p in library_files() if p.relative_to(PACKAGE).as_posix() != "cli/bench.py"}  # `jaxkv bench`, by name
    assert {f: names for f, names in offenders.items() if names} == {}


def module_graph() -> dict[str, set[str]]:
    """jaxkv module -> the jaxkv modules it imports (top level or inside functions). `from package import name`
    is an edge to the submodule when `name` is one, else to the package."""
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {name: set() for name in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                           for a in node.names]
            else:
                continue
            graph[name].update(t for t in targets if t in modules and t != name)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle_in_the_package():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]  # the check itself
    graph = module_graph()
    assert "jaxkv.memory" in graph["jaxkv.cache"]  # it sees the package's real imports
    assert cycles(graph) == []
