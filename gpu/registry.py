"""The attention-backend registry: what each backend supports, as data; why it cannot run; selection.

Each backend is declared by a :class:`BackendSpec` (devices, cache tiers as ``kvstore.tiers`` names,
query dtypes, row widths, Python modules it needs, preference) next to the import path of its
class. Classes are imported only when a backend is chosen, so ``import kvstore.gpu`` never imports
cupy. A backend explains a refusal as a list of reasons: the spec's mismatches, then what its class
finds in the environment (no CUDA device, cupy missing, compute capability too old, ...).

A backend has one entry point, :meth:`AttentionBackend.decode` ``(q_lat, q_rope, batch,
softmax_scale, out=None)``, whatever the tier: the tier, the rows and the sequences travel in the
:class:`~kvstore.gpu.inputs.LatentBatch`. :func:`select` is the one place a backend is chosen, for
the engine's caches and the benchmarks alike; its :class:`Selection` holds the entry point to call.

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
>>> from kvstore.gpu.testing import make_case
>>> case = make_case("polar3", [5, 3], heads=2, kv_lora=512, qk_rope=64, seed=1)
>>> batch = LatentBatch.trusted(case.tier, case.lc_codes, case.lc_scales, case.rc_codes, case.rc_scales,
...                             case.seq_start, case.seq_len, kv_lora=512, qk_rope=64)
>>> tuple(choice.function(case.q_lat, case.q_rope, batch, case.softmax_scale).shape)
(2, 2, 512)
"""

from __future__ import annotations

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
from kvstore.gpu.inputs import LatentBatch

__all__ = [
    "AttentionBackend",
    "BackendSpec",
    "KERNEL_TIERS",
    "Selection",
    "as_tier",
    "backend_class",
    "get_backend",
    "instance",
    "reasons",
    "register_backend",
    "registered",
    "select",
    "spec_of",
    "unregister_backend",
]

#: The tiers a spec declares unless it names others: the quantized tiers of the CUDA kernels.
KERNEL_TIERS = (tiers.FP8.name, tiers.INT4.name)


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

    Subclasses set ``spec`` and implement :meth:`environment_reasons` and :meth:`decode`, the one
    entry point, for every tier the spec declares (dense and, when the spec says ``selected``,
    selected rows). ``tests/conformance/attention.py`` holds every backend to that, signature
    included.
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

    @abstractmethod
    def decode(
        self,
        q_lat: torch.Tensor,
        q_rope: torch.Tensor,
        batch: LatentBatch,
        softmax_scale: float,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Decode attention of one query token per sequence over the rows of ``batch``.

        For each query ``b`` and head ``h``: ``softmax(softmax_scale * (q_lat[b, h] . Lc[n] +
        q_rope[b, h] . Rc[n])) @ Lc`` over the rows ``n`` query ``b`` attends (see
        :class:`~kvstore.gpu.inputs.LatentBatch`); a query that attends no row gets zeros.

        Parameters
        ----------
        q_lat : f32[B, H, K]
            Absorbed queries (``q_nope @ W_UK``), K = ``batch.kv_lora``.
        q_rope : f32[B, H, R]
            Rope queries, R = ``batch.qk_rope``.
        batch : LatentBatch
            The rows, their tier and the sequences; when it is checked, the queries, the scale and
            ``out`` are checked against it first (:meth:`LatentBatch.check_call`).
        softmax_scale : float
        out : f32[B, H, K], optional
            Written in place and returned.

        Returns
        -------
        f32[B, H, K]
            The context in the latent space (un-rotated for the TQ tiers).

        Raises
        ------
        AttentionInputError
            A checked batch and a call that does not fit it.
        """


@dataclass(frozen=True)
class Selection:
    """The backend chosen for a tier on a device, and why the backends before it were passed over.

    Attributes
    ----------
    function : the chosen backend's entry point, ``function(q_lat, q_rope, batch, softmax_scale,
        out=None)`` (:meth:`AttentionBackend.decode`)
    backend : the chosen backend's name
    tier : the tier it decodes
    rejected : backend name -> reasons, for every backend tried before it
    """

    function: Callable[..., torch.Tensor]
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
    unknown = set(spec.tiers) - set(tiers.names())
    if unknown:
        raise ValueError(
            f"backend {spec.name!r} declares tiers {sorted(unknown)} that are not tier names {tiers.names()}"
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
    if entry.cls is not None:
        return entry.cls
    module_name, class_name = entry.path.split(":")
    found: type[AttentionBackend] = getattr(importlib.import_module(module_name), class_name)
    entry.cls = found
    return found


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
) -> Selection:
    """Choose the backend for ``tier`` on ``device``: the first, in preference order, that declares
    the configuration and whose environment allows it.

    Parameters
    ----------
    tier : a ``kvstore.tiers.Tier`` or its name
    device : the device of the rows and queries
    kv_lora, qk_rope : the row widths, for backends that run only some geometries
    prefer : a backend name tried first (e.g. ``"torch"``: skip the CUDA kernels in parity tests
        and benchmarks); the others still follow when it cannot run. Without one, the environment
        variable ``KVSTORE_ATTENTION_BACKEND`` names it (an operator's switch, read per call)
    q_dtype : the query dtype
    selected : batches with selected rows will be passed (backends whose spec has no
        selected-rows variant are passed over)

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
        return Selection(instance(name, device).decode, name, tier, rejected)
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
