"""Backend registry: what each attention backend supports, as data, and why it cannot run.

Each backend is declared by a :class:`BackendSpec` (devices, cache tiers, query dtypes, cache
geometries, Python modules it needs) next to the import path of its class. Classes are imported
only when a backend is chosen, so ``import kvstore.gpu`` never imports cupy. A backend explains a
refusal as a list of reasons: the spec's mismatches plus what its class finds in the environment
(no CUDA device, cupy missing, compute capability too old, ...).

Examples
--------
>>> import torch
>>> from kvstore.gpu import registry
>>> backend = registry.get_backend(torch.device("cpu"))
>>> backend.name
'torch'
>>> registry.reasons("torch", torch.device("cpu"), tier="fp8", kv_lora=512, qk_rope=64)
[]
>>> registry.reasons("torch", torch.device("cpu"), tier="polar")
["tier 'polar' is not one of ['fp8', 'tq-int4']"]
"""

from __future__ import annotations

import importlib
import importlib.util
import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from kvstore.gpu.errors import BackendUnavailable

__all__ = [
    "AttentionBackend",
    "BackendSpec",
    "TIERS",
    "backend_class",
    "get_backend",
    "reasons",
    "register_backend",
    "registered",
    "spec_of",
    "unregister_backend",
]

#: Cache tiers the decode kernels read (the engine's tier names).
TIERS = ("fp8", "tq-int4")


@dataclass(frozen=True)
class BackendSpec:
    """What a backend supports, as data.

    Attributes
    ----------
    name : registry key
    device_types : torch device types it runs on
    tiers : cache tiers it decodes
    q_dtypes : query dtypes it accepts
    kv_lora, qk_rope : row widths it runs; ``None`` means any width the tier allows
    modules : Python modules it imports (checked with ``importlib.util.find_spec``)
    priority : lower is preferred when several backends run on a device
    """

    name: str
    device_types: frozenset[str]
    tiers: frozenset[str] = frozenset(TIERS)
    q_dtypes: tuple[torch.dtype, ...] = (torch.float32,)
    kv_lora: tuple[int, ...] | None = None
    qk_rope: tuple[int, ...] | None = None
    modules: tuple[str, ...] = ()
    priority: int = 100

    def mismatches(
        self,
        device: torch.device | None = None,
        tier: str | None = None,
        kv_lora: int | None = None,
        qk_rope: int | None = None,
        q_dtype: torch.dtype | None = None,
    ) -> list[str]:
        """Reasons, from the declared data alone, that this backend cannot run a configuration."""
        out = []
        if device is not None and device.type not in self.device_types:
            out.append(f"runs on {sorted(self.device_types)}, not {device.type}")
        if tier is not None and tier not in self.tiers:
            out.append(f"tier {tier!r} is not one of {sorted(self.tiers)}")
        if q_dtype is not None and q_dtype not in self.q_dtypes:
            out.append(f"query dtype {q_dtype} is not one of {[str(d) for d in self.q_dtypes]}")
        if kv_lora is not None and self.kv_lora is not None and kv_lora not in self.kv_lora:
            out.append(f"kv_lora={kv_lora} is not one of {list(self.kv_lora)}")
        if qk_rope is not None and self.qk_rope is not None and qk_rope not in self.qk_rope:
            out.append(f"qk_rope={qk_rope} is not one of {list(self.qk_rope)}")
        for module in self.modules:
            if importlib.util.find_spec(module) is None:
                out.append(f"Python module {module!r} is not installed")
        return out


class AttentionBackend(ABC):
    """A decode-attention implementation; the four kernels share the signatures of :mod:`kvstore.gpu`.

    Subclasses set ``spec`` and implement :meth:`environment_reasons` and the four kernels.
    """

    spec: ClassVar[BackendSpec]

    def __init__(self, device: torch.device):
        self.device = torch.device(device)

    @property
    def name(self) -> str:
        return self.spec.name

    @classmethod
    @abstractmethod
    def environment_reasons(cls, device: torch.device) -> list[str]:
        """Why this backend cannot run on ``device`` in this process (empty: it can)."""

    @classmethod
    def why_not(
        cls,
        device: torch.device,
        tier: str | None = None,
        kv_lora: int | None = None,
        qk_rope: int | None = None,
        q_dtype: torch.dtype | None = None,
    ) -> list[str]:
        """Every reason this backend cannot run the configuration (empty: it can)."""
        out = cls.spec.mismatches(device, tier, kv_lora, qk_rope, q_dtype)
        if not out:
            out = cls.environment_reasons(device)
        return out

    @abstractmethod
    def mla_decode_fp8(self, q_lat, q_rope, lc_codes, lc_scales, rc_codes, rc_scales, seq_start, seq_len,
                       softmax_scale, out=None, *, validate=True):
        """Dense decode attention over an fp8 latent cache (see :func:`kvstore.gpu.mla_decode_fp8`)."""

    @abstractmethod
    def mla_decode_int4(self, q_lat, q_rope, lc_codes, lc_radii, rc_codes, rc_radii, seq_start, seq_len,
                        softmax_scale, out=None, *, validate=True):
        """Dense decode attention over a rotated-int4 cache (see :func:`kvstore.gpu.mla_decode_int4`)."""

    @abstractmethod
    def mla_decode_fp8_selected(self, q_lat, q_rope, lc_codes, lc_scales, rc_codes, rc_scales, seq_start,
                                seq_len, indices, n_selected, softmax_scale, out=None, *, validate=True):
        """Selected-rows decode over an fp8 cache (see :func:`kvstore.gpu.mla_decode_fp8_selected`)."""

    @abstractmethod
    def mla_decode_int4_selected(self, q_lat, q_rope, lc_codes, lc_radii, rc_codes, rc_radii, seq_start,
                                 seq_len, indices, n_selected, softmax_scale, out=None, *, validate=True):
        """Selected-rows decode over an int4 cache (see :func:`kvstore.gpu.mla_decode_int4_selected`)."""


@dataclass
class _Entry:
    spec: BackendSpec
    path: str  # "module:Class", imported on first use
    cls: type[AttentionBackend] | None = field(default=None, repr=False)


_REGISTRY: dict[str, _Entry] = {}
_INSTANCES: dict[tuple[str, str], AttentionBackend] = {}
_LOCK = threading.Lock()


def register_backend(spec: BackendSpec, path: str) -> None:
    """Register (or replace) a backend: its spec and the ``"module:Class"`` that implements it."""
    if ":" not in path:
        raise ValueError(f"backend path must be 'module:Class', got {path!r}")
    with _LOCK:
        _REGISTRY[spec.name] = _Entry(spec, path)
        for key in [k for k in _INSTANCES if k[0] == spec.name]:
            del _INSTANCES[key]


def unregister_backend(name: str) -> None:
    """Remove backend ``name`` (and its cached instances) from the registry."""
    with _LOCK:
        _REGISTRY.pop(name, None)
        for key in [k for k in _INSTANCES if k[0] == name]:
            del _INSTANCES[key]


def registered() -> dict[str, BackendSpec]:
    """Name -> spec of every registered backend, in preference order."""
    return {e.spec.name: e.spec for e in sorted(_REGISTRY.values(), key=lambda e: e.spec.priority)}


def spec_of(name: str) -> BackendSpec:
    """The declared spec of backend ``name``."""
    entry = _REGISTRY.get(name)
    if entry is None:
        raise BackendUnavailable(f"no backend named {name!r}; registered: {sorted(_REGISTRY)}")
    return entry.spec


def backend_class(name: str) -> type[AttentionBackend]:
    """Import (once) and return the class of backend ``name``."""
    entry = _REGISTRY.get(name)
    if entry is None:
        raise BackendUnavailable(f"no backend named {name!r}; registered: {sorted(_REGISTRY)}")
    if entry.cls is None:
        module_name, class_name = entry.path.split(":")
        entry.cls = getattr(importlib.import_module(module_name), class_name)
    return entry.cls


def reasons(
    name: str,
    device: torch.device | str,
    tier: str | None = None,
    kv_lora: int | None = None,
    qk_rope: int | None = None,
    q_dtype: torch.dtype | None = None,
) -> list[str]:
    """Why backend ``name`` cannot run the configuration on ``device`` (empty: it can).

    The spec's declared data is checked first; the class is imported (and the environment probed)
    only when the data allows the configuration.
    """
    device = torch.device(device)
    entry = _REGISTRY.get(name)
    if entry is None:
        return [f"no backend named {name!r}"]
    out = entry.spec.mismatches(device, tier, kv_lora, qk_rope, q_dtype)
    if out:
        return out
    try:
        cls = backend_class(name)
    except ImportError as exc:
        return [f"cannot import {entry.path}: {exc}"]
    return cls.environment_reasons(device)


def get_backend(device: torch.device | str) -> AttentionBackend:
    """The preferred backend that runs on ``device`` (instances are cached per device).

    Raises
    ------
    BackendUnavailable
        When no registered backend can run there; ``.reasons`` holds each backend's reasons.
    """
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device() if torch.cuda.is_available() else 0)
    key_device = str(device)
    rejected: dict[str, list[str]] = {}
    for name in registered():
        cached = _INSTANCES.get((name, key_device))
        if cached is not None:
            return cached
        why = reasons(name, device)
        if why:
            rejected[name] = why
            continue
        instance = backend_class(name)(device)
        with _LOCK:
            _INSTANCES[(name, key_device)] = instance
        return instance
    detail = "; ".join(f"{name}: {', '.join(why)}" for name, why in rejected.items())
    raise BackendUnavailable(f"no attention backend runs on {device}: {detail}", rejected)


# The built-in backends, most specific first. CUDA kernels need cvt.e4m3x2 (sm_89) and
# mma.sync f16 (sm_80); the torch path runs wherever torch does.
register_backend(
    BackendSpec(
        name="cuda",
        device_types=frozenset({"cuda"}),
        kv_lora=(128, 256, 512),
        qk_rope=(32, 64),
        modules=("cupy",),
        priority=10,
    ),
    "kvstore.gpu.cuda_backend:CudaBackend",
)
register_backend(
    BackendSpec(name="mps", device_types=frozenset({"mps"}), priority=20),
    "kvstore.gpu.torch_backend:MpsBackend",
)
register_backend(
    BackendSpec(name="torch", device_types=frozenset({"cpu", "cuda"}), priority=90),
    "kvstore.gpu.torch_backend:TorchBackend",
)
