"""Programmatic dependent launch, looked at from outside: where inductor's generated kernels wait
for the grid before them, a decode to compare builds and launches by, and Triton's launcher told to
drop the launch attribute.

A kernel launched dependently may start while the kernel ahead of it still runs; it must wait
(``gdc_wait``) before it loads or stores anything. Used by the engine's GPU tests, a CPU test on
planted sources and ``bench/dependent_launch_rows.py``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

_KERNEL = re.compile(r"async_compile\.triton\(\s*'(\w+)',\s*'''(.*?)'''", re.DOTALL)
_ACCESS = re.compile(r"\btl\.(load|store|atomic_\w+)\(")
_WAIT = "tl.extra.cuda.gdc_wait()"
_BRANCH = re.compile(r"^[ \t]*(?:if|elif) pid < ", re.MULTILINE)


def dependent_kernels(source: str) -> dict[str, str]:
    """The kernels in an inductor output module that launch dependently: {name: kernel text}."""
    return {name: text for name, text in _KERNEL.findall(source) if "'launch_pdl': True" in text}


def accesses_before_the_wait(text: str) -> str | None:
    """The first load or store a dependent kernel issues before its wait (its line), or None when
    it waits first. A combo kernel (inductor's ``combo_kernels``) runs one of its sub-kernels per
    program, each under its own ``if pid < ...`` / ``elif pid < ...`` branch: unless it waits
    before the branches, every branch must wait before its own first access."""
    body = text[text.index("@triton.jit") :]
    branches = [m.start() for m in _BRANCH.finditer(body)]
    if branches and _first_access_unwaited(body[: branches[0]]) is None and _WAIT in body[: branches[0]]:
        return None  # waited before any branch: every program has
    for start, end in zip([0, *branches], [*branches, len(body)]):
        line = _first_access_unwaited(body[start:end])
        if line is not None:
            return line
    return None


def is_combo(text: str) -> bool:
    """Whether a kernel is a combo kernel: sub-kernels under branches of ``pid``."""
    return _BRANCH.search(text) is not None


def _first_access_unwaited(segment: str) -> str | None:
    """The line of the segment's first load or store when no wait comes before it, else None."""
    access = _ACCESS.search(segment)
    if access is None:
        return None
    wait = segment.find(_WAIT)
    if wait != -1 and wait < access.start():
        return None
    return _line_at(segment, access.start())


def _line_at(text: str, position: int) -> str:
    """The line of ``text`` that holds ``position``, stripped."""
    return text[text.rfind("\n", 0, position) + 1 : text.find("\n", position)].strip()


_PTX_ACCESS = re.compile(r"\b(ld\.global|st\.global|cp\.async|atom\.global|red\.global)")


def ptx_accesses_before_the_wait(ptx: str) -> str | None:
    """For a kernel kvstore launches dependently itself (compiled by Triton to PTX): its first
    global-memory instruction before any ``griddepcontrol.wait`` (the line), or None when it waits
    first."""
    body = ptx[ptx.index(".entry") :]
    access = _PTX_ACCESS.search(body)
    if access is None or "griddepcontrol.wait" in body[: access.start()]:
        return None
    return _line_at(body, access.start())


def can_compile_for_sm90() -> bool:
    """Whether this Triton can compile for an H100/H200 with no GPU (it ships ptxas)."""
    import triton

    return (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists()


def compile_for_sm90(fn: Any, types: dict[str, str], constants: dict[str, Any], **options: Any) -> dict[str, Any]:
    """What Triton compiles ``fn`` to for an H100/H200 target, with no GPU (its ``asm``: ``ptx``,
    ``cubin``, ...): pointers typed by ``types`` (default ``*bf16``), the other non-constexpr
    parameters i32 (or as ``types`` says), ``constants`` the constexprs."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {}
    for name in fn.arg_names:
        if name in constants:
            signature[name] = "constexpr"
        elif name in types:
            signature[name] = types[name]
        else:
            signature[name] = "*bf16" if name.endswith("_ptr") else "i32"
    kernel = triton.compile(ASTSource(fn, signature, constants), target=GPUTarget("cuda", 90, 32), options=options)
    return kernel.asm


def greedy_rows(tier: str, steps: int) -> tuple[list[int], Any, list[list[int]], list[Any]]:
    """A tiny bf16 model's greedy decode through the compiled step in CUDA graphs, alone and three
    sessions together: (tokens, rows, batch tokens, batch rows), rows as ``.coli_kv`` records."""
    import numpy as np
    import torch

    from kvstore.engine import Engine, preset, random_model
    from kvstore.engine.batch import BatchSequence

    cfg = preset("tiny-512")
    geometry = cfg.coli_geometry()
    rng = np.random.default_rng(5)
    prompt = rng.integers(2, cfg.vocab_size, 200)
    contexts = [rng.integers(2, cfg.vocab_size, n) for n in (40, 300, 1100)]
    model = random_model(cfg, seed=7, device=torch.device("cuda"), dtype="bfloat16")
    engine = Engine(model, tier=tier)
    assert model.regions.compiled
    alone = engine.generate(prompt, max_new_tokens=steps, stop_tokens=())
    rows = engine.export_rows(0, engine.cache.length).record_array(geometry)
    batch = []
    for context in contexts:
        writer = Engine(model, tier=tier)
        writer.prefill(context[:-1])
        cache = engine.new_cache()
        cache.restore(writer.export_rows())
        batch.append(BatchSequence(cache, context[-1:]))
    together = engine.generate_batch(batch, max_new_tokens=steps, stop_tokens=())
    batch_rows = [seq.cache.export_rows().record_array(geometry) for seq in batch]
    return list(alone.tokens), rows, [list(t) for t in together.tokens], batch_rows


class DroppedLaunches:
    """Triton's CUDA launcher's ``launch_pdl`` made droppable: set :meth:`launch_pdl` on the
    launcher class; while ``plain`` is set, a launch that asked for dependent launch goes without
    the attribute (nothing overlaps, the kernel's waits return at once), counted in ``dropped``."""

    def __init__(self) -> None:
        self.plain = False
        self.dropped = 0

    def launch_pdl(self) -> property:
        def asked(launcher: Any) -> bool:
            value = launcher.__dict__.get("_launch_pdl", False)
            if value and self.plain:
                self.dropped += 1
                return False
            return value

        def ask(launcher: Any, value: bool) -> None:
            launcher.__dict__["_launch_pdl"] = value

        return property(asked, ask)
