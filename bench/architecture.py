"""The architecture figures of issue 14, on any checkout: largest files, definitions of the
tier-related constants, tier-vocabulary tables, import back edges.

    python bench/architecture.py [--root DIR]       # default: this checkout

To compare with an older commit: ``git worktree add /tmp/before <rev>`` and run it with
``--root /tmp/before`` (this script and tests/layering.py are read from *this* checkout).

A "definition" of a constant is a numeric literal of that value in the code (docstrings and
comments do not count): every such literal is a place that must change together with the others.
A "vocabulary table" is a tuple/list/set/dict literal holding two or more tier spellings.
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from layering import PARTS, back_edges  # noqa: E402

CONSTANTS = {
    "TQ seed 0x9E3779B9": lambda v: v == 0x9E3779B9,
    "int4 level 2.733": lambda v: isinstance(v, float) and abs(abs(v) - 2.733) < 1e-9,
    "fp8 max 448": lambda v: v in (448, 448.0) and not isinstance(v, bool),  # written 448 (not 0o700)
    "scale/radius ceiling 3.4e38": lambda v: isinstance(v, float) and abs(v - 3.4e38) < 1e30,
    "amax/radius floor 1e-35": lambda v: isinstance(v, float) and abs(v - 1e-35) < 1e-40,
}
SPELLINGS = (
    {"f32", "bf16", "fp8", "int4", "int8", "q8", "tq-int4", "tq-polar", "polar", "v1", "v2", "v3", "tq"}
    | {f"polar{b}" for b in range(2, 7)}
    | {f"polar-{b}" for b in range(2, 7)}
)


def source_files(root: Path) -> list[Path]:
    return sorted(p for part in PARTS for p in (root / part).rglob("*.py") if "__pycache__" not in p.parts)


def _docstring_nodes(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                ids.add(id(first.value))
    return ids


def measure(root: Path) -> dict:
    files = source_files(root)
    sizes = sorted(((len(p.read_text().splitlines()), str(p.relative_to(root))) for p in files), reverse=True)
    constants: dict[str, list[str]] = {name: [] for name in CONSTANTS}
    tables: list[str] = []
    for path in files:
        text = path.read_text()
        tree = ast.parse(text)
        skip = _docstring_nodes(tree)
        where = str(path.relative_to(root))
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and id(node) not in skip and isinstance(node.value, (int, float)):
                written = ast.get_source_segment(text, node) or ""
                for name, match in CONSTANTS.items():
                    if match(node.value) and written[:1].isdigit() and not written.startswith("0o"):
                        constants[name].append(f"{where}:{node.lineno}")
            if isinstance(node, (ast.Tuple, ast.List, ast.Set, ast.Dict)):
                elements = node.keys if isinstance(node, ast.Dict) else node.elts
                words = [e.value for e in elements if isinstance(e, ast.Constant) and isinstance(e.value, str)]
                if sum(w in SPELLINGS for w in words) >= 2:
                    tables.append(f"{where}:{node.lineno}")
    edges = sorted(set(back_edges(root)), key=lambda e: (e.source, e.line, e.module))
    return {"sizes": sizes, "constants": constants, "tables": sorted(set(tables)), "back_edges": edges}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", default=str(Path(__file__).resolve().parent.parent))
    parser.add_argument("-v", "--verbose", action="store_true", help="list every place")
    args = parser.parse_args()
    root = Path(args.root).resolve()
    found = measure(root)
    print(f"checkout: {root}")
    print("largest files (lines):")
    for lines, name in found["sizes"][:5]:
        print(f"  {lines:6d}  {name}")
    print(f"files over 500 lines: {sum(lines > 500 for lines, _ in found['sizes'])}")
    print("definitions of tier constants (numeric literals in code):")
    for name, places in found["constants"].items():
        print(f"  {len(places):3d}  {name}" + (f"  [{', '.join(places)}]" if args.verbose else ""))
    print(f"tier-vocabulary tables (literals with 2+ tier spellings): {len(found['tables'])}")
    if args.verbose:
        for place in found["tables"]:
            print(f"       {place}")
    print(f"import back edges: {len(found['back_edges'])}")
    for edge in found["back_edges"]:
        print(f"       {edge}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
