"""kvstore: resumable LLM conversations over MLA latent KV caches.

The parts live in sibling top-level folders mapped into this namespace
(``kvstore.formats``, ``kvstore.migrations``, ``kvstore.engine``, ``kvstore.gpu``,
``kvstore.api``). This module stays import-light on purpose: ``kvstore.formats`` and
``kvstore.gpu`` must import with numpy (+ torch/cupy) alone, and importing them imports
this package first, so the journal and the session store are exposed lazily.
"""

from __future__ import annotations

import importlib
import os

__version__ = "0.1.0"
#: The owner of what is created without one: the first API key, a CLI-created session.
DEFAULT_OWNER = "default"

# A source checkout run without installation (``python -m pytest`` from the repo root puts
# the root on sys.path): map kvstore.<part> to the sibling folders, as pyproject does.
_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if os.path.isfile(os.path.join(_root, "pyproject.toml")) and os.path.isdir(os.path.join(_root, "formats")):
    if _root not in __path__:
        __path__.append(_root)

_LAZY = {
    "KVFile": "kvstore.journal",
    "SessionStore": "kvstore.store",
}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvstore' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
