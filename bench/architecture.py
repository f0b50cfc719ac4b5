"""The architecture figures, on any checkout: what the type gate sees, who reads the environment,
where behaviour branches on tier names, what is written twice, how long the data paths walk, and
the older counts (largest files, tier constants, vocabulary tables, import back edges).

    python bench/architecture.py [--root DIR] [-v] [--no-gate] [--no-walks]

To compare with an older commit: ``git worktree add /tmp/before <rev>`` and run this script with
``--root /tmp/before`` (the script and the checks it imports are read from *this* checkout; the
gate figure runs the root's own ``.ci/typecheck`` and, beside it, this checkout's gate on a copy of
the root's parts, so both trees are judged by one rule).

Definitions:
- *gate*: errors the root's own type gate reports, and files it analyzes; *every part*: errors and
  files when every part of the root is copied and checked (``.ci/typecheck --root``).
- *environment readers*: ``os.environ``/``os.getenv`` in the parts outside ``config/``
  (``tests/test_config.py``).
- *tier branch chains*: if/elif chains of 3+ branches choosing behaviour by tier
  (``tests/tier_branches.py``).
- *duplicated blocks*: runs of 6+ normalized lines (stripped; blank, comment, import and
  lone-punctuation lines skipped) that stand in two places or more in the parts' code, counted as
  maximal runs per place, and the lines they cover.
- *walks*: following the session id through the store's migrate, append and resume
  (``bench/walks.py``): places, modules entered, re-entries into a module already left.
- A *definition* of a constant is a numeric literal of that value in the code (docstrings and
  comments do not count); a *vocabulary table* is a tuple/list/set/dict literal holding two or
  more tier spellings.
"""

from __future__ import annotations

import argparse
import ast
import collections
import json
import re
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(HERE / "tests"))
sys.path.insert(0, str(HERE / "bench"))
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
WINDOW = 6


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


# ---------------------------------------------------------------------------- duplicated blocks
_SKIP = re.compile(r"^(#.*|import .*|from \S+ import .*|[\[\](){}:,]+|\"\"\"|''')?$")


def duplicated_blocks(root: Path) -> tuple[int, int, list[tuple[int, str, str]]]:
    """(blocks, duplicated lines, the largest blocks as (lines, place, other place))."""
    lines_of: dict[str, list[tuple[int, str]]] = {}
    for path in source_files(root):
        kept = []
        for number, line in enumerate(path.read_text().splitlines(), 1):
            text = " ".join(line.split())
            if not _SKIP.match(text):
                kept.append((number, text))
        lines_of[str(path.relative_to(root))] = kept
    where: dict[tuple[str, ...], list[tuple[str, int]]] = collections.defaultdict(list)
    for name, kept in lines_of.items():
        for i in range(len(kept) - WINDOW + 1):
            where[tuple(text for _, text in kept[i : i + WINDOW])].append((name, i))
    shared = {(name, i) for places in where.values() if len(places) > 1 for name, i in places}
    blocks, covered, largest = 0, 0, []
    for name, kept in lines_of.items():
        i = 0
        while i < len(kept) - WINDOW + 1:
            if (name, i) not in shared:
                i += 1
                continue
            start = i
            while (name, i + 1) in shared:
                i += 1
            span = kept[start][0], kept[i + WINDOW - 1][0]
            n_lines = i + WINDOW - start
            places = where[tuple(text for _, text in kept[start : start + WINDOW])]
            other = next(f"{n}:{lines_of[n][j][0]}" for n, j in places if (n, j) != (name, start))
            blocks += 1
            covered += n_lines
            largest.append((n_lines, f"{name}:{span[0]}-{span[1]}", other))
            i += 1
    return blocks, covered, sorted(largest, reverse=True)[:12]


# ---------------------------------------------------------------------------- the other checks
def gate(root: Path) -> dict:
    """The root's own gate (its ``.ci/typecheck``) and this checkout's gate on a copy of its parts."""
    out: dict = {}
    script = root / ".ci" / "typecheck"
    pyright = str(HERE / ".venv" / "bin" / "pyright")
    if script.exists():
        own = subprocess.run(
            [str(script), "--json"]
            if script.read_text().startswith("#!/usr/bin/env python")
            else [str(script), "--outputjson"],
            capture_output=True,
            text=True,
            cwd=root,
            env={"PYRIGHT": pyright, "PATH": "/usr/bin:/bin"},
        )
        report = json.loads(own.stdout)
        if "summary" in report:  # pyright's own JSON (a gate that only forwards its arguments)
            out["own"] = (report["summary"]["errorCount"], report["summary"]["filesAnalyzed"])
        else:
            out["own"] = (len(report["errors"]), report["files"])
    every = subprocess.run(
        [sys.executable, str(HERE / ".ci" / "typecheck"), "--root", str(root), "--json"],
        capture_output=True,
        text=True,
        env={"PYRIGHT": pyright, "PATH": "/usr/bin:/bin"},
    )
    report = json.loads(every.stdout)
    per_part = collections.Counter(e["file"].split("/")[0] for e in report["errors"])
    out["every"] = (len(report["errors"]), report["files"], dict(per_part))
    return out


def optional(module: str, function: str):
    try:
        return getattr(__import__(module), function)
    except (ImportError, AttributeError):
        return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", default=str(HERE))
    parser.add_argument("-v", "--verbose", action="store_true", help="list every place")
    parser.add_argument("--no-gate", action="store_true", help="skip the type gate (~40 s)")
    parser.add_argument("--no-walks", action="store_true", help="skip the traced walks (~10 s)")
    args = parser.parse_args()
    root = Path(args.root).resolve()
    found = measure(root)
    print(f"checkout: {root}")
    if not args.no_gate:
        checked = gate(root)
        if "own" in checked:
            print(f"type gate (its own .ci/typecheck): {checked['own'][0]} errors in {checked['own'][1]} files")
        errors, files, per_part = checked["every"]
        parts = ", ".join(f"{part} {n}" for part, n in sorted(per_part.items()))
        print(f"type errors with every part checked: {errors} in {files} files" + (f" ({parts})" if parts else ""))
    readers = optional("test_config", "environment_readers")
    if readers is not None:
        places = readers(root)
        print(
            f"environment readers outside config/: {len(places)}" + (f"  [{', '.join(places)}]" if args.verbose else "")
        )
    chains = optional("tier_branches", "tier_branch_chains")
    if chains is not None:
        places = chains(root)
        print(f"tier branch chains: {len(places)}" + (f"  [{', '.join(places)}]" if args.verbose else ""))
    blocks, covered, largest = duplicated_blocks(root)
    print(f"duplicated blocks ({WINDOW}+ lines, parts' code): {blocks}, {covered} lines")
    for n_lines, place, other in largest[: 12 if args.verbose else 5]:
        print(f"  {n_lines:4d}  {place} ~ {other}")
    walks = optional("walks", "measure_walks")
    if walks is not None and not args.no_walks:
        for path, figures in walks(root).items():
            print(
                f"walk of {path}: {figures['places']} places, {figures['modules']} modules entered, "
                f"{figures['reentries']} re-entries"
            )
    print("largest files (lines):")
    for lines, name in found["sizes"][:5]:
        print(f"  {lines:6d}  {name}")
    print(f"files over 700 lines: {sum(lines > 700 for lines, _ in found['sizes'])}")
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
