"""No behaviour picks a tier by comparing names: each tier's codec object says what differs
(``tests/tier_branches.py`` finds the chains; this gate is shown to catch a planted one)."""

from __future__ import annotations

from pathlib import Path

from tier_branches import REGISTRY_MODULES, chains_in_source, tier_branch_chains

ROOT = Path(__file__).resolve().parent.parent.parent


def test_the_tree_has_no_tier_branch_chains():
    found = tier_branch_chains(ROOT)
    assert not found, "tier branch chains (give the difference to the tier's codec instead):\n" + "\n".join(found)


def test_the_counter_catches_a_planted_chain(tmp_path):
    (tmp_path / "gpu").mkdir()
    (tmp_path / "gpu" / "planted.py").write_text(
        "from kvstore import tiers\n"
        "\n"
        "def width(tier, n):\n"
        "    if tier is tiers.F32:\n"
        "        return 4 * n\n"
        "    elif tier.name == 'fp8':\n"
        "        return n + 4\n"
        "    else:\n"
        "        return n // 2 + 4\n"
    )
    (tmp_path / "formats").mkdir()
    (tmp_path / "formats" / "codecs.py").write_text(  # the registry module is skipped
        "def f(name):\n    if name == 'f32':\n        return 1\n    if name == 'fp8':\n        return 2\n    return 3\n"
    )
    assert "formats/codecs.py" in REGISTRY_MODULES
    assert tier_branch_chains(tmp_path) == ["gpu/planted.py:4"]


def test_every_spelling_of_a_chain_counts():
    early_returns = (
        "def f(tier):\n"
        "    if tier.name == 'f32':\n"
        "        return 1\n"
        "    if tier is BF16:\n"
        "        return 2\n"
        "    return 3\n"
    )
    versions = "def f(h):\n    if h.version == 2:\n        a = 1\n    elif h.version == 3:\n        a = 2\n    else:\n        a = 3\n"
    codec_ids = "def f(codec):\n    if codec == CODEC_INT4:\n        x()\n    elif codec == tq.CODEC_POLAR:\n        y()\n    else:\n        raise E\n"
    expression = "x = 1 if t is tiers.F32 else 2 if t is tiers.FP8 else 3\n"
    matched = (
        "match name:\n    case 'f32':\n        a = 1\n    case 'polar3':\n        a = 2\n    case _:\n        a = 3\n"
    )
    for source in (early_returns, versions, codec_ids, expression, matched):
        assert chains_in_source(source) != [], source


def test_what_is_not_a_chain():
    two_ways = "def f(tier):\n    if tier.version == 1:\n        return None\n    return tier.row_codec\n"
    unrelated = "def f(x):\n    if x == 1:\n        a()\n    elif x == 2:\n        b()\n    else:\n        c()\n"
    a_table = "WIDTH = {'f32': 4, 'fp8': 1, 'int4': 0.5}\n"
    for source in (two_ways, unrelated, a_table):
        assert chains_in_source(source) == [], source
