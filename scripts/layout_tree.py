"""Print the jaxkv package tree, one line per file, each with its module docstring's first line.

    python scripts/layout_tree.py                      # print the tree
    python scripts/layout_tree.py --update BUILD_NOTES.md

With --update, the fenced block under the file's "## Layout" heading is replaced by the tree, so the index stays
current after files move (rerun it after every move). Reads the files with `ast`; imports nothing of jaxkv.
"""

from __future__ import annotations

import argparse
import ast
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "jaxkv"


def first_line(path: pathlib.Path) -> str:
    try:
        doc = ast.get_docstring(ast.parse(path.read_text(), str(path)))
    except SyntaxError as error:  # a file being edited: say so rather than stop the whole tree
        return f"(does not parse: {error.msg}, line {error.lineno})"
    return doc.strip().splitlines()[0].strip() if doc and doc.strip() else "(no docstring)"


def tree_lines(folder: pathlib.Path = PACKAGE, depth: int = 0) -> list[tuple[str, str]]:
    """(indented name, description) rows: a folder's files first (``__init__.py`` leading), then its sub-packages."""
    indent = "  " * depth
    rows = [(f"{indent}{folder.name}/", "")]
    files = sorted((p for p in folder.glob("*.py")), key=lambda p: (p.name != "__init__.py", p.name))
    rows += [(f"{indent}  {p.name}", first_line(p)) for p in files]
    for sub in sorted(p for p in folder.iterdir() if p.is_dir() and any(p.rglob("*.py"))):
        if sub.name != "__pycache__":
            rows += tree_lines(sub, depth + 1)
    return rows


def render() -> str:
    rows = tree_lines()
    width = max(len(name) for name, _ in rows) + 2
    return "\n".join(f"{name:<{width}}{text}".rstrip() for name, text in rows)


def update(path: pathlib.Path, tree: str) -> None:
    """Replace the first fenced block after the "## Layout" heading with `tree`."""
    lines = path.read_text().splitlines()
    try:
        head = next(i for i, line in enumerate(lines) if line.strip() == "## Layout")
        start = next(i for i in range(head + 1, len(lines)) if lines[i].startswith("```"))
        end = next(i for i in range(start + 1, len(lines)) if lines[i].startswith("```"))
    except StopIteration:
        raise SystemExit(f"{path}: no fenced block under a '## Layout' heading")
    lines[start + 1:end] = tree.splitlines()
    path.write_text("\n".join(lines) + "\n")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--update", metavar="MARKDOWN", type=pathlib.Path,
                        help="rewrite the fenced block under this file's '## Layout' heading")
    args = parser.parse_args(argv)
    tree = render()
    if args.update:
        update(args.update, tree)
    else:
        print(tree)
    return 0


if __name__ == "__main__":
    sys.exit(main())
