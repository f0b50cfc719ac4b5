# Over 500 lines: one cache class for every tier (fields, writes, reads, attention, three restore paths) reads as one.
"""Latent caches of every tier behind one interface, on any torch device (cpu, cuda, mps).

A cache holds, per layer and position, the two rows a ``.coli_kv`` record stores: ``Lc`` (the
normed latent, ``kv_lora`` wide) and ``Rc`` (the roped shared key, ``qk_rope`` wide), in the tier's
representation, plus the token id of each position. Rows are quantized when written and read
back through dequantization (or attended directly by the tier's decode backend).

The tier is a :class:`kvstore.tiers.Tier` and everything a cache needs comes from it: the fields a
row takes (:func:`kvstore.gpu.inputs.row_layout`: its values for ``f32``/``bf16``, its codes and a
scale part for ``fp8``, ``int4``, ``polar2`` .. ``polar6``, ``q8``), its codecs
(:mod:`kvstore.gpu.codecs`), its decode backend (:func:`kvstore.gpu.registry.select`), its journal
(``Tier.file_tier``: v1 f32 rows for f32 and q8, v4 bf16 rows for bf16) and its bytes: a position takes
``Tier.row_bytes(K) + Tier.row_bytes(R)`` per layer (:meth:`CacheGeometry.bytes_per_token`): f32
``4(K+R)``, bf16 ``2(K+R)``, fp8 ``K+R+8``, int4 ``K/2+R/2+8``, polarB ``rb(K)+rb(R)+8``, q8
``(K+R)(1+1/16)``.

Use: :func:`make_cache`; then per forward ``prepare(start, t)`` -> the model ``write``\\ s rows ->
``commit(start, tokens)``. ``restore`` swaps in rows from the journal all-or-nothing: stored
rows of the tier's own version go in as they are (no dequantize/requantize round trip).
``restore_records`` / ``restore_body`` do the same from ``.coli_kv`` records on the device
(``engine/restore.py``: one read, one upload, the split into fields there); ``restore`` of
host-side ``StoredRows`` is the reference they are tested against.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
import torch

from kvstore import tiers
from kvstore.engine import launches
from kvstore.engine.errors import CacheError, CodecMismatch, GeometryMismatch, TierUnsupported
from kvstore.engine.rows import StoredRows
from kvstore.gpu import codecs, registry
from kvstore.gpu.errors import BackendUnavailable
from kvstore.gpu.inputs import LatentBatch, row_layout

__all__ = ["CacheGeometry", "LatentCache", "make_cache"]

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

    def bytes_per_token(self, tier: tiers.Tier | str) -> int:
        """KV bytes one position takes over all layers in ``tier`` (``Tier.row_bytes``; token id not counted)."""
        tier = tier if isinstance(tier, tiers.Tier) else tiers.parse(tier)
        return self.n_layers * (tier.row_bytes(self.kv_lora) + tier.row_bytes(self.qk_rope))


# -- the cache interface ---------------------------------------------------------------------------


class LatentCache:
    """Per-layer latent rows of one sequence in one tier, on one device.

    Attributes
    ----------
    tier : kvstore.tiers.Tier — ``tier.name`` is its name, ``tier.file_tier`` what a journal of this
        cache holds (what :meth:`export_rows` produces)
    geometry : CacheGeometry
    device : torch.device
    length : int — committed positions (rows ``0 .. length-1`` are valid)
    decode_choice : kvstore.gpu.registry.Selection — the backend whose entry point :meth:`attend` calls
    """

    def __init__(
        self,
        tier: tiers.Tier,
        geometry: CacheGeometry,
        device: torch.device | str = "cpu",
        capacity: int = 0,
        *,
        prefer_backend: str | None = None,
    ):
        self.tier = tier
        self.geometry = CacheGeometry.of(geometry)
        self.device = torch.device(device)
        for name, width in (("kv_lora", self.geometry.kv_lora), ("qk_rope", self.geometry.qk_rope)):
            problem = tier.width_problem(width)
            if problem is not None:
                raise TierUnsupported(f"{name}: {problem}")
        #: :mod:`kvstore.gpu.encode_kernels` when one kernel encodes and stores a layer's new rows
        #: (:meth:`write_at`; fp8, int4 and f32 on CUDA, with ``codecs.use_encode_kernels`` on when
        #: the cache was made), else None
        self.write_kernels = None
        if self.device.type != "cpu":
            # Build the codec's device tables (signs, levels, ...) now, outside any compiled region:
            # torch.compile cannot trace their numpy construction (nor can a captured graph copy them).
            zeros = (
                torch.zeros(1, self.geometry.kv_lora, device=self.device),
                torch.zeros(1, self.geometry.qk_rope, device=self.device),
            )
            encode_fields(tier, *zeros)  # with the encode kernel on, its tables too (f32 needs none)
            kernels = codecs.encode_kernels() if self.device.type == "cuda" else None
            if kernels is not None and kernels.usable(tier.name, *zeros):
                self.write_kernels = kernels
        self._length = 0
        self._tokens = np.zeros(capacity, dtype=np.int32)
        self._fields = self._allocate(capacity)
        self._capacity = capacity
        try:
            self.decode_choice: registry.Selection = registry.select(
                tier, self.device, kv_lora=self.geometry.kv_lora, qk_rope=self.geometry.qk_rope, prefer=prefer_backend
            )
        except BackendUnavailable as exc:
            raise TierUnsupported(exc.reason) from None

    # -- the tier's fields: values or codes ("lc", "rc") and, for quantized tiers, a scale part -----
    def _field_specs(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Per stored row: field name -> (trailing shape, dtype). Stored as [n_layers, capacity, *shape]."""
        specs = {}
        for prefix, width in (("lc", self.geometry.kv_lora), ("rc", self.geometry.qk_rope)):
            layout = row_layout(self.tier, width)
            specs[prefix] = ((layout.code_width,), layout.codes_dtype)
            if layout.scales_dtype is not None:
                specs[f"{prefix}_scales"] = (layout.scales_shape, layout.scales_dtype)
        return specs

    def _encode(self, lc: torch.Tensor, rc: torch.Tensor) -> dict[str, torch.Tensor]:
        """f32 rows [..., K] / [..., R] -> field tensors with the same leading shape."""
        return encode_fields(self.tier, lc, rc)

    def _decode(self, fields: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Field tensors (leading shape [...]) -> f32 rows ([..., K], [..., R])."""
        g = self.geometry
        return (
            codecs.decode_tier(self.tier, fields["lc"], fields.get("lc_scales"), g.kv_lora),
            codecs.decode_tier(self.tier, fields["rc"], fields.get("rc_scales"), g.qk_rope),
        )

    def _record_fields(self, stored: tiers.Tier) -> dict[str, str] | None:
        """Field -> ``.coli_kv`` record field (``Lc``/``Ls``/``Rc``/``Rs``) when records of ``stored`` are
        this cache's own representation (copied as they are; v1 rows into bf16 by a converting copy),
        else None."""
        if stored is self.tier or (self.tier is tiers.BF16 and stored is tiers.F32):
            return {name: _RECORD_FIELD[name] for name in self._field_specs()}
        return None

    def _native(self, rows: StoredRows) -> dict[str, torch.Tensor] | None:
        """Stored rows of this cache's own representation as fields on the device (sanitized), else None."""
        if self._record_fields(rows.tier) is None:
            return None
        specs = self._field_specs()
        if rows.lc.shape[-1] != specs["lc"][0][0] or rows.rc.shape[-1] != specs["rc"][0][0]:
            raise GeometryMismatch(
                f"stored rows are {rows.lc.shape[-1]}/{rows.rc.shape[-1]} bytes or values wide, "
                f"the cache expects {specs['lc'][0][0]}/{specs['rc'][0][0]}"
            )
        fields = {}
        for prefix, values, scales in (("lc", rows.lc, rows.lc_scales), ("rc", rows.rc, rows.rc_scales)):
            fields[prefix] = _to_device(values, self.device, specs[prefix][1])
            if scales is not None:
                fields[f"{prefix}_scales"] = _to_device(scales, self.device, torch.float32)
                # loaded files are sanitized already; rows handed over directly get the same treatment
                codecs.sanitize_tier_(self.tier, fields[prefix], fields[f"{prefix}_scales"])
        return fields

    def _stored(self, fields: dict[str, np.ndarray], tokens: np.ndarray) -> StoredRows:
        """Host copies of fields [n_layers, n, ...] -> the rows a journal of this tier holds."""
        tier = self.tier
        if tier.in_file and tier is not tiers.F32:  # bf16, fp8, int4, polarB: the codes as they are
            return StoredRows(
                tokens,
                tier.version,
                fields["lc"],
                fields["rc"],
                fields.get("lc_scales"),
                fields.get("rc_scales"),
                tier.codec,
                tier.bits,
            )
        # f32 (as it is) and q8 (decoded) journal as f32 rows
        lc, rc = self._decode({name: torch.from_numpy(value) for name, value in fields.items()})
        return StoredRows(tokens, 1, lc.numpy(), rc.numpy())

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
            f"{type(self).__name__}(tier={self.tier.name!r}, layers={g.n_layers}, kv_lora={g.kv_lora}, "
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
        self.check_room(start, t)
        encoded = self._encode(lc.to(torch.float32), rc.to(torch.float32))
        for name, value in encoded.items():
            self._fields[name][layer, start : start + t] = value

    def check_room(self, start: int, t: int) -> None:
        """Raise :class:`CacheError` unless rows ``start .. start+t-1`` lie below the capacity."""
        if start + t > self._capacity:
            raise CacheError(
                f"rows {start}..{start + t - 1} are past the capacity {self._capacity}: call prepare() first"
            )

    def encode(self, lc: torch.Tensor, rc: torch.Tensor) -> dict[str, torch.Tensor]:
        """Rows ``lc`` [..., kv_lora], ``rc`` [..., qk_rope] as this cache's fields (what
        :meth:`write` stores; the caller places them, e.g. a packed prefill into several caches)."""
        return self._encode(lc.to(torch.float32), rc.to(torch.float32))

    def decode(self, fields: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Fields as :meth:`encode` gives them -> f32 rows, the values :meth:`read` gives back."""
        return self._decode(fields)

    def field(self, name: str) -> torch.Tensor:
        """The buffer of one field, ``[n_layers, capacity, ...]`` (a view: writes land in the cache)."""
        return self._fields[name]

    def write_at(self, layer: int, positions: torch.Tensor, lc: torch.Tensor, rc: torch.Tensor) -> None:
        """:meth:`write` at device positions int64[T] (one row each): no host value decides where, so a
        CUDA graph can capture it. The positions must lie below the capacity (not checked: that would
        read them back to the host). With :attr:`write_kernels`, one kernel encodes both widths' rows
        and writes them into their slots."""
        if self.write_kernels is not None:
            fields = self._fields
            out = tuple(
                (fields[p][layer], fields[f"{p}_scales"][layer] if f"{p}_scales" in fields else None)
                for p in ("lc", "rc")
            )
            dependent = launches.own_kernels_dependent(self.device)
            self.write_kernels.encode_rows(self.tier.name, (lc, rc), out, positions, dependent=dependent)
            return
        self.store_at(layer, positions, self._encode(lc.to(torch.float32), rc.to(torch.float32)))

    def store_at(self, layer: int, positions: torch.Tensor, fields: dict[str, torch.Tensor]) -> None:
        """Put rows already encoded in this cache's tier (:func:`encode_fields`) at device positions
        int64[T] of ``layer``; as :meth:`write_at`, nothing is read back to the host."""
        for name, value in fields.items():
            self._fields[name][layer].index_copy_(0, positions, value.to(self._fields[name].dtype))

    @property
    def storage_key(self) -> tuple[int, int]:
        """(address of the first field, capacity): changes whenever the row buffers are reallocated,
        which invalidates any CUDA graph that captured them."""
        first = next(iter(self._fields.values()), None)
        return (0 if first is None else first.data_ptr(), self._capacity)

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
        fields, g = self._fields, self.geometry
        lc_scales, rc_scales = fields.get("lc_scales"), fields.get("rc_scales")
        # the cache's own rows: a trusted batch (no checks per layer and step, none under capture)
        batch = LatentBatch.trusted(
            self.tier,
            fields["lc"][layer, :n_rows],
            None if lc_scales is None else lc_scales[layer, :n_rows],
            fields["rc"][layer, :n_rows],
            None if rc_scales is None else rc_scales[layer, :n_rows],
            seq_start,
            seq_len,
            kv_lora=g.kv_lora,
            qk_rope=g.qk_rope,
        )
        return self.decode_choice.function(q_lat, q_rope, batch, softmax_scale)

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

    def reserve_restore(self, n: int, headroom: int = _MIN_CAPACITY) -> None:
        """Allocate, and free at once, the buffers :meth:`restore_body` builds for ``n`` rows: the
        device's caching allocator keeps the block for the first restore of that size."""
        full = self._allocate(n + max(0, headroom), zeros=False)
        del full

    def pin(self) -> None:
        """Move a host cache's row buffers to page-locked memory, so that copies to a CUDA device
        from them are asynchronous (the host tier of ``kvstore.engine.pool``); else nothing."""
        if self.device.type == "cpu" and torch.cuda.is_available():
            self._fields = {name: field.pin_memory() for name, field in self._fields.items()}

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
        """Rows ``start .. stop-1`` as a journal of the tier holds them (``tier.file_tier``), copied to
        the host (raw codes; q8 rows dequantized to f32)."""
        start, stop = self._span(start, stop)
        fields = {name: self._to_host(f[:, start:stop]) for name, f in self._fields.items()}
        return self._stored(fields, self._tokens[start:stop].copy())

    def _to_host(self, field: torch.Tensor) -> np.ndarray:
        # a copy (never a view of the cache); bf16 as its bit patterns (u16, a v4 record's codes),
        # which numpy can hold
        if field.dtype == torch.bfloat16:
            return field.to("cpu", copy=True).view(torch.int16).numpy().view(np.uint16)
        return field.to("cpu", copy=True).numpy()

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
        that needs ``allow_requantize=True``. Either way a row whose stored scale or radius no
        encoder writes (``Tier.corrupt_scales``) is restored inert (zeros), never inf.

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
            self._check_requantize(rows.tier, allow_requantize)
            lc, rc = rows.dequantize(g.kv_lora, g.qk_rope)
            self._check_widths(lc.shape[-1], rc.shape[-1])
            fields = self._encode(
                torch.from_numpy(np.ascontiguousarray(lc)).to(self.device),
                torch.from_numpy(np.ascontiguousarray(rc)).to(self.device),
            )
        capacity = n + max(0, headroom)
        full = self._allocate(capacity)
        for name, value in fields.items():
            full[name][:, :n] = value
        self._adopt(full, rows.tokens, capacity, n)

    def restore_records(
        self, records, *, expect=None, allow_requantize: bool = False, headroom: int = _MIN_CAPACITY
    ) -> None:
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
        self,
        body,
        *,
        allow_requantize: bool = False,
        headroom: int = _MIN_CAPACITY,
        check_tokens=None,
        chunk_bytes: int | None = None,
        threads: int | None = None,
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
        threads : chunks read at once (default ``restore.read_threads``)

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
        native = self._record_fields(body.tier)
        if native is not None:
            placement = device_restore.Placement(stored, body.tier, native=native)
        else:
            self._check_requantize(body.tier, allow_requantize)
            placement = device_restore.Placement(stored, body.tier, encode=self._encode)
        capacity = body.n + max(0, headroom)
        full = self._allocate(capacity, zeros=False)  # every row below n is written, the rest zeroed
        n, stored_tokens = device_restore.fill(
            body, full, placement, self.device, chunk_bytes=chunk_bytes, threads=threads
        )
        for value in full.values():
            value[:, n:].zero_()
        if check_tokens is not None:
            check_tokens(stored_tokens)
        self._adopt(full, stored_tokens, capacity, n)

    def _adopt(self, full: dict[str, torch.Tensor], stored_tokens: np.ndarray, capacity: int, n: int) -> None:
        """The last step of every restore, once all of it succeeded: make ``full``'s first ``n`` rows
        the cache's. On CUDA, when the current buffers hold them, they are copied in (one device copy)
        so the storage — and every CUDA graph that captured it — stays; otherwise ``full`` replaces it."""
        if self.device.type == "cuda" and self._capacity >= capacity and self._fields:
            for name, value in full.items():
                self._fields[name][:, :n].copy_(value[:, :n])
                self._fields[name][:, n:].zero_()
            self._tokens[:n] = stored_tokens[:n]
            self._tokens[n:] = 0
            self._length = n
            return
        tokens = np.zeros(capacity, dtype=np.int32)
        tokens[:n] = stored_tokens[:n]
        self._fields, self._tokens, self._capacity, self._length = full, tokens, capacity, n

    def copy_rows(self, src: "LatentCache", src_start: int, dst_start: int, n: int) -> None:
        """Copy ``n`` rows of every layer from ``src`` (same tier and geometry) as stored, codes and
        scales alike (no requantization); tokens and lengths are the caller's to commit."""
        if src.tier is not self.tier or src.geometry != self.geometry:
            raise CacheError(
                f"rows of a {src.tier.name} cache cannot be copied into a {self.tier.name} cache as stored"
            )
        if src_start + n > src.capacity or dst_start + n > self._capacity:
            raise CacheError(f"copying {n} rows from {src_start} to {dst_start} passes a capacity")
        for name, field in self._fields.items():
            field[:, dst_start : dst_start + n].copy_(src._fields[name][:, src_start : src_start + n])

    def copy(self) -> "LatentCache":
        """An independent cache with the same rows (e.g. to fork a conversation)."""
        clone = object.__new__(type(self))
        clone.__dict__.update(self.__dict__)
        clone._fields = {name: f.clone() for name, f in self._fields.items()}
        clone._tokens = self._tokens.copy()
        return clone

    def _check_requantize(self, stored: tiers.Tier, allow: bool) -> None:
        """Quantized rows restored into another quantized tier would be quantized twice (lossy):
        refused unless ``allow``. f32/bf16 caches take any rows (decoding is lossless there)."""
        if not stored.holds_values and self.tier not in (tiers.F32, tiers.BF16) and not allow:
            raise CodecMismatch(
                f"rows stored as {stored.describe()} would be quantized again for the {self.tier.name} "
                "tier (lossy): pass allow_requantize=True or migrate the file"
            )

    def _check_widths(self, kv_lora: int, qk_rope: int) -> None:
        g = self.geometry
        if (kv_lora, qk_rope) != (g.kv_lora, g.qk_rope):
            raise GeometryMismatch(f"rows are {kv_lora}/{qk_rope} wide, the cache holds {g.kv_lora}/{g.qk_rope}")


_RECORD_FIELD = {"lc": "Lc", "lc_scales": "Ls", "rc": "Rc", "rc_scales": "Rs"}


def encode_fields(tier: tiers.Tier, lc: torch.Tensor, rc: torch.Tensor) -> dict[str, torch.Tensor]:
    """f32 rows [..., K] / [..., R] -> a cache's field tensors in ``tier`` (``lc``, ``rc`` and, for a
    quantized tier, ``lc_scales``, ``rc_scales``) with the same leading shape."""
    fields = {}
    for prefix, (values, scales) in zip(("lc", "rc"), codecs.encode_tier_pair(tier, lc, rc)):
        fields[prefix] = values
        if scales is not None:
            fields[f"{prefix}_scales"] = scales
    return fields


def _to_device(array: np.ndarray, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A copy of ``array`` on ``device`` as ``dtype`` (never a view of the caller's array: it may be
    sanitized in place); u16 ``array`` into bf16 is taken as bf16 bit patterns (v4 codes)."""
    if dtype == torch.bfloat16 and array.dtype == np.uint16:
        return torch.from_numpy(np.array(array).view(np.int16)).view(torch.bfloat16).to(device=device)
    return torch.from_numpy(np.array(array)).to(device=device, dtype=dtype)


def make_cache(
    tier: tiers.Tier | str,
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
    tier : a ``kvstore.tiers.Tier`` or its name: ``f32``, ``bf16``, ``fp8``, ``int4``, ``polar2`` ..
        ``polar6``, ``q8`` (the old ``tq-int4``, ``tq-polar`` and ``int8`` still work, with a
        ``TierSpellingDeprecated`` warning)
    geometry : a ModelConfig, CacheGeometry or ``.coli_kv`` Geometry
    device : torch device for the rows
    capacity : rows to allocate up front (the cache grows as needed)
    bits : deprecated, for one release: PolarQuant bits of ``tq-polar`` (folded into the name)
    prefer_backend : a decode backend to try first (``"torch"`` skips the GPU kernels)

    Raises
    ------
    UnknownTier
        A name that is no tier (or bits that do not fit it).
    TierUnsupported
        A geometry the tier cannot hold, or no decode backend for it on ``device``.
    """
    if not isinstance(tier, tiers.Tier) or bits is not None:
        tier, note = tiers.resolve(tier if isinstance(tier, str) else tier.name, bits=bits)
        if note is not None:  # an old spelling: named at the caller's line
            warnings.warn(note, tiers.TierSpellingDeprecated, stacklevel=2)
    return LatentCache(tier, geometry, device, capacity, prefer_backend=prefer_backend)
