"""The dependency rules of DESIGN.md as data, and the import graph of a checkout read with ``ast``.

Each top-level folder is a part; a part may import only the parts its row names. Every import
counts — at module top, inside a function (lazy), under ``TYPE_CHECKING`` — since each is a
dependency a reader has to hold in mind. Used by ``tests/test_layering.py`` (no back edge may
exist) and by ``bench/architecture.py`` (the figures of the architecture issue, on any checkout).
"""

from __future__ import annotations

import ast
import functools
from dataclasses import dataclass
from pathlib import Path

#: Top-level folder -> the ``kvstore.<part>`` import name it provides.
PARTS = {
    "config": "kvstore.config",
    "formats": "kvstore.formats",
    "migrations": "kvstore.migrations",
    "kvstore": "kvstore",
    "gpu": "kvstore.gpu",
    "engine": "kvstore.engine",
    "api": "kvstore.api",
    "connectors": "kvstore.connectors",
    "cli": "kvstore.cli",
}

#: Part -> the parts it may import (itself included). `config` (the environment variables and shared
#: defaults) is at the bottom: every part may import it, it imports none. `connectors` (the vLLM and
#: SGLang adapters) sit on the store beside the engine, using a device kernel of `gpu` (the saves'
#: gather across layers): nothing in kvstore imports them. `cli` is
#: the top: it starts the service and the engine, so it may import everything.
ALLOWED = {
    "config": {"config"},
    "formats": {"config", "formats"},
    "migrations": {"config", "formats", "migrations"},
    "kvstore": {"config", "formats", "migrations", "kvstore"},
    "gpu": {"config", "formats", "gpu"},
    "engine": {"config", "formats", "migrations", "kvstore", "gpu", "engine"},
    "connectors": {"config", "formats", "migrations", "kvstore", "gpu", "connectors"},
    "api": {"config", "formats", "migrations", "kvstore", "gpu", "engine", "api"},
    "cli": set(PARTS),
}

#: Third-party packages a part may import beyond the standard library and the parts above.
THIRD_PARTY = {
    "config": set(),
    "formats": {"numpy"},
    "migrations": {"numpy", "lmdb"},
    "gpu": {"numpy", "torch", "cupy", "triton"},
}

#: Files that belong to another part than their folder: `python -m kvstore` is the command line's
#: entry point (it only calls `kvstore.cli.main`), though it must live in the `kvstore` folder.
ENTRY_POINTS = {"kvstore/__main__.py": "cli"}

# `kvstore.tiers` is the formats tier table under its project-wide name: importing it is
# importing formats (kvstore/tiers.py holds nothing else).
ALIASES = {"kvstore.tiers": "formats"}


@dataclass(frozen=True)
class Edge:
    source: str  # file, relative to the checkout
    line: int
    module: str  # the imported module
    part: str  # the part it belongs to ('' for a third-party module)

    def __str__(self) -> str:
        return f"{self.source}:{self.line} imports {self.module}"


def part_of_module(module: str) -> str:
    """The part an absolute ``kvstore...`` module name belongs to ('' when it is not kvstore's)."""
    if module != "kvstore" and not module.startswith("kvstore."):
        return ""
    for alias, part in ALIASES.items():
        if module == alias or module.startswith(alias + "."):
            return part
    best = "kvstore"
    for part, name in PARTS.items():
        if part != "kvstore" and (module == name or module.startswith(name + ".")):
            best = part
    return best


def _python_files(root: Path, part: str) -> list[Path]:
    folder = root / part
    return sorted(p for p in folder.rglob("*.py") if "__pycache__" not in p.parts) if folder.is_dir() else []


def _package_of(root: Path, path: Path) -> str:
    """The dotted package a file lives in, under the installed names (for relative imports)."""
    rel = path.relative_to(root).parent.parts
    head = PARTS[rel[0]]
    return ".".join([head, *rel[1:]])


def imports(root: Path) -> list[Edge]:
    """Every import in the parts' files: (file, line, absolute module, part of that module)."""
    return list(_imports(Path(root).resolve()))


@functools.lru_cache(maxsize=4)
def _imports(root: Path) -> tuple[Edge, ...]:
    edges = []
    for part in PARTS:
        for path in _python_files(root, part):
            tree = ast.parse(path.read_text(), filename=str(path))
            source = str(path.relative_to(root))
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom):
                    if node.level:
                        base = _package_of(root, path).split(".")
                        base = base[: len(base) - node.level + 1]
                        module = ".".join(base + ([node.module] if node.module else []))
                    else:
                        module = node.module or ""
                    # `from kvstore import tiers` names a submodule: judge the submodule
                    names = [f"{module}.{a.name}" if module == "kvstore" else module for a in node.names]
                else:
                    continue
                for name in names:
                    part = part_of_module(name)
                    if part and not (root / part).is_dir():  # an older tree: the package lived in kvstore/
                        part = "kvstore"
                    edges.append(Edge(source, node.lineno, name, part))
    return tuple(edges)


def part_of_file(source: str) -> str:
    """The part a file (relative to the checkout) belongs to: its folder, or its ENTRY_POINTS entry."""
    return ENTRY_POINTS.get(source, Path(source).parts[0])


def back_edges(root: Path) -> list[Edge]:
    """Imports of a part the importing file's part may not use."""
    out = []
    for edge in imports(root):
        source_part = part_of_file(edge.source)
        if edge.part and edge.part not in ALLOWED[source_part]:
            out.append(edge)
    return out


def third_party_violations(root: Path, stdlib: frozenset[str]) -> list[Edge]:
    """Imports of third-party packages a restricted part may not use (``THIRD_PARTY``)."""
    out = []
    for edge in imports(root):
        source_part = part_of_file(edge.source)
        allowed = THIRD_PARTY.get(source_part)
        top = edge.module.split(".")[0]
        if allowed is None or edge.part or top in stdlib or top == "__future__":
            continue
        if top not in allowed:
            out.append(edge)
    return out
