"""Dependencies point one way (DESIGN.md): no part imports a part above it, and the light parts
stay light — ``kvstore.formats``, ``kvstore.tiers`` and ``kvstore.gpu`` import with numpy and torch
alone (the GPU machine has neither lmdb nor fastapi nor zstandard)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from layering import ALLOWED, PARTS, back_edges, imports, part_of_module, third_party_violations

ROOT = Path(__file__).resolve().parent.parent


def test_no_part_imports_a_part_above_it():
    found = back_edges(ROOT)
    assert not found, "imports against DESIGN.md's direction:\n" + "\n".join(map(str, found))


def test_the_light_parts_import_only_what_they_may():
    found = third_party_violations(ROOT, frozenset(sys.stdlib_module_names))
    assert not found, "third-party imports a light part may not use:\n" + "\n".join(map(str, found))


def test_the_rules_see_every_part_and_catch_a_back_edge(tmp_path):
    # The checker itself: a planted `formats -> api` import is found; the real tree has every part.
    (tmp_path / "formats").mkdir()
    (tmp_path / "formats" / "bad.py").write_text("def f():\n    from kvstore.api import main\n")
    assert [str(e) for e in back_edges(tmp_path)] == ["formats/bad.py:2 imports kvstore.api"]
    assert part_of_module("kvstore.tiers") == "formats" and part_of_module("kvstore.store.index") == "kvstore"
    assert part_of_module("numpy") == ""
    assert {Path(e.source).parts[0] for e in imports(ROOT)} == set(PARTS) == set(ALLOWED)


def test_formats_tiers_and_gpu_import_without_the_store_and_web_stacks():
    blocked = ["lmdb", "fastapi", "starlette", "uvicorn", "zstandard", "pydantic", "httpx", "cupy"]
    code = (
        "import sys\n"
        f"for name in {blocked!r}:\n"
        "    sys.modules[name] = None  # an import of it raises ImportError\n"
        "import kvstore.formats, kvstore.formats.coli_kv, kvstore.tiers, kvstore.gpu, kvstore.gpu.torch_backend\n"
        "from kvstore import tiers\n"
        "print(tiers.FP8.name)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "fp8", done.stderr
