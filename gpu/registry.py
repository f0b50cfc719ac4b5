"""The attention-backend registry: what each backend supports, as data; why it cannot run; selection.

Each backend is declared by a :class:`BackendSpec` (devices, cache tiers as ``kvstore.tiers`` names,
query dtypes, row widths, Python modules it needs, preference) next to the import path of its
class. Classes are imported only when a backend is chosen, so ``import kvstore.gpu`` never imports
cupy. A backend explains a refusal as a list of reasons: the spec's mismatches, then what its class
finds in the environment (no CUDA device, cupy missing, compute capability too old, ...).

A backend implements one method per kernel of :data:`KERNELS` for each tier it declares (and the
``*_selected`` variant when its spec says ``selected``), all with the signature of
:func:`kvstore.gpu.mla_decode_fp8`. :func:`select` is the one place a decode function is chosen, for
the engine's caches and the benchmarks alike.

Examples
--------
>>> import torch
>>> from kvstore.gpu import registry
>>> registry.get_backend(torch.device("cpu")).name
'torch'
>>> registry.reasons("torch", torch.device("cpu"), tier="fp8", kv_lora=512, qk_rope=64)
[]
>>> registry.reasons("cuda", torch.device("cpu"), tier="polar3")[:2]  # (and cupy's absence, where it is)
["runs on ['cuda'], not cpu", "tier 'polar3' is not one of ['fp8', 'int4']"]
>>> choice = registry.select("polar3", "cpu", kv_lora=512, qk_rope=64)
>>> choice.backend, choice.tier.name, choice.rejected["cuda"][:2]
('torch', 'polar3', ["runs on ['cuda'], not cpu", "tier 'polar3' is not one of ['fp8', 'int4']"])
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Callable, ClassVar

import torch

from kvstore import config, tiers
from kvstore.gpu.codecs import as_tier
from kvstore.gpu.errors import BackendUnavailable

__all__ = [
    "AttentionBackend",
    "BackendSpec",
    "KERNELS",
    "KERNEL_TIERS",
    "Selection",
    "as_tier",
    "backend_class",
    "get_backend",
    "instance",
    "kernel_name",
    "reasons",
    "register_backend",
    "registered",
    "select",
    "spec_of",
    "unregister_backend",
]

#: The method a backend implements for each tier (``<method>_selected`` for the selected-rows variant).
KERNELS: dict[str, str] = {
    tiers.F32.name: "mla_decode_dense",
    tiers.BF16.name: "mla_decode_dense",
    tiers.FP8.name: "mla_decode_fp8",
    tiers.INT4.name: "mla_decode_int4",
    **{tiers.polar(bits).name: "mla_decode_polar" for bits in tiers.POLAR_BITS},
    tiers.Q8.name: "mla_decode_q8",
}
#: The tiers of the public ``kvstore.gpu.mla_decode_*`` functions: what a spec declares by default.
KERNEL_TIERS = (tiers.FP8.name, tiers.INT4.name)


def kernel_name(tier: tiers.Tier | str, *, selected: bool = False) -> str:
    """The backend method that decodes ``tier`` (``mla_decode_fp8``, ``mla_decode_polar_selected``, ...)."""
    name = KERNELS[as_tier(tier).name]
    return f"{name}_selected" if selected else name


@dataclass(frozen=True)
class BackendSpec:
    """What a backend supports, as data.

    Attributes
    ----------
    name : registry key
    device_types : torch device types it runs on
    tiers : ``kvstore.tiers`` names it decodes
    selected : it has the selected-rows variant of every tier it decodes
    q_dtypes : query dtypes it accepts
    kv_lora, qk_rope : row widths it runs; ``None`` means any width the tier allows
    modules : Python modules it imports (checked with ``importlib.util.find_spec``)
    priority : lower is preferred when several backends run on a device
    """

    name: str
    device_types: frozenset[str]
    tiers: frozenset[str] = frozenset(KERNEL_TIERS)
    selected: bool = True
    q_dtypes: tuple[torch.dtype, ...] = (torch.float32,)
    kv_lora: tuple[int, ...] | None = None
    qk_rope: tuple[int, ...] | None = None
    modules: tuple[str, ...] = ()
    priority: int = 100

    def mismatches(
        self,
        device: torch.device | None = None,
        tier: tiers.Tier | str | None = None,
        kv_lora: int | None = None,
        qk_rope: int | None = None,
        q_dtype: torch.dtype | None = None,
    ) -> list[str]:
        """Reasons, from the declared data alone, that this backend cannot run a configuration."""
        out = []
        if device is not None and device.type not in self.device_types:
            out.append(f"runs on {sorted(self.device_types)}, not {device.type}")
        if tier is not None:
            try:
                name = as_tier(tier).name
            except tiers.UnknownTier as exc:
                out.append(exc.reason)
            else:
                if name not in self.tiers:
                    out.append(f"tier {name!r} is not one of {sorted(self.tiers, key=tiers.names().index)}")
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
    """A decode-attention implementation on one device.

    Subclasses set ``spec``, implement :meth:`environment_reasons`, and define the method of
    :data:`KERNELS` for every tier the spec declares (``mla_decode_fp8(q_lat, q_rope, lc_codes,
    lc_scales, rc_codes, rc_scales, seq_start, seq_len, softmax_scale, out=None, *, validate=True)``
    and the same shape for the others: ``mla_decode_dense`` takes ``lc, rc`` without scales,
    ``mla_decode_polar`` also takes ``bits=`` by keyword; ``*_selected`` adds ``indices, n_selected``
    before ``softmax_scale``). ``tests/conformance/attention.py`` holds every backend to that.
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
    def configuration_reasons(
        cls, device: torch.device, tier: tiers.Tier | str, kv_lora: int | None, qk_rope: int | None
    ) -> list[str]:
        """Why this backend, which runs on ``device``, cannot run this tier and geometry there
        (a kernel needing more of the device than it has); empty by default."""
        return []

    @classmethod
    def device_reasons(
        cls, device: torch.device, tier: tiers.Tier | str | None, kv_lora: int | None, qk_rope: int | None
    ) -> list[str]:
        """What the device says against a configuration its spec allows: the environment's
        reasons, then (a tier named) the configuration's."""
        out = cls.environment_reasons(device)
        if not out and tier is not None:
            out = cls.configuration_reasons(device, tier, kv_lora, qk_rope)
        return out

    @classmethod
    def why_not(
        cls,
        device: torch.device,
        tier: tiers.Tier | str | None = None,
        kv_lora: int | None = None,
        qk_rope: int | None = None,
        q_dtype: torch.dtype | None = None,
    ) -> list[str]:
        """Every reason this backend cannot run the configuration (empty: it can)."""
        return cls.spec.mismatches(device, tier, kv_lora, qk_rope, q_dtype) or cls.device_reasons(
            device, tier, kv_lora, qk_rope
        )

    def function(self, tier: tiers.Tier | str, *, selected: bool = False, trusted: bool = False) -> Callable:
        """The decode function of ``tier``, with the bits of a PolarQuant tier bound.

        ``trusted`` binds ``validate=False``: for callers that build the operands themselves (the
        engine's caches: sequences within the rows they pass), where validation would cost a host
        synchronization per call.

        Raises
        ------
        BackendUnavailable
            The backend does not decode ``tier`` (or its selected variant).
        """
        tier = as_tier(tier)
        why = self.spec.mismatches(tier=tier)
        if selected and not self.spec.selected:
            why.append("it has no selected-rows variants")
        if why:
            raise BackendUnavailable(
                f"backend {self.name} cannot decode {tier.name}: {'; '.join(why)}", {self.name: why}
            )
        method = getattr(self, kernel_name(tier, selected=selected))
        bound = {}
        if tier.codec_name == "polar":
            bound["bits"] = tier.bits
        if trusted:
            bound["validate"] = False
        return functools.partial(method, **bound) if bound else method


@dataclass(frozen=True)
class Selection:
    """The decode function chosen for a tier on a device, and why the backends before it were passed over.

    Attributes
    ----------
    function : ``function(q_lat, q_rope, *row operands, seq_start, seq_len, softmax_scale, out=None)``
    backend : the chosen backend's name
    tier : the tier it decodes
    rejected : backend name -> reasons, for every backend tried before it
    """

    function: Callable
    backend: str
    tier: tiers.Tier
    rejected: dict[str, list[str]] = field(default_factory=dict)


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
    unknown = set(spec.tiers) - set(KERNELS)
    if unknown:
        raise ValueError(
            f"backend {spec.name!r} declares tiers {sorted(unknown)} that are not tier names {sorted(KERNELS)}"
        )
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


def _entry(name: str) -> _Entry:
    entry = _REGISTRY.get(name)
    if entry is None:
        raise BackendUnavailable(f"no backend named {name!r}; registered: {sorted(_REGISTRY)}")
    return entry


def spec_of(name: str) -> BackendSpec:
    """The declared spec of backend ``name``."""
    return _entry(name).spec


def backend_class(name: str) -> type[AttentionBackend]:
    """Import (once) and return the class of backend ``name``."""
    entry = _entry(name)
    if entry.cls is None:
        module_name, class_name = entry.path.split(":")
        entry.cls = getattr(importlib.import_module(module_name), class_name)
    return entry.cls


def reasons(
    name: str,
    device: torch.device | str,
    tier: tiers.Tier | str | None = None,
    kv_lora: int | None = None,
    qk_rope: int | None = None,
    q_dtype: torch.dtype | None = None,
) -> list[str]:
    """Why backend ``name`` cannot run the configuration on ``device`` (empty: it can).

    The spec's declared data is checked first; the class is imported (and the environment probed)
    only when the data allows the configuration, and the configuration is put to the device
    (:meth:`AttentionBackend.configuration_reasons`) only when the environment allows the backend.
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
    return cls.device_reasons(device, tier, kv_lora, qk_rope)


def _normalized(device: torch.device | str) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device() if torch.cuda.is_available() else 0)
    return device


def instance(name: str, device: torch.device | str) -> AttentionBackend:
    """Backend ``name`` on ``device`` (one instance per backend and device), without checking reasons."""
    device = _normalized(device)
    key = (name, str(device))
    found = _INSTANCES.get(key)
    if found is None:
        found = backend_class(name)(device)
        with _LOCK:
            found = _INSTANCES.setdefault(key, found)
    return found


def get_backend(device: torch.device | str) -> AttentionBackend:
    """The preferred backend that runs on ``device`` (instances are cached per device).

    Raises
    ------
    BackendUnavailable
        When no registered backend can run there; ``.reasons`` holds each backend's reasons.
    """
    device = _normalized(device)
    rejected: dict[str, list[str]] = {}
    for name in registered():
        if (name, str(device)) in _INSTANCES:
            return _INSTANCES[(name, str(device))]
        why = reasons(name, device)
        if why:
            rejected[name] = why
            continue
        return instance(name, device)
    detail = "; ".join(f"{name}: {', '.join(why)}" for name, why in rejected.items())
    raise BackendUnavailable(f"no attention backend runs on {device}: {detail}", rejected)


def select(
    tier: tiers.Tier | str,
    device: torch.device | str,
    *,
    kv_lora: int | None = None,
    qk_rope: int | None = None,
    prefer: str | None = None,
    q_dtype: torch.dtype = torch.float32,
    selected: bool = False,
    trusted: bool = True,
) -> Selection:
    """Choose the decode function for ``tier`` on ``device``: the first backend, in preference
    order, that declares the configuration and whose environment allows it.

    Parameters
    ----------
    tier : a ``kvstore.tiers.Tier`` or its name
    device : the device of the rows and queries
    kv_lora, qk_rope : the row widths, for backends that run only some geometries
    prefer : a backend name tried first (e.g. ``"torch"``: skip the CUDA kernels in parity tests
        and benchmarks); the others still follow when it cannot run. Without one, the environment
        variable ``KVSTORE_ATTENTION_BACKEND`` names it (an operator's switch, read per call)
    q_dtype : the query dtype
    selected : the selected-rows variant
    trusted : bind ``validate=False`` (see :meth:`AttentionBackend.function`)

    Returns
    -------
    Selection

    Raises
    ------
    BackendUnavailable
        No backend can run it; ``.reasons`` holds each backend's reasons.
    UnknownTier
        ``tier`` names no tier.
    """
    tier = as_tier(tier)
    device = _normalized(device)
    order = list(registered())
    if prefer is None:
        prefer = config.ATTENTION_BACKEND.get()
    if prefer is not None:
        if prefer not in _REGISTRY:
            raise BackendUnavailable(f"no backend named {prefer!r}; registered: {sorted(_REGISTRY)}")
        order.remove(prefer)
        order.insert(0, prefer)
    rejected: dict[str, list[str]] = {}
    for name in order:
        why = reasons(name, device, tier, kv_lora, qk_rope, q_dtype)
        if selected and not spec_of(name).selected:
            why.append("it has no selected-rows variants")
        if why:
            rejected[name] = why
            continue
        function = instance(name, device).function(tier, selected=selected, trusted=trusted)
        return Selection(function, name, tier, rejected)
    detail = "; ".join(f"{name}: {', '.join(why)}" for name, why in rejected.items())
    raise BackendUnavailable(f"no decode backend for tier {tier.name} on {device}: {detail}", rejected)


# The built-in backends, most specific first. CUDA kernels need cvt.e4m3x2 (sm_89) and
# mma.sync f16 (sm_80); the torch path runs wherever torch does, every tier.
register_backend(
    BackendSpec(
        name="cuda",
        device_types=frozenset({"cuda"}),
        tiers=frozenset(KERNEL_TIERS),
        kv_lora=(128, 256, 512),
        qk_rope=(32, 64),
        modules=("cupy",),
        priority=10,
    ),
    "kvstore.gpu.cuda_backend:CudaBackend",
)
# f32 and bf16 rows on CUDA: the split-T Triton kernels (tf32x3 tensor-core products).
register_backend(
    BackendSpec(
        name="triton",
        device_types=frozenset({"cuda"}),
        tiers=frozenset({tiers.F32.name, tiers.BF16.name}),
        selected=False,
        modules=("triton",),
        priority=15,
    ),
    "kvstore.gpu.triton_backend:TritonBackend",
)
register_backend(
    BackendSpec(name="mps", device_types=frozenset({"mps"}), tiers=frozenset(tiers.names()), priority=20),
    "kvstore.gpu.torch_backend:MpsBackend",
)
register_backend(
    BackendSpec(
        name="torch", device_types=frozenset({"cpu", "cuda", "mps", "xpu"}), tiers=frozenset(tiers.names()), priority=90
    ),
    "kvstore.gpu.torch_backend:TorchBackend",
)
