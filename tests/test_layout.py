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
                 for p in library_files() if p.name != "cli.py"}  # the CLI hands `jaxkv bench` over by name
    assert {f: names for f, names in offenders.items() if names} == {}
