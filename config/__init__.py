"""kvstore's configuration: every environment variable it reads and every default its parts share,
each declared once, here, with its type, default and doc.

A :class:`Variable` is read from the environment when asked for (``config.API_KEYS.get()``), never
at import, so a process that changes its environment (a test, a launcher) is seen at the next
read. An empty value counts as unset. A value that does not parse raises :class:`SettingError`
naming the variable and what it takes. A :class:`Default` is a value several parts need the same
(the data folder, a lease's length, the tier of a new session): the service's settings and the
command line's options take theirs from here.

Nothing else in kvstore reads ``os.environ`` (``tests/test_config.py`` fails when a module does,
and when a variable is missing from docs/CONFIG.md); ``kvstore config`` prints every entry with the
value it has in the calling environment. Knobs only a benchmark turns (kernel variants, replay of
launch plans, expert kernels) are arguments of the classes they tune, not variables.

This package imports the standard library only, so every part — ``formats`` and ``gpu`` included —
may import it (``tests/layering.py``).

Examples
--------
>>> API_KEYS.name, API_KEYS.default
('KVSTORE_API_KEYS', None)
>>> SESSION_TIER.value
'fp8'
>>> sorted({v.group for v in VARIABLES})
['connectors', 'engine', 'gpu', 'service', 'shared store', 'test suite']
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Generic, TypeVar

__all__ = [
    "DEFAULTS",
    "Default",
    "SettingError",
    "VARIABLES",
    "Variable",
    "environment",
    "report",
    "size_bytes",
    "variable",
]

T = TypeVar("T")


class SettingError(ValueError):
    """An environment variable whose value kvstore cannot use; ``reason`` names it and what it takes.

    (A ``ValueError`` rather than a ``KVStoreError``: this package sits below the error hierarchy's
    root, in ``kvstore.formats.errors``; ``kvstore.errors.ConfigError`` is both.)
    """

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason

    def __str__(self) -> str:
        return self.reason


# ---------------------------------------------------------------------------- value types
def _text(raw: str) -> str:
    return raw


def _path(raw: str) -> Path:
    return Path(raw).expanduser()


def _switch(raw: str) -> bool:
    """``1``/``true``/``yes``/``on`` or ``0``/``false``/``no``/``off`` (any case)."""
    word = raw.strip().lower()
    if word in ("1", "true", "yes", "on"):
        return True
    if word in ("0", "false", "no", "off"):
        return False
    raise ValueError("takes 1 or 0 (true/false, yes/no, on/off)")


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def size_bytes(raw: str) -> int:
    """``512M``, ``10G``, ``1.5K``, ``1048576`` -> bytes (binary units); ``ValueError`` otherwise
    (``kvstore.units.parse_size`` is this for the command line and the settings)."""
    match = _SIZE.match(raw)
    if match is None:
        raise ValueError("takes a size: a number of bytes with an optional K, M, G or T suffix")
    number, unit = match.groups()
    return int(float(number) * _SIZE_UNITS[(unit or "")[:1].lower()])


_TYPE_NAMES = {_text: "text", _path: "path", _switch: "switch (1/0)", size_bytes: "size"}


@dataclass(frozen=True)
class Variable(Generic[T]):
    """One environment variable: its name, how its text becomes a value, its default and its doc.

    Attributes
    ----------
    name : the variable (``KVSTORE_API_KEYS``)
    parse : text -> value; raises ``ValueError`` with what it takes
    default : the value when the variable is unset or empty
    doc : one sentence: what it sets, who reads it
    group : the part of kvstore that reads it (``service``, ``gpu``, ...)
    secret : its value is never printed (``kvstore config`` says ``(set)``)
    """

    name: str
    parse: Callable[[str], T]
    default: T
    doc: str
    group: str
    secret: bool = False

    def raw(self) -> str | None:
        """The variable's text, or None when it is unset or empty."""
        return os.environ.get(self.name) or None

    def is_set(self) -> bool:
        return self.raw() is not None

    def get(self) -> T:
        """The variable's value (its default when unset or empty).

        Raises
        ------
        SettingError
            The text does not parse.
        """
        text = self.raw()
        if text is None:
            return self.default
        try:
            return self.parse(text)
        except ValueError as exc:
            raise SettingError(f"{self.name}={'…' if self.secret else repr(text)}: {exc}") from None

    @property
    def type_name(self) -> str:
        return _TYPE_NAMES.get(self.parse, getattr(self.parse, "__name__", "value"))


@dataclass(frozen=True)
class Default(Generic[T]):
    """A default several parts share (no variable sets it: the command line's options and the
    service's settings override it)."""

    name: str
    value: T
    doc: str


# ---------------------------------------------------------------------------- the variables
API_KEYS: Variable[str | None] = Variable(
    "KVSTORE_API_KEYS",
    _text,
    None,
    "API keys the service accepts besides those of <data>/keys.json (or of a shared index), as "
    "KEY:OWNER[,KEY:OWNER...]; when set, `kvstore serve` creates no keys.json and prints no key "
    "(`kvstore keys` manages the file's)",
    "service",
    secret=True,
)
ENCRYPT: Variable[bool] = Variable(
    "KVSTORE_ENCRYPT",
    _switch,
    False,
    "1: open the embedded store encrypted at rest (the default of `--encrypt`; docs/SECURITY.md); a store "
    "created encrypted is opened encrypted whatever this says",
    "service",
)
KEK_FILE: Variable[Path | None] = Variable(
    "KVSTORE_KEK_FILE",
    _path,
    None,
    "the file holding the key-encryption key of an encrypted store (the default of `--kek-file`)",
    "service",
)
KEK: Variable[str | None] = Variable(
    "KVSTORE_KEK",
    _text,
    None,
    "the key-encryption key itself (64 hex digits or base64 of 32 bytes), when KVSTORE_KEK_FILE is unset",
    "service",
    secret=True,
)
INDEX_URL: Variable[str | None] = Variable(
    "KVSTORE_INDEX_URL",
    _text,
    None,
    "the shared store's index, postgresql://USER@HOST:PORT/DB: the default of --index",
    "shared store",
    secret=True,
)
BLOBS_URL: Variable[str | None] = Variable(
    "KVSTORE_BLOBS_URL",
    _text,
    None,
    "the shared store's objects, s3://BUCKET/PREFIX: the default of --blobs",
    "shared store",
)
AWS_ENDPOINT_URL: Variable[str | None] = Variable(
    "AWS_ENDPOINT_URL",
    _text,
    None,
    "the S3-compatible endpoint of --blobs (unset: AWS's own); the credentials are boto3's to read",
    "shared store",
)
BLOBS_GET_SIZE: Variable[int] = Variable(
    "KVSTORE_BLOBS_GET_SIZE",
    size_bytes,
    8 << 20,
    "bytes per ranged GET when a replica fetches a segment object, its parts fetched in parallel "
    "(default 8M; 0: one GET per object, for S3-compatible servers that read the whole object to answer a "
    "range, as moto does)",
    "shared store",
)
AWS_REGION: Variable[str | None] = Variable(
    "AWS_REGION", _text, None, "the object store's region (else AWS_DEFAULT_REGION, else us-east-1)", "shared store"
)
AWS_DEFAULT_REGION: Variable[str | None] = Variable(
    "AWS_DEFAULT_REGION", _text, None, "the object store's region when AWS_REGION is unset", "shared store"
)
API_KEY: Variable[str | None] = Variable(
    "KVSTORE_API_KEY",
    _text,
    None,
    "the vLLM and SGLang connectors' API key in service mode (the variable their `api_key_env` names by default)",
    "connectors",
    secret=True,
)
CACHE_DIR: Variable[Path | None] = Variable(
    "KVSTORE_CACHE_DIR",
    _path,
    None,
    "where the engine keeps computed weights hashes (unset: $XDG_CACHE_HOME/kvstore, else ~/.cache/kvstore)",
    "engine",
)
XDG_CACHE_HOME: Variable[Path | None] = Variable(
    "XDG_CACHE_HOME", _path, None, "the user's cache folder, when KVSTORE_CACHE_DIR is unset", "engine"
)
ATTENTION_BACKEND: Variable[str | None] = Variable(
    "KVSTORE_ATTENTION_BACKEND",
    _text,
    None,
    "the attention backend tried first when a caller names none (cuda, triton, torch, mps; "
    "kvstore.gpu.registry.select)",
    "gpu",
)
GPU_WGMMA: Variable[bool | None] = Variable(
    "KVSTORE_GPU_WGMMA",
    _switch,
    None,
    "1: every eligible fp8/int4 call with 64+ heads on sm_90 runs the warpgroup-MMA kernels; 0: none; "
    "unset: the calls docs/GPU.md names, on the Triton release they are tested with",
    "gpu",
)
NVRTC: Variable[Path | None] = Variable(
    "KVSTORE_NVRTC",
    _path,
    None,
    "the NVRTC library to compile the CUDA kernels with (unset: the pip wheel's, then CUDA_HOME's, then the system's)",
    "gpu",
)
CUDA_HOME: Variable[Path | None] = Variable(
    "CUDA_HOME", _path, None, "a CUDA toolkit whose lib64/ holds NVRTC (after the pip wheel's)", "gpu"
)
CI: Variable[bool] = Variable(
    "KVSTORE_CI",
    _switch,
    False,
    "set by .ci/run: a test whose system dependency (chromium, PostgreSQL, vLLM's venv) is missing fails "
    "instead of skipping",
    "test suite",
)
LONG: Variable[bool] = Variable(
    "KVSTORE_LONG",
    _switch,
    False,
    "`make test-long`: the long variants (hundreds of crash trials per operation, more fuzzing, 32k contexts)",
    "test suite",
)
VLLM_VENV: Variable[Path | None] = Variable(
    "KVSTORE_VLLM_VENV",
    _path,
    None,
    "vLLM's own virtualenv for the connector tests and bench/vllm_connector.py (unset: .vllm-venv)",
    "test suite",
)
RELIABILITY_JSON: Variable[Path | None] = Variable(
    "KVSTORE_RELIABILITY_JSON",
    _path,
    None,
    "where the reliability suite also writes its figures as JSON (bench/reliability_report.py sets it)",
    "test suite",
)

#: Every variable, in the order docs/CONFIG.md lists them.
VARIABLES: tuple[Variable[Any], ...] = (
    API_KEYS,
    ENCRYPT,
    KEK_FILE,
    KEK,
    INDEX_URL,
    BLOBS_URL,
    AWS_ENDPOINT_URL,
    BLOBS_GET_SIZE,
    AWS_REGION,
    AWS_DEFAULT_REGION,
    API_KEY,
    CACHE_DIR,
    XDG_CACHE_HOME,
    ATTENTION_BACKEND,
    GPU_WGMMA,
    NVRTC,
    CUDA_HOME,
    CI,
    LONG,
    VLLM_VENV,
    RELIABILITY_JSON,
)

# ---------------------------------------------------------------------------- shared defaults
DATA_DIR: Default[str] = Default(
    "data_dir", "./data", "the embedded store's folder (`--data`, `Settings.data_dir`; a replica's local cache)"
)
SESSION_TIER: Default[str] = Default(
    "session_tier", "fp8", "the tier of a session created with none named (`POST /sessions`, `kvstore sessions create`)"
)
ENGINE_TIER: Default[str] = Default(
    "engine_tier", "f32", "the engine's cache tier when none is named (`kvstore serve --model`, `Settings.tier`)"
)
LEASE_TTL_S: Default[float] = Default(
    "lease_ttl_s", 30.0, "seconds a replica's write lease on a shared session lasts (`kvstore serve --lease-ttl`)"
)

#: Every shared default, in the order docs/CONFIG.md lists them.
DEFAULTS: tuple[Default[Any], ...] = (DATA_DIR, SESSION_TIER, ENGINE_TIER, LEASE_TTL_S)


def variable(name: str) -> Variable[Any]:
    """The declared variable called ``name``; ``KeyError`` when kvstore declares none of that name."""
    for entry in VARIABLES:
        if entry.name == name:
            return entry
    raise KeyError(f"{name} is not one of kvstore's variables (kvstore.config.VARIABLES)")


def environment(name: str) -> str | None:
    """The text of a variable whose name the *user* chooses (e.g. a connector's ``api_key_env``),
    or None when unset or empty. The one reader of a variable kvstore does not declare itself."""
    return os.environ.get(name) or None


def report() -> list[dict[str, Any]]:
    """Every variable and default as ``kvstore config`` prints it: name, type, default, value, doc."""
    rows: list[dict[str, Any]] = []
    for entry in VARIABLES:
        text = entry.raw()
        shown = None if text is None else ("(set)" if entry.secret else text)
        rows.append(
            {
                "name": entry.name,
                "group": entry.group,
                "type": entry.type_name,
                "default": None if entry.default is None else str(entry.default),
                "value": shown,
                "doc": entry.doc,
            }
        )
    for default in DEFAULTS:
        rows.append(
            {
                "name": default.name,
                "group": "default",
                "type": type(default.value).__name__,
                "default": str(default.value),
                "value": None,
                "doc": default.doc,
            }
        )
    return rows
