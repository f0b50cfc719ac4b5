"""How far a session's id travels: the walk of a migrate, an append and a resume through the store.

STYLE.md rule 9 asks that a data path read as a straight line — facade, the one module that owns the
operation, journal and index — not back and forth between helpers. This measures it on any tree:

    python bench/walks.py [--root DIR] [-v]      # default: this checkout; -v prints each walk

To compare with an older commit: ``git worktree add /tmp/before <rev>`` and run it with
``--root /tmp/before`` (this script is read from *this* checkout; the code measured is the tree's).

How it runs: a temporary folder gets a ``kvstore`` package laid out as installed, made of symbolic
links into ``root`` (every entry of ``root/kvstore`` and the part folders ``formats``,
``migrations``, ``config``, ``engine``, ``gpu``, ``api``, ``cli``, ``connectors`` that exist), and a
child Python with that folder first on ``PYTHONPATH`` opens a real embedded store in a temporary
folder, creates the session ``walk`` (owner ``alice``, fp8), appends three turns, then traces one
call each of ``store.migrate("walk", int4)``, ``store.append("walk", ...)`` and
``store.resume("walk")`` (``sys.setprofile``, ``call`` events; what the test set up is not traced).

Definitions (one, used for every tree):

- a **place** is a call into one of kvstore's own modules — the ``kvstore`` part, the files of
  ``root/kvstore`` (the store, the journal, the locks) — whose arguments at call time (the frame's
  argument locals, ``*args`` and ``**kwargs`` entries included, under any name) hold the session's
  id (``walk``) or its storage key (``walk~alice``) itself, or an object whose ``.key``, ``.id`` or
  ``["id"]`` is one of them (an index record, a ``SessionInfo``, a handle). A generator counts
  once, when it starts (not at each resume). The parts the store imports (``formats``,
  ``migrations``: the index's key encoding, ``config``) are libraries below it as the layering
  draws them, like numpy, lmdb and the standard library: calls into them are not places, nor is
  code generated at run time (a dataclass's ``__init__``), which is in no module's file;
- **modules** is the number of distinct modules the places are in;
- a **re-entry** is a step of the sequence of places into a module that the sequence had been in
  and left before (``a b a`` is one re-entry; ``a a b`` none).

On the commit before the walks were straightened this gives, for migrate, 58 places in 10 modules
and 28 re-entries (append 41 / 9 / 24, resume 35 / 5 / 19). The issue that asked for the tool
counted 46 / 12 / 34 by hand; its reading is not this one: counting arguments that merely contain
the key (the journal's and the lock files' paths) adds ``kvstore.journal`` and ``kvstore.locks``
(80 places, 12 modules, 37 re-entries), and counting each function once instead of each call gives
34 / 10 / 17. The definition above is the one measured, before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
#: Folders of a checkout that are installed as ``kvstore.<name>``.
PART_FOLDERS = ("formats", "migrations", "engine", "gpu", "api", "cli", "config", "connectors")
PATHS = ("migrate", "append", "resume")
SESSION_ID, OWNER = "walk", "alice"


def link_package(root: Path, into: Path) -> Path:
    """A ``kvstore`` package under ``into`` made of links to ``root``'s files, laid out as installed."""
    package = into / "kvstore"
    package.mkdir()
    for entry in sorted((root / "kvstore").iterdir()):
        if entry.name != "__pycache__" and entry.name not in PART_FOLDERS:
            (package / entry.name).symlink_to(entry)
    for part in PART_FOLDERS:
        if (root / part).is_dir():
            (package / part).symlink_to(root / part)
    return package


def measure_walks(root: Path) -> dict:
    """The walks of the tree at ``root``: ``{path: {"places", "modules", "reentries", "sequence",
    "calls"}}`` for ``migrate``, ``append`` and ``resume`` (see the module docstring)."""
    root = Path(root).resolve()
    with tempfile.TemporaryDirectory(prefix="kvstore-walks-") as scratch:
        package = link_package(root, Path(scratch))
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [scratch, os.environ.get("PYTHONPATH")])),
            "PYTHONDONTWRITEBYTECODE": "1",  # nothing written into the measured tree
        }
        done = subprocess.run(
            [sys.executable, str(Path(__file__).resolve()), "--child", str(package)],
            env=env,
            cwd=scratch,
            capture_output=True,
            text=True,
        )
    if done.returncode != 0:
        raise RuntimeError(f"the traced child failed (exit {done.returncode}):\n{done.stderr}")
    return json.loads(done.stdout.splitlines()[-1])


# ---------------------------------------------------------------------------- the child (traced)
def _child(package: str) -> None:
    import numpy as np

    import kvstore
    import kvstore.store as store_package
    from kvstore import tiers
    from kvstore.formats.coli_kv import Geometry

    if not kvstore.__file__ or not kvstore.__file__.startswith(package):
        raise SystemExit(f"imported kvstore from {kvstore.__file__}, not from {package}")
    geometry = Geometry(n_layers=2, kv_lora=32, qk_rope=8, index_hd=4, nic=1, vocab=1000)
    rng = np.random.default_rng(0)

    def rows(n: int):
        return (
            rng.integers(0, geometry.vocab, n).astype(np.int32),
            rng.standard_normal((geometry.n_layers, n, geometry.kv_lora)).astype(np.float32),
            rng.standard_normal((geometry.n_layers, n, geometry.qk_rope)).astype(np.float32),
            rng.standard_normal((geometry.nic, n, geometry.index_hd)).astype(np.float32),
        )

    key = f"{SESSION_ID}~{OWNER}"
    wanted = {SESSION_ID, key}

    def names_session(value) -> bool:
        if isinstance(value, str):
            return value in wanted
        try:
            if isinstance(value, dict):
                return value.get("id") in wanted
            return any(
                isinstance(getattr(value, name, None), str) and getattr(value, name) in wanted for name in ("key", "id")
            )
        except Exception:  # a property that refuses (a backend's missing folder): not this session
            return False

    generator_flags = 0x20 | 0x80 | 0x200  # CO_GENERATOR | CO_COROUTINE | CO_ASYNC_GENERATOR
    prefix = package + os.sep
    parts = tuple(prefix + part + os.sep for part in PART_FOLDERS)

    def trace(call) -> list[list[str]]:
        places: list[list[str]] = []
        started: dict[int, object] = {}  # generator frames already counted (kept alive: ids stay unique)

        def profile(frame, event, arg):
            filename = frame.f_code.co_filename
            if event != "call" or not filename.startswith(prefix) or filename.startswith(parts):
                return
            code = frame.f_code
            if code.co_flags & generator_flags:
                if id(frame) in started:
                    return
                started[id(frame)] = frame
            n_args = code.co_argcount + code.co_kwonlyargcount + bool(code.co_flags & 0x04) + bool(code.co_flags & 0x08)
            values = []
            for name in code.co_varnames[:n_args]:
                value = frame.f_locals.get(name)
                if isinstance(value, tuple) and name == code.co_varnames[n_args - 1 - bool(code.co_flags & 0x08)]:
                    values.extend(value)  # *args
                elif isinstance(value, dict) and code.co_flags & 0x08 and name == code.co_varnames[n_args - 1]:
                    values.extend(value.values())  # **kwargs
                values.append(value)
            if any(names_session(value) for value in values):
                places.append([frame.f_globals.get("__name__", "?"), code.co_qualname])

        sys.setprofile(profile)
        try:
            call()
        finally:
            sys.setprofile(None)
            started.clear()
        return places

    with tempfile.TemporaryDirectory(prefix="kvstore-walk-store-") as data:
        opener = getattr(store_package, "open", None)
        store = opener(data) if callable(opener) else store_package.SessionStore(data)
        with store:
            store.create(OWNER, geometry, tiers.FP8, {"name": "walk", "revision": "1"}, session_id=SESSION_ID)
            for n in (5, 3, 4):
                store.append(SESSION_ID, *rows(n))
            turn = rows(2)
            walks = {
                "append": trace(lambda: store.append(SESSION_ID, *turn)),
                "resume": trace(lambda: store.resume(SESSION_ID)),
                "migrate": trace(lambda: store.migrate(SESSION_ID, tiers.INT4)),
            }
    print(json.dumps({path: summarize(walks[path]) for path in PATHS}))


def summarize(places: list[list[str]]) -> dict:
    """Places, distinct modules and re-entries of one walk (module docstring)."""
    sequence = [module for module, _ in places]
    left: set[str] = set()
    reentries = 0
    for before, module in zip(sequence, sequence[1:]):
        if module != before:
            left.add(before)
            reentries += module in left
    return {
        "places": len(places),
        "modules": len(set(sequence)),
        "reentries": reentries,
        "sequence": sequence,
        "calls": [f"{module}:{name}" for module, name in places],
    }


def runs(sequence: list[str]) -> str:
    """``a ×2 → b → a`` for a sequence of modules (the ``kvstore.`` prefix dropped)."""
    out: list[list] = []
    for module in sequence:
        short = module.removeprefix("kvstore.")
        if out and out[-1][0] == short:
            out[-1][1] += 1
        else:
            out.append([short, 1])
    return " → ".join(name if n == 1 else f"{name} ×{n}" for name, n in out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=HERE, help="the tree to measure (default: this checkout)")
    parser.add_argument("-v", "--verbose", action="store_true", help="print each walk's module sequence")
    parser.add_argument("--calls", action="store_true", help="print each place (module:function)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args.child)
        return 0
    walks = measure_walks(args.root)
    if args.json:
        print(json.dumps(walks, indent=2))
        return 0
    print(f"walks of {args.root.resolve()}")
    print(f"{'path':<9} {'places':>6} {'modules':>7} {'re-entries':>10}")
    for path in PATHS:
        walk = walks[path]
        print(f"{path:<9} {walk['places']:>6} {walk['modules']:>7} {walk['reentries']:>10}")
    for path in PATHS:
        if args.verbose:
            print(f"\n{path}: {runs(walks[path]['sequence'])}")
        if args.calls:
            print(f"\n{path}:\n  " + "\n  ".join(walks[path]["calls"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
