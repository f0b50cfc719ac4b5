"""The model part of a session's fingerprint, shared by the bundled engine and the transformers interop.

A session records what its rows depend on (``kvstore.store.Fingerprint``): the six geometry
words, the tier of its journal (a ``kvstore.tiers`` tier: version, codec, bits) and the model (``ModelInfo``). This module computes
the model part from a model folder and compares a session with what an engine expects:

- ``weights_hash``: ``blake2b:`` over the folder's weight files (names, sizes, bytes), computed
  once per folder and kept in memory and in ``$KVSTORE_CACHE_DIR`` (default ``~/.cache/kvstore``)
  ``/weights/``, keyed by each file's name, size, mtime and inode, so a changed file is hashed again.
- ``tokenizer_hash`` and ``chat_template_hash``: the tokenizer files, with the chat template hashed
  on its own so each change is named.
- ``attention_variant``: :data:`ATTENTION_VARIANT`, what the rows are. The bundled engine caches
  exactly the rows transformers' MLA attention caches (the ``kv_a_layernorm`` output and the roped
  key, de-interleaved when the config says ``rope_interleave``; see
  ``tests/engine/test_oracle.py::test_cached_rows_are_what_transformers_caches``), so both record
  the same variant and resume each other's sessions.

:func:`refuse_mismatch` compares every field and raises ``FingerprintMismatch`` naming each one
that differs. The explicit override is a set of field names (``model.<field>`` or ``tier``) the
caller vouches for, e.g. ``{"model.weights_hash"}`` for the same weights saved in another file
layout. Geometry is never overridable: rows of another width cannot be attended.

This module imports the session store lazily (it needs lmdb; the row helpers of
``kvstore.engine.hf`` must import without it).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable

from kvstore import config
from kvstore.errors import FingerprintMismatch, InvalidRequest

if TYPE_CHECKING:
    from kvstore.formats.coli_kv import Geometry
    from kvstore.store import Fingerprint, ModelInfo, SessionInfo
    from kvstore.tiers import Tier

__all__ = [
    "ATTENTION_VARIANT",
    "OVERRIDABLE",
    "folder_model_info",
    "refuse_mismatch",
    "tokenizer_hashes",
    "weight_files",
    "weights_hash",
]

logger = logging.getLogger(__name__)

# The rows are what transformers' attention caches (its rope, its norm), recorded as such so that a
# session is only resumed by an engine that computes the same rows.
ATTENTION_VARIANT = "transformers-latent"
WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin")
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "added_tokens.json",
    "special_tokens_map.json",
    "tokenizer_config.json",
)
HASH_CHUNK_BYTES = 8 << 20
MODEL_FIELDS = ("name", "revision", "weights_hash", "tokenizer_hash", "chat_template_hash", "attention_variant")
OVERRIDABLE = frozenset({f"model.{name}" for name in MODEL_FIELDS} | {"tier"})


# ---------------------------------------------------------------------------- weights
def cache_dir() -> Path:
    """Where computed weights hashes are kept: ``$KVSTORE_CACHE_DIR``, else ``~/.cache/kvstore``."""
    root = config.CACHE_DIR.get()
    if root is not None:
        return root
    return (config.XDG_CACHE_HOME.get() or Path.home() / ".cache") / "kvstore"


# (resolved folder, files stamp) -> hash, for this process
_folder_hashes: dict[tuple, str] = {}


def weight_files(folder: str | os.PathLike) -> list[Path]:
    """The folder's ``*.safetensors`` files (else ``pytorch_model*.bin``), in name order."""
    folder = Path(folder)
    for pattern in WEIGHT_PATTERNS:
        files = sorted(path for path in folder.glob(pattern) if path.is_file())
        if files:
            return files
    return []


def weights_hash(folder: str | os.PathLike) -> str:
    """``blake2b:<hex>`` over a model folder's weight files (names, sizes and bytes, in name order).

    Computed once per folder: the result is kept in memory and in
    ``$KVSTORE_CACHE_DIR`` (default ``~/.cache/kvstore``) ``/weights/``, keyed by the folder and
    each file's name, size, mtime and inode, so a changed file is hashed again.

    Raises
    ------
    InvalidRequest
        The folder holds no ``*.safetensors`` (or ``pytorch_model*.bin``) files.
    """
    folder = Path(folder).resolve()
    files = weight_files(folder)
    if not files:
        raise InvalidRequest(f"{folder} holds no *.safetensors or pytorch_model*.bin files to fingerprint")
    stamp = []
    for path in files:
        st = path.stat()
        stamp.append([path.name, st.st_size, st.st_mtime_ns, st.st_ino])
    key = (str(folder), json.dumps(stamp))
    if key in _folder_hashes:
        return _folder_hashes[key]
    record_path = (
        cache_dir() / "weights" / (hashlib.blake2b(str(folder).encode(), digest_size=16).hexdigest() + ".json")
    )
    try:
        record = json.loads(record_path.read_text())
        if record.get("folder") == str(folder) and record.get("files") == stamp:
            _folder_hashes[key] = record["hash"]
            return record["hash"]
    except (OSError, ValueError, KeyError, AttributeError):
        pass  # no usable record: hash the files
    value = _hash_files(files, stamp)
    _folder_hashes[key] = value
    _write_private(record_path, json.dumps({"folder": str(folder), "files": stamp, "hash": value}))
    return value


def _hash_files(files: list[Path], stamp: list[list]) -> str:
    hasher = hashlib.blake2b(digest_size=32)
    buffer = bytearray(HASH_CHUNK_BYTES)
    view = memoryview(buffer)
    for path, (name, size, _, _) in zip(files, stamp):
        hasher.update(f"{name}\0{size}\0".encode())
        with open(path, "rb", buffering=0) as f:
            while True:
                got = f.readinto(buffer)
                if not got:
                    break
                hasher.update(view[:got])
    return "blake2b:" + hasher.hexdigest()


def _write_private(path: Path, text: str) -> None:
    """Best-effort atomic write of a cache record (owner-only); a read-only home just skips it."""
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd, temp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")  # mkstemp creates it 0600
        try:
            with os.fdopen(fd, "w") as f:
                f.write(text)
            os.replace(temp, path)
        except BaseException:
            os.unlink(temp)
            raise
    except OSError:
        logger.debug("could not keep the weights hash in %s", path)


# ---------------------------------------------------------------------------- tokenizer
def tokenizer_hashes(folder: str | os.PathLike) -> tuple[str | None, str | None]:
    """``(tokenizer_hash, chat_template_hash)`` of a folder's tokenizer files (None when absent).

    The chat template is hashed on its own (from ``tokenizer_config.json``, ``chat_template.jinja``
    or ``chat_template.json``) and left out of the tokenizer hash, so each change is named.
    """
    folder = Path(folder)
    hasher = hashlib.blake2b(digest_size=32)
    templates: dict[str, Any] = {}
    found = False
    for name in TOKENIZER_FILES:
        path = folder / name
        if not path.is_file():
            continue
        found = True
        payload = path.read_bytes()
        if name == "tokenizer_config.json":
            try:
                config = json.loads(payload)
            except ValueError:
                config = None
            if isinstance(config, dict):
                if config.get("chat_template") is not None:
                    templates["tokenizer_config.json"] = config.pop("chat_template")
                payload = json.dumps(config, sort_keys=True).encode()
        hasher.update(f"{name}\0{len(payload)}\0".encode())
        hasher.update(payload)
    for name in ("chat_template.jinja", "chat_template.json"):
        path = folder / name
        if path.is_file():
            templates[name] = path.read_text()
    template_hash = None
    if templates:
        template_hash = (
            "blake2b:" + hashlib.blake2b(json.dumps(templates, sort_keys=True).encode(), digest_size=32).hexdigest()
        )
    return ("blake2b:" + hasher.hexdigest()) if found else None, template_hash


# ---------------------------------------------------------------------------- the model part
def folder_model_info(folder: str | os.PathLike, *, revision: str = "local") -> "ModelInfo":
    """The model part of the fingerprint of a local model folder.

    ``name`` is the folder's name (as ``transformers`` records a folder loaded with
    ``from_pretrained``), ``revision`` ``local``, the weights hash (cached, see
    :func:`weights_hash`), the tokenizer and chat-template hashes when the folder has them, and
    :data:`ATTENTION_VARIANT`.

    Raises
    ------
    InvalidRequest
        The folder holds no weight files.
    """
    from kvstore.store import ModelInfo

    folder = Path(folder).resolve()
    tokenizer_hash, template_hash = tokenizer_hashes(folder)
    return ModelInfo(
        name=folder.name[-256:],
        revision=revision[:256],
        weights_hash=weights_hash(folder),
        tokenizer_hash=tokenizer_hash,
        chat_template_hash=template_hash,
        attention_variant=ATTENTION_VARIANT,
    )


def expected_fingerprint(model: "ModelInfo", geometry: "Geometry", tier: "Tier") -> "Fingerprint":
    """The fingerprint an engine of ``model`` with ``geometry`` writing ``tier`` rows expects."""
    from kvstore.store import Fingerprint

    return Fingerprint(model, geometry, tier)


def check_override(override: Iterable[str]) -> frozenset[str]:
    """The override as a set, refusing names that are not overridable (geometry never is).

    Raises
    ------
    InvalidRequest
        A name that is neither ``model.<field>`` nor ``tier``.
    """
    skip = frozenset(override)
    unknown = sorted(name for name in skip if name not in OVERRIDABLE)
    if unknown:
        raise InvalidRequest(f"cannot override {unknown}: only model.* fields and tier can be overridden")
    return skip


def mismatches(info: "SessionInfo", expected: "Fingerprint", override: Iterable[str] = ()) -> list[str]:
    """``field: session X, expected Y`` for each field that differs and is not overridden."""
    skip = check_override(override)
    return [m for m in info.fingerprint.mismatches(expected) if m.split(":")[0] not in skip]


def refuse_mismatch(info: "SessionInfo", expected: "Fingerprint", override: Iterable[str] = ()) -> None:
    """Raise ``FingerprintMismatch`` naming every field of ``info`` that differs from ``expected``.

    Parameters
    ----------
    info : the session's index record
    expected : what the restoring engine computes
    override : fields not to compare (``model.<field>`` or ``tier``), an explicit escape hatch

    Raises
    ------
    FingerprintMismatch, InvalidRequest (an override name that is not overridable)
    """
    blocking = mismatches(info, expected, override)
    if blocking:
        raise FingerprintMismatch(
            f"session {info.id!r} was written by another model or cache tier: "
            + "; ".join(blocking)
            + " (override a field only if you know the caches are interchangeable)"
        )
