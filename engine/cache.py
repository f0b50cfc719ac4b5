"""Latent-cache tiers behind one interface, on any torch device (cpu, cuda, mps).

A cache holds, per layer and position, the two rows a ``.coli_kv`` record stores: ``Lc`` (the
normed latent, ``kv_lora`` wide) and ``Rc`` (the roped shared key, ``qk_rope`` wide), in the tier's
representation, plus the token id of each position. Rows are quantized when written and read
back through dequantization (or attended directly by the tier's decode backend).

======== ================================================= ============== ========================
tier     stored per row                                    journal rows   bytes / token
======== ================================================= ============== ========================
f32      f32 values                                        v1             L * (K + R) * 4
bf16     bf16 values                                       v1 (upcast)    L * (K + R) * 2
fp8      e4m3 codes + f32 scale                            v2             L * (K + R + 8)
tq-int4  packed rotated-int4 codes + f32 radius            v3 codec 1     L * (K/2 + R/2 + 8)
tq-polar packed PolarQuant codes (b bits) + f32 radius     v3 codec 0     L * (rb(K) + rb(R) + 8)
int8     Q8_0: int8 codes + one f16 delta per 32 values    v1 (dequant)   L * (K + R + (K+R)/16)
======== ================================================= ============== ========================

Use: :func:`make_cache`; then per forward ``prepare(start, t)`` -> the model ``write``\\ s rows ->
``commit(start, tokens)``. ``restore`` swaps in rows from the journal all-or-nothing: stored
rows of the tier's own version go in as they are (no dequantize/requantize round trip).
``restore_records`` / ``restore_body`` do the same from ``.coli_kv`` records on the device
(``engine/restore.py``: one read, one upload, the split into fields there); ``restore`` of
host-side ``StoredRows`` is the reference they are tested against.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from kvstore.engine import quant
from kvstore.engine.attention import DecodeChoice, select_decode
from kvstore.engine.errors import CacheError, CodecMismatch, GeometryMismatch, TierUnsupported
from kvstore import tiers

__all__ = [
    "CacheGeometry",
    "LatentCache",
    "StoredRows",
    "TIERS",
    "make_cache",
    "tier_bytes_per_token",
]

# Capacity grows by at least this factor so appending one token at a time stays amortized O(1).
_GROWTH = 1.5
_MIN_CAPACITY = 256


@dataclass(frozen=True)
class CacheGeometry:
    """Row widths of a model's latent cache."""

    n_layers: int
    kv_lora: int
    qk_rope: int

    @classmethod
    def of(cls, source) -> "CacheGeometry":
        """From a CacheGeometry, a ModelConfig, or a ``.coli_kv`` Geometry."""
        if isinstance(source, CacheGeometry):
            return source
        if hasattr(source, "kv_lora_rank"):
            return cls(source.num_hidden_layers, source.kv_lora_rank, source.qk_rope_head_dim)
        if hasattr(source, "kv_lora"):
            return cls(source.n_layers, source.kv_lora, source.qk_rope)
        raise TypeError(f"cannot take a cache geometry from {type(source).__name__}")


# -- rows as the journal stores them ---------------------------------------------------------------


@dataclass
class StoredRows:
    """Rows in a ``.coli_kv`` version, layer-major, on the host.

    ``version`` 1: ``lc`` f32[n_layers, n, kv_lora], ``rc`` f32[n_layers, n, qk_rope], no scales.
    ``version`` 2: fp8 codes u8[n_layers, n, width] and per-row scales f32[n_layers, n].
    ``version`` 3: packed TQ codes u8[n_layers, n, rb(width)] and radii f32[n_layers, n]
    (``codec`` 0 polar / 1 int4, ``bits``).
    """

    tokens: np.ndarray
    version: int
    lc: np.ndarray
    rc: np.ndarray
    lc_scales: np.ndarray | None = None
    rc_scales: np.ndarray | None = None
    codec: int | None = None
    bits: int | None = None

    @property
    def n(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def n_layers(self) -> int:
        return int(self.lc.shape[0])

    def tier(self):
        """The ``kvstore.formats.coli_kv.Tier`` of these rows."""
        from kvstore.formats.coli_kv import Tier

        return tiers.from_file(self.version, self.codec, self.bits)

    @classmethod
    def from_records(cls, records) -> "StoredRows":
        """The rows of a loaded ``.coli_kv`` file (``KVRecords``), sanitized, without decoding codes."""
        tier = records.tier
        tokens = np.ascontiguousarray(records.tokens, dtype=np.int32)
        if tier.version == 1:
            lc, rc, _ = records.dequantize()
            return cls(tokens, 1, lc, rc)
        lc, lc_scales = records.quantized("L")
        rc, rc_scales = records.quantized("R")
        return cls(tokens, tier.version, lc, rc, lc_scales, rc_scales, tier.codec, tier.bits)

    def dequantize(self, kv_lora: int, qk_rope: int) -> tuple[np.ndarray, np.ndarray]:
        """f32 rows (L [n_layers, n, kv_lora], R [n_layers, n, qk_rope]) through the format codecs."""
        if self.version == 1:
            return np.asarray(self.lc, np.float32), np.asarray(self.rc, np.float32)
        if self.version == 2:
            from kvstore.formats import fp8

            return fp8.dequantize_rows(self.lc, self.lc_scales), fp8.dequantize_rows(self.rc, self.rc_scales)
        from kvstore.formats import tq

        out = []
        for codes, radii, width in ((self.lc, self.lc_scales, kv_lora), (self.rc, self.rc_scales, qk_rope)):
            with np.errstate(over="ignore", invalid="ignore"):
                rows = tq.dequantize_rows(codes, radii, width, self.codec, self.bits)
            # A radius near the f32 limit (only a damaged file has one) overflows on the way back:
            # such a row reads as zeros, as KVRecords.dequantize reads it.
            rows[~np.isfinite(rows).all(axis=-1)] = 0.0
            out.append(rows)
        return out[0], out[1]

    def record_array(self, geometry) -> np.ndarray:
        """The rows as ``.coli_kv`` records (structured array; ``.tobytes()`` is a file body).

        Codes and scales are copied as they are: no dequantize/requantize round trip.
        """
        from kvstore.formats import coli_kv

        tier = self.tier()
        records = np.zeros(self.n, dtype=coli_kv.record_dtype(geometry, tier))
        records["token"] = self.tokens
        layers = records["layers"]
        layers["Lc"] = self.lc.transpose(1, 0, 2)
        layers["Rc"] = self.rc.transpose(1, 0, 2)
        if self.version != 1:
            layers["Ls"] = self.lc_scales.T
            layers["Rs"] = self.rc_scales.T
        return records

    def encode_file(self, geometry) -> bytes:
        """A complete ``.coli_kv`` image (header with ``nrec = n`` + records) for ``geometry``."""
        from kvstore.formats import coli_kv

        records = self.record_array(geometry)
        return coli_kv.Header(geometry, self.tier(), self.n).to_bytes() + records.tobytes()


# -- the cache interface ---------------------------------------------------------------------------


class LatentCache(ABC):
    """Per-layer latent rows of one sequence in one tier, on one device.

    Attributes
    ----------
    tier : str — the tier name
    geometry : CacheGeometry
    device : torch.device
    length : int — committed positions (rows ``0 .. length-1`` are valid)
    """

    tier: ClassVar[str]

    def __init__(self, geometry: CacheGeometry, device: torch.device | str = "cpu", capacity: int = 0, *, prefer_backend: str | None = None):
        self.geometry = CacheGeometry.of(geometry)
        self.device = torch.device(device)
        self._check_geometry()
        self._length = 0
        self._tokens = np.zeros(capacity, dtype=np.int32)
        self._fields = self._allocate(capacity)
        self._capacity = capacity
        self.decode_choice: DecodeChoice = select_decode(
            self.tier, self.device, prefer_backend, kv_lora=self.geometry.kv_lora, qk_rope=self.geometry.qk_rope
        )

    # -- what each tier defines --------------------------------------------------------------------
    @abstractmethod
    def _field_specs(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Per stored row: field name -> (trailing shape, dtype). Stored as [n_layers, capacity, *shape]."""

    @abstractmethod
    def _encode(self, lc: torch.Tensor, rc: torch.Tensor) -> dict[str, torch.Tensor]:
        """f32 rows [..., K] / [..., R] -> field tensors with the same leading shape."""

    @abstractmethod
    def _decode(self, fields: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Field tensors (leading shape [...]) -> f32 rows ([..., K], [..., R])."""

    @abstractmethod
    def _operands(self, fields: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """One layer's fields (rows 0..n-1) -> the row arguments of the tier's decode function."""

    @abstractmethod
    def _native(self, rows: StoredRows) -> dict[str, torch.Tensor] | None:
        """Stored rows of this tier's own version as fields on the device, else None."""

    @abstractmethod
    def _stored(self, fields: dict[str, np.ndarray], tokens: np.ndarray) -> StoredRows:
        """Host copies of fields [n_layers, n, ...] -> the tier's journal rows."""

    def _native_fields(self, tier) -> dict[str, str] | None:
        """Field -> ``.coli_kv`` record field (``Lc``/``Ls``/``Rc``/``Rs``) when records of ``tier``
        are this tier's own representation (the device restore copies them as they are), else None."""
        return None

    def _check_geometry(self) -> None:
        """Raise TierUnsupported if this tier cannot hold rows of this geometry."""

    def journal_tier(self):
        """The ``.coli_kv`` Tier that :meth:`export_rows` produces (what a journal of this cache holds)."""
        from kvstore.formats.coli_kv import Tier

        return tiers.F32

    # -- sizes ------------------------------------------------------------------------------------
    @property
    def length(self) -> int:
        return self._length

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def tokens(self) -> np.ndarray:
        """int32[length]: the token id of each cached position (a copy)."""
        return self._tokens[: self._length].copy()

    @property
    def bytes_per_token(self) -> int:
        """KV bytes one position takes over all layers (token id not counted)."""
        per_row = 0
        for shape, dtype in self._field_specs().values():
            per_row += int(np.prod(shape, dtype=np.int64)) * torch.empty((), dtype=dtype).element_size()
        return self.geometry.n_layers * per_row

    @property
    def nbytes(self) -> int:
        """Bytes allocated on the device for rows (capacity, not length)."""
        return sum(t.numel() * t.element_size() for t in self._fields.values())

    def __len__(self) -> int:
        return self._length

    def __repr__(self) -> str:
        g = self.geometry
        return (
            f"{type(self).__name__}(tier={self.tier!r}, layers={g.n_layers}, kv_lora={g.kv_lora}, "
            f"qk_rope={g.qk_rope}, length={self._length}, device={self.device}, backend={self.decode_choice.backend})"
        )

    # -- the model's side ---------------------------------------------------------------------------
    def prepare(self, start: int, t: int) -> None:
        """Make room for ``t`` rows at ``start``; rows past ``start`` are dropped.

        Raises
        ------
        CacheError
            When ``start`` is past the committed rows (a gap no row could fill).
        """
        if not 0 <= start <= self._length:
            raise CacheError(f"cannot write at position {start}: the cache holds {self._length} rows")
        self._length = start
        self.reserve(start + t)

    def write(self, layer: int, start: int, lc: torch.Tensor, rc: torch.Tensor) -> None:
        """Quantize and store rows ``lc`` [T, kv_lora], ``rc`` [T, qk_rope] of ``layer`` at ``start``."""
        t = lc.shape[0]
        if start + t > self._capacity:
            raise CacheError(f"rows {start}..{start + t - 1} are past the capacity {self._capacity}: call prepare() first")
        encoded = self._encode(lc.to(torch.float32), rc.to(torch.float32))
        for name, value in encoded.items():
            self._fields[name][layer, start : start + t] = value

    def read(self, layer: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows ``0 .. stop-1`` of ``layer`` through dequantization: (f32[stop, K], f32[stop, R])."""
        return self._decode({name: f[layer, :stop] for name, f in self._fields.items()})

    def attend(self, layer: int, q_lat, q_rope, seq_start, seq_len, softmax_scale: float, n_rows: int) -> torch.Tensor:
        """Absorbed decode attention over rows ``0 .. n_rows-1`` of ``layer``, through the tier's backend.

        Parameters
        ----------
        q_lat : f32[B, H, kv_lora], q_rope : f32[B, H, qk_rope]
        seq_start, seq_len : int32[B] — query b attends rows ``seq_start[b] .. +seq_len[b]-1``
        softmax_scale : float
        n_rows : rows the queries may reach (``max(seq_start + seq_len)``)

        Returns
        -------
        f32[B, H, kv_lora]: the attention context in latent space.
        """
        operands = self._operands({name: f[layer, :n_rows] for name, f in self._fields.items()})
        return self.decode_choice.function(q_lat, q_rope, *operands, seq_start, seq_len, softmax_scale)

    def commit(self, start: int, token_ids) -> None:
        """Publish the rows written at ``start ..`` for ``token_ids`` (int[T]): length becomes start+T."""
        ids = np.asarray(token_ids, dtype=np.int32).reshape(-1)
        stop = start + ids.shape[0]
        if start != self._length or stop > self._capacity:
            raise CacheError(f"commit of rows {start}..{stop - 1} does not follow the {self._length} committed rows")
        self._tokens[start:stop] = ids
        self._length = stop

    # -- sizes and state ------------------------------------------------------------------------------
    def reserve(self, n: int) -> None:
        """Grow the capacity to at least ``n`` rows, keeping the committed ones."""
        if n <= self._capacity:
            return
        capacity = max(n, int(self._capacity * _GROWTH), _MIN_CAPACITY)
        fields = self._allocate(capacity)
        for name, old in self._fields.items():
            fields[name][:, : self._length] = old[:, : self._length]
        tokens = np.zeros(capacity, dtype=np.int32)
        tokens[: self._length] = self._tokens[: self._length]
        self._fields, self._tokens, self._capacity = fields, tokens, capacity

    def truncate(self, n: int) -> None:
        """Keep the first ``n`` positions (a no-op when ``n >= length``)."""
        if n < 0:
            raise CacheError(f"cannot truncate to {n} rows")
        self._length = min(self._length, n)

    def clear(self) -> None:
        self._length = 0

    def _allocate(self, capacity: int, *, zeros: bool = True) -> dict[str, torch.Tensor]:
        n_layers = self.geometry.n_layers
        make = torch.zeros if zeros else torch.empty
        return {
            name: make((n_layers, capacity, *shape), dtype=dtype, device=self.device)
            for name, (shape, dtype) in self._field_specs().items()
        }

    # -- journal side ---------------------------------------------------------------------------------
    def export_rows(self, start: int = 0, stop: int | None = None) -> StoredRows:
        """Rows ``start .. stop-1`` in the tier's journal version, copied to the host (raw codes)."""
        start, stop = self._span(start, stop)
        fields = {name: self._to_host(f[:, start:stop]) for name, f in self._fields.items()}
        return self._stored(fields, self._tokens[start:stop].copy())

    def _to_host(self, field: torch.Tensor) -> np.ndarray:
        return field.cpu().numpy()

    def export_f32(self, start: int = 0, stop: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(tokens int32[n], L f32[n_layers, n, kv_lora], R f32[n_layers, n, qk_rope]) dequantized."""
        start, stop = self._span(start, stop)
        lc, rc = self._decode({name: f[:, start:stop] for name, f in self._fields.items()})
        return self._tokens[start:stop].copy(), lc.cpu().numpy(), rc.cpu().numpy()

    def _span(self, start: int, stop: int | None) -> tuple[int, int]:
        stop = self._length if stop is None else stop
        if not 0 <= start <= stop <= self._length:
            raise CacheError(f"rows {start}..{stop} are outside the {self._length} cached rows")
        return start, stop

    def restore(self, rows: StoredRows, *, allow_requantize: bool = False, headroom: int = _MIN_CAPACITY) -> None:
        """Replace the cache's content with ``rows``, all or nothing.

        Rows of the tier's own version are placed as stored (codes and scales/radii, no round
        trip); f32 (v1) rows are quantized into the tier; quantized rows restore into f32/bf16 by
        dequantization. Quantized rows of another kind would be quantized twice, which is lossy:
        that needs ``allow_requantize=True``.

        The new state is built completely before it replaces the old one: on any error the cache
        is unchanged.

        Raises
        ------
        GeometryMismatch, CodecMismatch, CacheError
        """
        g = self.geometry
        n = rows.n
        if rows.tokens.ndim != 1:
            raise CacheError(f"tokens must be 1-D, got shape {rows.tokens.shape}")
        if rows.lc.shape[:2] != (g.n_layers, n) or rows.rc.shape[:2] != (g.n_layers, n):
            raise GeometryMismatch(
                f"stored rows are [{rows.lc.shape[0]} layers, {rows.lc.shape[1]} rows], the cache has "
                f"{g.n_layers} layers and the rows carry {n} tokens"
            )
        fields = self._native(rows)
        if fields is None:
            if rows.version != 1 and not self._lossless_target() and not allow_requantize:
                raise CodecMismatch(
                    f"rows stored as {rows.tier().describe()} would be quantized again for the {self.tier} "
                    "tier (lossy): pass allow_requantize=True or migrate the file"
                )
            lc, rc = rows.dequantize(g.kv_lora, g.qk_rope)
            self._check_widths(lc.shape[-1], rc.shape[-1])
            fields = self._encode(torch.from_numpy(np.ascontiguousarray(lc)).to(self.device), torch.from_numpy(np.ascontiguousarray(rc)).to(self.device))
        capacity = n + max(0, headroom)
        full = self._allocate(capacity)
        for name, value in fields.items():
            full[name][:, :n] = value
        tokens = np.zeros(capacity, dtype=np.int32)
        tokens[:n] = rows.tokens
        # Everything is built: swap it in.
        self._fields, self._tokens, self._capacity, self._length = full, tokens, capacity, n

    def restore_records(self, records, *, expect=None, allow_requantize: bool = False, headroom: int = _MIN_CAPACITY) -> None:
        """Restore from a loaded ``.coli_kv`` file (``KVRecords``); ``expect`` is the model's Geometry.

        Goes through the device restore (:meth:`restore_body`): the records are uploaded as stored
        and split into the tier's fields on the device. Same result, byte for byte, as
        ``restore(StoredRows.from_records(records))``, the host path kept as the reference.
        """
        from kvstore.engine import restore as device_restore

        if expect is not None and records.geometry != expect:
            raise GeometryMismatch("the file is for another model: " + "; ".join(records.geometry.mismatches(expect)))
        self.restore_body(device_restore.MemoryBody(records), allow_requantize=allow_requantize, headroom=headroom)

    def restore_body(
        self, body, *, allow_requantize: bool = False, headroom: int = _MIN_CAPACITY, check_tokens=None, chunk_bytes: int | None = None
    ) -> None:
        """Replace the cache's content with the records of ``body``, all or nothing, on the device.

        Parameters
        ----------
        body : ``kvstore.engine.restore.FileBody`` (read straight into pinned memory) or
            ``MemoryBody`` (loaded records)
        allow_requantize : as in :meth:`restore`
        check_tokens : called with the tokens (int32[n]) before the new state replaces the old one;
            whatever it raises leaves the cache unchanged
        chunk_bytes : records per upload, in bytes (default ``restore.CHUNK_BYTES``)

        The records go once to the device and are split there into new capacity buffers (one
        allocation; rows past ``n`` zeroed), sanitized as the host loader does; conversions (v1 into
        a quantized tier, v2/v3 into f32/bf16) run per chunk on the device. Only when every row is
        in do the new buffers replace the old ones.

        Raises
        ------
        GeometryMismatch, CodecMismatch, and whatever reading or ``check_tokens`` raises.
        """
        from kvstore.engine import restore as device_restore

        g, stored = self.geometry, body.geometry
        if (stored.n_layers, stored.kv_lora, stored.qk_rope) != (g.n_layers, g.kv_lora, g.qk_rope):
            raise GeometryMismatch(
                f"stored rows are {stored.n_layers} layers of {stored.kv_lora}/{stored.qk_rope}, the cache holds "
                f"{g.n_layers} layers of {g.kv_lora}/{g.qk_rope}"
            )
        native = self._native_fields(body.tier)
        if native is not None:
            placement = device_restore.Placement(stored, body.tier, native=native)
        else:
            if body.tier.version != 1 and not self._lossless_target() and not allow_requantize:
                raise CodecMismatch(
                    f"rows stored as {body.tier.describe()} would be quantized again for the {self.tier} "
                    "tier (lossy): pass allow_requantize=True or migrate the file"
                )
            placement = device_restore.Placement(stored, body.tier, encode=self._encode)
        capacity = body.n + max(0, headroom)
        full = self._allocate(capacity, zeros=False)  # every row below n is written, the rest zeroed
        n, stored_tokens = device_restore.fill(body, full, placement, self.device, chunk_bytes=chunk_bytes)
        for value in full.values():
            value[:, n:].zero_()
        if check_tokens is not None:
            check_tokens(stored_tokens)
        tokens = np.zeros(capacity, dtype=np.int32)
        tokens[:n] = stored_tokens
        # Everything is built: swap it in.
        self._fields, self._tokens, self._capacity, self._length = full, tokens, capacity, n

    def copy(self) -> "LatentCache":
        """An independent cache with the same rows (e.g. to fork a conversation)."""
        clone = object.__new__(type(self))
        clone.__dict__.update(self.__dict__)
        clone._fields = {name: f.clone() for name, f in self._fields.items()}
        clone._tokens = self._tokens.copy()
        return clone

    def _lossless_target(self) -> bool:
        return False

    def _check_widths(self, kv_lora: int, qk_rope: int) -> None:
        g = self.geometry
        if (kv_lora, qk_rope) != (g.kv_lora, g.qk_rope):
            raise GeometryMismatch(f"rows are {kv_lora}/{qk_rope} wide, the cache holds {g.kv_lora}/{g.qk_rope}")


def _check_stored(rows: StoredRows, lc_width: int, rc_width: int) -> None:
    if rows.lc.shape[-1] != lc_width or rows.rc.shape[-1] != rc_width:
        raise GeometryMismatch(
            f"stored rows are {rows.lc.shape[-1]}/{rows.rc.shape[-1]} bytes or values wide, "
            f"the cache expects {lc_width}/{rc_width}"
        )


def _to_device(array: np.ndarray, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    tensor = torch.from_numpy(np.ascontiguousarray(array))
    return tensor.to(device=device, dtype=dtype) if dtype is not None else tensor.to(device)


class F32Cache(LatentCache):
    """Full-precision rows (v1)."""

    tier = "f32"
    dtype = torch.float32

    def _field_specs(self):
        g = self.geometry
        return {"lc": ((g.kv_lora,), self.dtype), "rc": ((g.qk_rope,), self.dtype)}

    def _encode(self, lc, rc):
        return {"lc": lc.to(self.dtype), "rc": rc.to(self.dtype)}

    def _decode(self, fields):
        return fields["lc"].float(), fields["rc"].float()

    def _operands(self, fields):
        return fields["lc"], fields["rc"]

    def _native(self, rows):
        if rows.version != 1:
            return None
        _check_stored(rows, self.geometry.kv_lora, self.geometry.qk_rope)
        return {"lc": _to_device(rows.lc, self.device, self.dtype), "rc": _to_device(rows.rc, self.device, self.dtype)}

    def _stored(self, fields, tokens):
        return StoredRows(tokens, 1, fields["lc"].astype(np.float32), fields["rc"].astype(np.float32))

    def _native_fields(self, tier):
        # v1 rows are f32; a bf16 cache takes them through a converting copy on the device
        return {"lc": "Lc", "rc": "Rc"} if tier.version == 1 else None

    def _lossless_target(self):
        return True


class BF16Cache(F32Cache):
    """bf16 rows: half the f32 footprint; journals as v1 (bf16 widens to f32 exactly)."""

    tier = "bf16"
    dtype = torch.bfloat16

    def _to_host(self, field: torch.Tensor) -> np.ndarray:
        return field.float().cpu().numpy()  # numpy has no bf16; the widening is exact


class Fp8Cache(LatentCache):
    """fp8 e4m3 codes + one f32 scale per row (v2), quantized on the device."""

    tier = "fp8"

    def _field_specs(self):
        g = self.geometry
        return {
            "lc_codes": ((g.kv_lora,), torch.uint8),
            "lc_scales": ((), torch.float32),
            "rc_codes": ((g.qk_rope,), torch.uint8),
            "rc_scales": ((), torch.float32),
        }

    def _encode(self, lc, rc):
        lc_codes, lc_scales = quant.encode_fp8(lc)
        rc_codes, rc_scales = quant.encode_fp8(rc)
        return {"lc_codes": lc_codes, "lc_scales": lc_scales, "rc_codes": rc_codes, "rc_scales": rc_scales}

    def _decode(self, fields):
        return (
            quant.fp8_dequantize_rows(fields["lc_codes"], fields["lc_scales"]),
            quant.fp8_dequantize_rows(fields["rc_codes"], fields["rc_scales"]),
        )

    def _operands(self, fields):
        return fields["lc_codes"], fields["lc_scales"], fields["rc_codes"], fields["rc_scales"]

    def _native(self, rows):
        if rows.version != 2:
            return None
        _check_stored(rows, self.geometry.kv_lora, self.geometry.qk_rope)
        # loaded files are sanitized already; rows handed over directly get the same treatment
        lc_codes, lc_scales = quant.fp8_sanitize(_to_device(rows.lc, self.device), _to_device(rows.lc_scales, self.device, torch.float32))
        rc_codes, rc_scales = quant.fp8_sanitize(_to_device(rows.rc, self.device), _to_device(rows.rc_scales, self.device, torch.float32))
        return {"lc_codes": lc_codes, "lc_scales": lc_scales, "rc_codes": rc_codes, "rc_scales": rc_scales}

    def _stored(self, fields, tokens):
        return StoredRows(tokens, 2, fields["lc_codes"], fields["rc_codes"], fields["lc_scales"], fields["rc_scales"])

    def _native_fields(self, tier):
        if tier.version != 2:
            return None
        return {"lc_codes": "Lc", "lc_scales": "Ls", "rc_codes": "Rc", "rc_scales": "Rs"}

    def journal_tier(self):
        from kvstore.formats.coli_kv import Tier

        return tiers.FP8


class TQCache(LatentCache):
    """TurboQuant rows (v3): packed codes + one f32 radius per row; ``codec`` 1 int4, 0 polar."""

    codec: ClassVar[int]

    def __init__(self, geometry, device="cpu", capacity=0, *, bits: int = 4, prefer_backend: str | None = None):
        allowed = (4,) if self.codec == quant.CODEC_INT4 else tuple(range(2, 7))
        if bits not in allowed:
            raise TierUnsupported(f"{self.tier} takes bits {allowed}, got {bits}")
        self.bits = bits
        super().__init__(geometry, device, capacity, prefer_backend=prefer_backend)
        if self.codec == quant.CODEC_POLAR:
            fn = self.decode_choice.function
            self.decode_choice = DecodeChoice(functools.partial(fn, bits=bits), self.decode_choice.backend, self.decode_choice.rejected)

    def _check_geometry(self):
        g = self.geometry
        for name, width in (("kv_lora", g.kv_lora), ("qk_rope", g.qk_rope)):
            if not quant.tq_width_ok(width):
                raise TierUnsupported(f"{self.tier} needs power-of-two row widths in 2..2048; {name} is {width}")

    def _row_bytes(self, width: int) -> int:
        return quant.tq_row_bytes(width, self.codec, self.bits)

    def _field_specs(self):
        g = self.geometry
        return {
            "lc_codes": ((self._row_bytes(g.kv_lora),), torch.uint8),
            "lc_radii": ((), torch.float32),
            "rc_codes": ((self._row_bytes(g.qk_rope),), torch.uint8),
            "rc_radii": ((), torch.float32),
        }

    def _quantize(self, rows):
        if self.codec == quant.CODEC_INT4:
            return quant.encode_int4(rows)
        return quant.encode_polar(rows, self.bits)

    def _dequantize(self, codes, radii, width):
        if self.codec == quant.CODEC_INT4:
            return quant.int4_dequantize_rows(codes, radii)
        return quant.polar_dequantize_rows(codes, radii, width, self.bits)

    def _encode(self, lc, rc):
        lc_codes, lc_radii = self._quantize(lc)
        rc_codes, rc_radii = self._quantize(rc)
        return {"lc_codes": lc_codes, "lc_radii": lc_radii, "rc_codes": rc_codes, "rc_radii": rc_radii}

    def _decode(self, fields):
        g = self.geometry
        return (
            self._dequantize(fields["lc_codes"], fields["lc_radii"], g.kv_lora),
            self._dequantize(fields["rc_codes"], fields["rc_radii"], g.qk_rope),
        )

    def _operands(self, fields):
        return fields["lc_codes"], fields["lc_radii"], fields["rc_codes"], fields["rc_radii"]

    def _native(self, rows):
        if rows.version != 3 or rows.codec != self.codec or rows.bits != self.bits:
            return None
        g = self.geometry
        _check_stored(rows, self._row_bytes(g.kv_lora), self._row_bytes(g.qk_rope))
        return {
            "lc_codes": _to_device(rows.lc, self.device),
            "lc_radii": _to_device(rows.lc_scales, self.device, torch.float32),
            "rc_codes": _to_device(rows.rc, self.device),
            "rc_radii": _to_device(rows.rc_scales, self.device, torch.float32),
        }

    def _stored(self, fields, tokens):
        return StoredRows(
            tokens, 3, fields["lc_codes"], fields["rc_codes"], fields["lc_radii"], fields["rc_radii"], self.codec, self.bits
        )

    def _native_fields(self, tier):
        if tier.version != 3 or tier.codec != self.codec or tier.bits != self.bits:
            return None
        return {"lc_codes": "Lc", "lc_radii": "Ls", "rc_codes": "Rc", "rc_radii": "Rs"}

    def journal_tier(self):
        from kvstore.formats.coli_kv import Tier

        return tiers.from_file(3, self.codec, self.bits)


class Int4Cache(TQCache):
    tier = "tq-int4"
    codec = quant.CODEC_INT4


class PolarCache(TQCache):
    tier = "tq-polar"
    codec = quant.CODEC_POLAR


class Q8Cache(LatentCache):
    """Q8_0 blocks: int8 codes + one f16 delta per 32 values. No ``.coli_kv`` version: journals as v1."""

    tier = "int8"

    def _check_geometry(self):
        g = self.geometry
        for name, width in (("kv_lora", g.kv_lora), ("qk_rope", g.qk_rope)):
            if width % quant.Q8_BLOCK:
                raise TierUnsupported(f"int8 (Q8_0) needs row widths that are multiples of 32; {name} is {width}")

    def _field_specs(self):
        g = self.geometry
        return {
            "lc_codes": ((g.kv_lora,), torch.int8),
            "lc_deltas": ((g.kv_lora // quant.Q8_BLOCK,), torch.float16),
            "rc_codes": ((g.qk_rope,), torch.int8),
            "rc_deltas": ((g.qk_rope // quant.Q8_BLOCK,), torch.float16),
        }

    def _encode(self, lc, rc):
        lc_codes, lc_deltas = quant.encode_q8(lc)
        rc_codes, rc_deltas = quant.encode_q8(rc)
        return {"lc_codes": lc_codes, "lc_deltas": lc_deltas, "rc_codes": rc_codes, "rc_deltas": rc_deltas}

    def _decode(self, fields):
        return (
            quant.q8_dequantize_blocks(fields["lc_codes"], fields["lc_deltas"]),
            quant.q8_dequantize_blocks(fields["rc_codes"], fields["rc_deltas"]),
        )

    def _operands(self, fields):
        return fields["lc_codes"], fields["lc_deltas"], fields["rc_codes"], fields["rc_deltas"]

    def _native(self, rows):
        return None

    def _stored(self, fields, tokens):
        lc = quant.q8_dequantize_blocks(torch.from_numpy(fields["lc_codes"]), torch.from_numpy(fields["lc_deltas"]))
        rc = quant.q8_dequantize_blocks(torch.from_numpy(fields["rc_codes"]), torch.from_numpy(fields["rc_deltas"]))
        return StoredRows(tokens, 1, lc.numpy(), rc.numpy())


TIERS: dict[str, type[LatentCache]] = {
    cls.tier: cls for cls in (F32Cache, BF16Cache, Fp8Cache, Int4Cache, PolarCache, Q8Cache)
}


def make_cache(
    tier: str,
    geometry,
    device: torch.device | str = "cpu",
    capacity: int = 0,
    *,
    bits: int | None = None,
    prefer_backend: str | None = None,
) -> LatentCache:
    """Build an empty cache.

    Parameters
    ----------
    tier : ``f32``, ``bf16``, ``fp8``, ``tq-int4``, ``tq-polar`` or ``int8``
    geometry : a ModelConfig, CacheGeometry or ``.coli_kv`` Geometry
    device : torch device for the rows
    capacity : rows to allocate up front (the cache grows as needed)
    bits : PolarQuant bits (2..6, default 4); int4 is always 4
    prefer_backend : ``"torch"`` to skip the GPU decode kernels

    Raises
    ------
    TierUnsupported
        Unknown tier, or a geometry the tier cannot hold.
    """
    cls = TIERS.get(tier)
    if cls is None:
        raise TierUnsupported(f"unknown cache tier {tier!r} (known: {', '.join(TIERS)})")
    if issubclass(cls, TQCache):
        return cls(geometry, device, capacity, bits=4 if bits is None else bits, prefer_backend=prefer_backend)
    if bits is not None:
        raise TierUnsupported(f"bits only apply to the tq tiers, not {tier}")
    return cls(geometry, device, capacity, prefer_backend=prefer_backend)


def tier_bytes_per_token(tier: str, geometry, bits: int | None = None) -> int:
    """The format arithmetic of a tier's bytes per token (what ``bytes_per_token`` must report).

    f32 ``L(K+R)4``; bf16 ``L(K+R)2``; fp8 (v2) ``L(K+R+8)``; TQ (v3) ``L(rb(K)+rb(R)+8)``;
    int8 (Q8_0) ``L((K+R) + 2(K+R)/32)``.
    """
    g = CacheGeometry.of(geometry)
    L, K, R = g.n_layers, g.kv_lora, g.qk_rope
    if tier == "f32":
        return L * (K + R) * 4
    if tier == "bf16":
        return L * (K + R) * 2
    if tier == "fp8":
        return L * (K + R + 8)
    if tier in ("tq-int4", "tq-polar"):
        codec = quant.CODEC_INT4 if tier == "tq-int4" else quant.CODEC_POLAR
        b = 4 if bits is None else bits
        return L * (quant.tq_row_bytes(K, codec, b) + quant.tq_row_bytes(R, codec, b) + 8)
    if tier == "int8":
        return L * ((K + R) + 2 * (K + R) // quant.Q8_BLOCK)
    raise TierUnsupported(f"unknown cache tier {tier!r}")
