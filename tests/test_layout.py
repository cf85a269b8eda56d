"""The package's layering, read from its imports (ast, nothing imported): what may import what. Then the old
module paths kept for users, which are imported."""

import ast
import importlib
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
    assert "jaxkv.cache.geometry" in graph["jaxkv.cache.contiguous"]  # it sees the package's real imports
    assert cycles(graph) == []

# old path -> the module it now is, kept (a sys.modules alias) for users and ../shared/repros
import jaxkv  # noqa: E402 (only its table of moved modules: no JAX is imported)

OLD_PATHS = dict(jaxkv._OLD_MODULES)  # old module path -> the module it is now


def is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def dotted_module(node, bound: dict[str, str]) -> str | None:
    """The jaxkv module an expression such as `memory` or `jaxkv.cache.planner` names, given the local names the
    file's imports bound to jaxkv modules; None for anything else."""
    if isinstance(node, ast.Name):
        return bound.get(node.id)
    if isinstance(node, ast.Attribute):
        base = dotted_module(node.value, bound)
        return None if base is None else f"{base}.{node.attr}"
    return None


def private_uses(source: str, own: str, modules: set[str]) -> set[str]:
    """The other jaxkv modules' private names module `own` (its `source`) uses: `from jaxkv.x import _y`, and `m._y` where `m` is a jaxkv
    module the file imported (`from jaxkv import m`, `import jaxkv.m as m`, `import jaxkv` then `jaxkv.m._y`).
    Dunders (`__version__`) are not private, and a module's own names are its own. A module kept at an old path
    (`sys.modules[__name__] = module`) imports the module, not a private name: it is no offender, and a use through
    an old path is named by the module it now is."""
    tree = ast.parse(source)
    bound, found = {}, set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "jaxkv":
            for alias in node.names:
                name = f"{node.module}.{alias.name}"
                if name in modules:
                    bound[alias.asname or alias.name] = name
                elif is_private(alias.name) and node.module != own:
                    found.add(f"{OLD_PATHS.get(node.module, node.module)}.{alias.name}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "jaxkv":
                    # `import jaxkv.x` binds jaxkv; `import jaxkv.x as m` binds m to jaxkv.x
                    bound[alias.asname or "jaxkv"] = alias.name if alias.asname else "jaxkv"
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and is_private(node.attr):
            module = dotted_module(node.value, bound)
            if module in modules and module != own:
                found.add(f"{OLD_PATHS.get(module, module)}.{node.attr}")
    return found


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_no_module_uses_another_modules_private_names():
    modules = set(module_graph()) | set(OLD_PATHS)  # an old path names its new module
    # the check itself: each form it must catch, and what it must not (dunders, an alias module's `_module`)
    sample = ("import jaxkv\nimport jaxkv.generate as g\nfrom jaxkv import memory\n"
              "from jaxkv.generate import _forward, __doc__\nfrom jaxkv.cache import planner as _module\n"
              "memory._next_pow2(1), g._key, jaxkv.memory._cache_dtype, _module.plan_cache, memory.__name__\n")
    assert private_uses(sample, "jaxkv.sample", modules) == {
        "jaxkv.generate._forward", "jaxkv.cache.planner._next_pow2", "jaxkv.generate._key",
        "jaxkv.cache.planner._cache_dtype"}
    uses = {str(p.relative_to(PACKAGE)): sorted(private_uses(p.read_text(), module_name(p), modules))
            for p in sorted(PACKAGE.rglob("*.py"))}
    assert {f: names for f, names in uses.items() if names} == {}


def test_old_module_paths_are_the_new_modules_private_names_included():
    for old, new in OLD_PATHS.items():
        assert importlib.import_module(old) is importlib.import_module(new), old
    from jaxkv.cache.prefix import _block_keys as block_keys
    from jaxkv.prefix_cache import _block_keys  # as the repros import it

    assert _block_keys is block_keys
    import jaxkv

    assert jaxkv.memory.plan_cache is jaxkv.plan_cache and jaxkv.cache.KVCache is jaxkv.KVCache


# --- the tests' own layout (issue 28, item 7) ---------------------------------------------------------------------

TESTS = pathlib.Path(__file__).resolve().parent


def imported_test_files(source: str) -> set[str]:
    """The modules a test-suite file (`source`) imports that are test files: any dotted name with a component
    starting with "test_" (`test_x`, `cache.test_x`, `from . import test_x`) or named `conftest`. Shared code is
    imported from `helpers`; pytest loads conftest itself."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or ""] + [f"{node.module or ''}.{alias.name}" for alias in node.names]
        else:
            continue
        found.update(n.strip(".") for n in names
                     if any(part.startswith("test_") or part == "conftest" for part in n.split(".")))
    return found


def test_no_test_file_imports_another_test_file():
    # the check itself: each form it must catch, and what it must not
    sample = ("import test_cache\nfrom test_hf_parity import build_hf\nfrom conftest import CONFIGS\n"
              "from tests.cache import test_paged\nfrom . import test_x\nfrom helpers.hf import build_hf\n"
              "import jaxkv\nfrom jaxkv.cache import contiguous\n"
              "def f():\n    from test_compiles import count_compiles\n")
    assert imported_test_files(sample) == {"test_cache", "test_hf_parity", "test_hf_parity.build_hf", "conftest",
                                         "conftest.CONFIGS", "tests.cache.test_paged", "test_x",
                                         "test_compiles", "test_compiles.count_compiles"}
    files = sorted(TESTS.rglob("*.py"))
    assert TESTS / "families" / "test_hf_parity.py" in files and TESTS / "helpers" / "hf.py" in files  # it sees them
    offenders = {str(p.relative_to(TESTS)): sorted(imported_test_files(p.read_text())) for p in files}
    assert {f: names for f, names in offenders.items() if names} == {}


def package_dirs(root: pathlib.Path) -> set[str]:
    """The sub-packages of `root` (folders holding an __init__.py), by name."""
    return {p.parent.name for p in root.glob("*/__init__.py")}


def missing_test_folders(package: pathlib.Path, tests: pathlib.Path) -> list[str]:
    """The sub-packages of `package` with no `tests/<name>/` folder holding a test file."""
    return sorted(name for name in package_dirs(package) if not list((tests / name).glob("test_*.py")))


def test_each_package_of_jaxkv_has_a_test_folder(tmp_path):
    # the check itself, on a sample: a package with a test folder, one with an empty folder, one with none
    for name in ("a", "b", "c"):
        (tmp_path / "pkg" / name).mkdir(parents=True)
        (tmp_path / "pkg" / name / "__init__.py").write_text("")
    (tmp_path / "tests" / "a").mkdir(parents=True)
    (tmp_path / "tests" / "a" / "test_x.py").write_text("")
    (tmp_path / "tests" / "b").mkdir()
    assert missing_test_folders(tmp_path / "pkg", tmp_path / "tests") == ["b", "c"]
    assert package_dirs(PACKAGE) >= {"cache", "attention", "layers", "families", "io", "decoding", "engine",
                                     "server", "cli", "bench"}  # it sees the package's folders
    assert missing_test_folders(PACKAGE, TESTS) == []


# Layers, top down: a module may import its own layer and the ones below, never one above. The core (caches,
# attention, layers, the model, families and io, decoding, sharding and the base modules) sits below everything in
# this table; "decoding" is the shared step the entry points, the engine and the server are built on.
UPPER = {"generate": 1, "beam_search": 1, "score": 1, "engine": 1, "server": 2, "bench": 3, "cli": 4}


def layer_violations(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    def rank(module: str) -> int:
        parts = module.split(".")
        return UPPER.get(parts[1], 0) if len(parts) > 1 else 0

    return sorted((a, b) for a, targets in graph.items() for b in targets
                  if rank(b) > rank(a) or (rank(b) == rank(a) == 1 and a.split(".")[1] != b.split(".")[1]))


def test_imports_point_down():
    # the check itself: the cache importing the engine, or generate importing the engine, is refused
    assert layer_violations({"jaxkv.cache.paged": {"jaxkv.engine.programs"},
                             "jaxkv.generate": {"jaxkv.engine", "jaxkv.decoding.step"},
                             "jaxkv.server.app": {"jaxkv.engine"}}) == [
        ("jaxkv.cache.paged", "jaxkv.engine.programs"), ("jaxkv.generate", "jaxkv.engine")]
    assert layer_violations(module_graph()) == []
