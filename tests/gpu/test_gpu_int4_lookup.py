"""The warpgroup-MMA kernels' int4 level lookup (inline PTX in ``kvstore.gpu.wgmma_kernels``), run
on the CPU by interpreting its instructions: every code in every nibble of a word must come out as
the format's level rounded to f16, the low nibbles' levels in the first two output words and the
high nibbles' in the last two. No GPU needed; the GPU tests check the same kernels end to end."""

from __future__ import annotations

import re

import numpy as np
import pytest

pytest.importorskip("triton.experimental.gluon")

from kvstore.formats import tq  # noqa: E402
from kvstore.gpu import wgmma_kernels  # noqa: E402

MASK = 0xFFFFFFFF


def _prmt(a: int, b: int, selector: int) -> int:
    """PTX ``prmt.b32`` in its default mode: byte i of the result is byte (selector nibble i & 7)
    of b:a, or that byte's sign replicated when the nibble's bit 3 is set."""
    pool = [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)]
    out = 0
    for i in range(4):
        nibble = (selector >> (4 * i)) & 0xF
        byte = pool[nibble & 7]
        if nibble & 8:
            byte = 0xFF if byte & 0x80 else 0
        out |= byte << (8 * i)
    return out


_OPS = {
    "mov.b32": lambda a: a,
    "not.b32": lambda a: ~a & MASK,
    "and.b32": lambda a, b: a & b,
    "or.b32": lambda a, b: a | b,
    "xor.b32": lambda a, b: a ^ b,
    "shr.u32": lambda a, b: a >> b,
    "shl.b32": lambda a, b: (a << b) & MASK,
    "sub.u32": lambda a, b: (a - b) & MASK,
    "prmt.b32": _prmt,
}


def _run(asm: str, word: int) -> list[int]:
    regs = {"$4": word}
    for statement in asm.replace("{", "").replace("}", "").split(";"):
        statement = statement.strip()
        if not statement or statement.startswith(".reg"):
            continue
        op, operands = statement.split(None, 1)
        dest, *sources = [x.strip() for x in operands.split(",")]
        values = [int(x, 0) if re.fullmatch(r"0x[0-9A-Fa-f]+|\d+", x) else regs[x] for x in sources]
        regs[dest] = _OPS[op](*values)
    return [regs[f"${i}"] for i in range(4)]


def _words() -> list[int]:
    """Each code in each of the 8 nibbles (the others random), plus random words and the extremes."""
    rng = np.random.default_rng(17)
    words = [0, MASK, 0x76543210, 0xFEDCBA98, 0x89ABCDEF]
    for position in range(8):
        for code in range(16):
            base = int(rng.integers(0, 1 << 32)) & ~(0xF << (4 * position))
            words.append(base | (code << (4 * position)))
    words += [int(w) for w in rng.integers(0, 1 << 32, size=1000)]
    return words


def test_every_code_in_every_nibble_gives_its_level_in_f16():
    asm = wgmma_kernels._INT4.value
    levels = np.float16(tq.LEVELS).view(np.uint16)
    for word in _words():
        out = _run(asm, word)
        halves = [(out[i // 2] >> (16 * (i % 2))) & 0xFFFF for i in range(8)]
        codes = [(word >> (4 * k)) & 0xF for k in range(8)]
        # $0, $1: elements 0, 2, 4, 6 (low nibbles); $2, $3: elements 1, 3, 5, 7 (high nibbles)
        expected = [int(levels[c]) for c in codes[0::2] + codes[1::2]]
        assert halves == expected, f"word {word:#010x}: {[hex(h) for h in halves]} != {[hex(e) for e in expected]}"


def test_the_table_words_hold_the_level_magnitudes_byte_by_byte():
    lo_a, lo_b, hi_a, hi_b = wgmma_kernels._int4_table()
    magnitudes = np.float16(tq.LEVELS[8:]).view(np.uint16)
    for j, half in enumerate(magnitudes):
        lo, hi = (lo_a, hi_a) if j < 4 else (lo_b, hi_b)
        assert (lo >> (8 * (j % 4))) & 0xFF == int(half) & 0xFF
        assert (hi >> (8 * (j % 4))) & 0xFF == int(half) >> 8
    # the lookup relies on the levels being symmetric
    assert np.array_equal(tq.LEVELS[:8], -tq.LEVELS[8:][::-1])
