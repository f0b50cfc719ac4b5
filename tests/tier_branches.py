"""Branch chains over *which tier*, found with ``ast``: a tier's behaviour belongs to its codec.

A tier's sizes, codes, scale bound and stored bytes live on its codec object (``kvstore.formats``:
one frozen class per family, registered once); callers ask the tier, or look its torch twin up by
family. An ``if``/``elif`` chain that picks behaviour by comparing a tier against tier names is the
pattern that replaced: every such chain has to be edited when a tier is added. Used by
``tests/formats/test_tier_branches.py`` (the tree has none) and runnable on any checkout.

What counts as a chain (one per place, reported as ``file:line`` of its first test):

- an ``if``/``elif``/``else`` statement, and a run of consecutive ``if`` statements whose bodies
  all leave the block (``return``/``raise``/``continue``/``break``) followed by the fall-through
  code — the early-return spelling of the same chain;
- a conditional expression nested in its ``else`` (``a if t is F32 else b if t is FP8 else c``);
- a ``match`` statement over tier values.

with 3 or more branches, 2 or more of whose tests compare against the tier vocabulary: a tier name
(``"fp8"``, ``"polar3"``, the old ``"tq-int4"``, ...), a tier constant (``tiers.FP8``, ``INT4``, also
as ``tiers.FP8.name``), or a ``version``/``codec`` attribute or variable compared with a file
version or TQ codec id (``header.version == 2``, ``codec == CODEC_INT4``).

Skipped: :data:`REGISTRY_MODULES`, where the vocabulary is defined (``formats/codecs.py``, the
codec registry keyed by tier name).
"""

from __future__ import annotations

import ast
from pathlib import Path

from layering import PARTS

#: Files (relative to the checkout) that define the vocabulary itself and are not counted.
REGISTRY_MODULES = frozenset({"formats/codecs.py"})

#: Tier names as strings: the canonical ones and the old spellings ``kvstore.tiers.resolve`` reads.
TIER_NAMES = frozenset(
    {"f32", "bf16", "fp8", "int4", "q8", "polar", *(f"polar{bits}" for bits in range(2, 7))}
    | {"tq", "tq-int4", "tq-polar", "int8", "v1", "v2", "v3"}
)
#: The tier constants of ``kvstore.tiers``.
TIER_CONSTANTS = frozenset({"F32", "BF16", "FP8", "INT4", "Q8"})
#: The TQ codec ids of ``kvstore.formats.tq``.
CODEC_CONSTANTS = frozenset({"CODEC_INT4", "CODEC_POLAR"})
#: Names that hold a file version or a TQ codec id when compared with a number.
_NUMBERED = frozenset({"version", "codec"})
#: Statements that leave the block: an ``if`` ending in one is a branch of an early-return chain.
_EXITS = (ast.Return, ast.Raise, ast.Continue, ast.Break)


def _identifier(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def _mentions_constant(node: ast.AST, names: frozenset[str]) -> bool:
    """``F32``, ``tiers.F32``, ``tiers.F32.name``: a Name or an Attribute chain naming one of ``names``."""
    while isinstance(node, ast.Attribute):
        if node.attr in names:
            return True
        node = node.value
    return isinstance(node, ast.Name) and node.id in names


def _is_tier_name(node: ast.AST) -> bool:
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str) and node.value.lower() in TIER_NAMES
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return bool(node.elts) and all(_is_tier_name(e) for e in node.elts)
    return False


def _is_number(node: ast.AST) -> bool:
    if isinstance(node, ast.Constant):
        return isinstance(node.value, int) and not isinstance(node.value, bool)
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return bool(node.elts) and all(_is_number(e) for e in node.elts)
    return _mentions_constant(node, CODEC_CONSTANTS)


def _is_tier_compare(node: ast.Compare) -> bool:
    operands = [node.left, *node.comparators]
    if any(_is_tier_name(o) or _mentions_constant(o, TIER_CONSTANTS | CODEC_CONSTANTS) for o in operands):
        return True
    numbered = any(_identifier(o) in _NUMBERED for o in operands)
    return numbered and any(_is_number(o) for o in operands)


def is_tier_test(test: ast.AST) -> bool:
    """Whether a branch's test compares against the tier vocabulary (anywhere inside it)."""
    return any(isinstance(n, ast.Compare) and _is_tier_compare(n) for n in ast.walk(test))


def _leaves(body: list[ast.stmt]) -> bool:
    return bool(body) and isinstance(body[-1], _EXITS)


def _elif_tests(node: ast.If) -> tuple[list[ast.expr], bool]:
    """The tests of an ``if``/``elif`` chain and whether it ends in an ``else``."""
    tests = [node.test]
    while len(node.orelse) == 1 and isinstance(node.orelse[0], ast.If):
        node = node.orelse[0]
        tests.append(node.test)
    return tests, bool(node.orelse)


def _statement_chains(body: list[ast.stmt]) -> list[tuple[int, list[ast.expr], int]]:
    """``(line, tests, branches)`` of each chain that starts in this statement list."""
    chains = []
    i = 0
    while i < len(body):
        first = body[i]
        if not isinstance(first, ast.If):
            i += 1
            continue
        tests, has_else = _elif_tests(first)
        j = i + 1
        # The early-return spelling: `if a: return ...` / `if b: return ...` / fall-through.
        node = first
        while not has_else and _leaves(node.body) and j < len(body) and isinstance(body[j], ast.If):
            node = body[j]
            more, has_else = _elif_tests(node)
            tests += more
            j += 1
        falls_through = not has_else and _leaves(node.body) and j < len(body)
        chains.append((first.lineno, tests, len(tests) + int(has_else or falls_through)))
        i = j
    return chains


def _expression_chain(node: ast.IfExp) -> tuple[int, list[ast.expr], int]:
    tests = [node.test]
    while isinstance(node.orelse, ast.IfExp):
        node = node.orelse
        tests.append(node.test)
    return node.lineno, tests, len(tests) + 1


def _match_chain(node: ast.Match) -> tuple[int, list[ast.AST], int]:
    patterns: list[ast.AST] = []
    for case in node.cases:
        values = [p.value for p in ast.walk(case.pattern) if isinstance(p, ast.MatchValue)]
        if any(_is_tier_name(v) or _mentions_constant(v, TIER_CONSTANTS | CODEC_CONSTANTS) for v in values):
            patterns.append(ast.Compare(ast.Name("tier"), [ast.Eq()], [ast.Constant("fp8")]))
        else:
            patterns.append(ast.Constant(None))
    return node.lineno, patterns, len(node.cases)


def chains_in_source(source: str, filename: str = "<source>") -> list[int]:
    """Lines where a tier branch chain starts in one module's source."""
    tree = ast.parse(source, filename=filename)
    found: list[tuple[int, list, int]] = []
    nested_ifexp: set[int] = set()
    for node in ast.walk(tree):
        for name in ("body", "orelse", "finalbody"):
            block = getattr(node, name, None)
            if isinstance(block, list) and block and isinstance(block[0], ast.stmt):
                if name == "orelse" and isinstance(node, ast.If) and len(block) == 1 and isinstance(block[0], ast.If):
                    continue  # an elif: part of the chain that starts above it
                found.extend(_statement_chains(block))
        if isinstance(node, ast.IfExp) and id(node) not in nested_ifexp:
            inner = node.orelse
            while isinstance(inner, ast.IfExp):
                nested_ifexp.add(id(inner))
                inner = inner.orelse
            found.append(_expression_chain(node))
        if isinstance(node, ast.Match):
            found.append(_match_chain(node))
    lines = {line for line, tests, branches in found if branches >= 3 and sum(map(is_tier_test, tests)) >= 2}
    return sorted(lines)


def tier_branch_chains(root: Path) -> list[str]:
    """``file:line`` of every tier branch chain in the parts' files (:data:`REGISTRY_MODULES` skipped).

    Parameters
    ----------
    root : a checkout (its top-level folders are the parts of ``layering.PARTS``)

    Returns
    -------
    list of str, sorted by file then line
    """
    root = Path(root)
    out = []
    for part in PARTS:
        folder = root / part
        if not folder.is_dir():
            continue
        for path in sorted(folder.rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            if "__pycache__" in path.parts or rel in REGISTRY_MODULES:
                continue
            out.extend(f"{rel}:{line}" for line in chains_in_source(path.read_text(), rel))
    return out
