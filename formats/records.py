"""The records of a loaded ``.coli_kv`` file: sanitize-on-load, damage, decoding (docs/FORMAT.md section 4).

A file's body is one numpy structured array (:func:`kvstore.formats.layout.record_dtype`), viewed,
never looped over per record. :class:`KVRecords` holds the records safe to resume and reads them
through the tier's codec: a stored scale or radius no encoder writes makes its row inert (the
codec's bound, :meth:`~kvstore.formats.codecs.RowCodec.corrupt_scales`), a code no encoder writes
reads as 0, and :class:`Problems` counts both. :func:`check_scales` is the same bound applied
strictly. :mod:`kvstore.formats.coli_kv` re-exports every name.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from kvstore.formats.errors import BadScale, CodecMismatch
from kvstore.formats.layout import HEADER_BYTES, Geometry, Header
from kvstore.formats.tiers import Tier

__all__ = ["FILE_ADVICE", "KVRecords", "Problems", "check_row_scales", "check_scales"]

#: How each kind of code damage (a ``Problems`` count) is named in what a repair did.
_CODE_DAMAGE_TEXT = {"nan_codes": "NaN codes", "nan_values": "non-finite f32 values"}


@dataclass
class Problems:
    """What a loader found and neutralized (sanitize-on-load, docs/FORMAT.md section 4).

    Everything but ``uncommitted`` is *damage* (:attr:`damaged`): the committed records are not all
    there or not all valid (``overclaim``, bad scales/radii, NaN codes, non-finite values), or the
    file ends in bytes that are not a whole record (``torn_tail_bytes``: a write cut mid-record, or a
    file cut short). Whole records past the commit point (``uncommitted``) are not damage: the
    durability protocol itself leaves them (an append killed after its data fsync, before the count;
    a truncate killed after publishing the lower count), every committed record is whole, and the
    next append overwrites them — they are reported as a note (:meth:`notes`).
    """

    torn_tail_bytes: int = 0
    overclaim: int = 0  # records the header claims beyond what is physically present
    uncommitted: int = 0  # complete records past nrec (an append that crashed before its commit)
    bad_scales: int = 0  # v2 rows with a scale not in (0, 3.4e38): the whole row made inert
    bad_radii: int = 0  # v3 rows with a radius not in [0, 3.4e38): the row decodes to zeros
    nan_codes: int = 0  # v2 code bytes 0x7F/0xFF, read as 0
    nan_values: int = 0  # v1 f32 elements (and index rows) that are NaN or infinite

    @property
    def damaged(self) -> bool:
        """Any damage (everything counted here but ``uncommitted``)."""
        return bool(
            self.overclaim
            or self.torn_tail_bytes
            or self.bad_scales
            or self.bad_radii
            or self.nan_codes
            or self.nan_values
        )

    def damage(self) -> list[str]:
        """One line per kind of damage (:meth:`messages` without the uncommitted-records note)."""
        note = self.notes()
        return [line for line in self.messages() if line not in note]

    def notes(self) -> list[str]:
        """What is found but is not damage: whole records past the commit point."""
        if not self.uncommitted:
            return []
        return [f"{self.uncommitted} complete records past the commit point (nrec) are not loaded"]

    def messages(self) -> list[str]:
        """Every finding, one line each (damage and notes)."""
        out = []
        if self.overclaim:
            out.append(f"header claims {self.overclaim} more records than the file holds; they are not loaded")
        if self.uncommitted:
            out.append(f"{self.uncommitted} complete records past the commit point (nrec) are not loaded")
        if self.torn_tail_bytes:
            out.append(f"{self.torn_tail_bytes} bytes past the last complete record (torn tail) are ignored")
        if self.bad_scales:
            out.append(f"{self.bad_scales} rows with a bad fp8 scale were made inert (zeros)")
        if self.bad_radii:
            out.append(f"{self.bad_radii} rows with a bad TQ radius decode to zeros")
        if self.nan_codes:
            out.append(f"{self.nan_codes} fp8 NaN codes read as 0")
        if self.nan_values:
            out.append(f"{self.nan_values} non-finite values in the rows")
        return out


class KVRecords:
    """The records of a ``.coli_kv`` file that are safe to resume.

    Attributes
    ----------
    header : Header (``header.nrec`` as stored; ``n`` is what is safe)
    n : int — ``min(nrec, complete records physically present)``
    records : structured array [n] of :func:`record_dtype` (a view of the loaded bytes)
    file_size : int
    """

    def __init__(self, header: Header, records: np.ndarray, file_size: int):
        self.header = header
        self.records = records
        self.n = int(records.shape[0])
        self.file_size = file_size

    @property
    def geometry(self) -> Geometry:
        return self.header.geometry

    @property
    def tier(self) -> Tier:
        return self.header.tier

    @property
    def complete_records(self) -> int:
        return (self.file_size - HEADER_BYTES) // self.header.rec_bytes if self.file_size >= HEADER_BYTES else 0

    @cached_property
    def tokens(self) -> np.ndarray:
        """int32[n], contiguous."""
        return np.ascontiguousarray(self.records["token"])

    def _layer_field(self, name: str) -> np.ndarray:
        return self.records["layers"][name]  # [n, n_layers, ...] strided view

    @cached_property
    def _bad_row_masks(self) -> dict[str, np.ndarray]:
        """``{"L", "R"}`` -> bool[n, n_layers]: rows whose scale/radius is corrupt (all False without scales)."""
        codec = self.tier.row_codec
        if not codec.scaled:
            return {which: np.zeros((self.n, self.geometry.n_layers), dtype=bool) for which in ("L", "R")}
        check = self.tier.corrupt_scales  # the one bound every reader applies
        return {which: check(self._layer_field(which + "s")) for which in ("L", "R")}

    def _bad_codes(self, which: str) -> np.ndarray | None:
        """Mask of the stored codes of ``which`` no encoder writes ([n, n_layers, row]), None when none can be."""
        return self.tier.row_codec.bad_codes(self._layer_field(which + "c"))

    @cached_property
    def problems(self) -> Problems:
        """Counts of what sanitize-on-load neutralizes. Scales/radii are checked on load; the
        full scan of code bytes happens the first time this is read (inspect, repair)."""
        h = self.header
        codec = self.tier.row_codec
        found = Problems()
        complete = self.complete_records
        found.overclaim = max(0, h.nrec - complete)
        found.uncommitted = max(0, complete - h.nrec)
        found.torn_tail_bytes = max(0, self.file_size - HEADER_BYTES - complete * h.rec_bytes)
        masks = self._bad_row_masks
        if codec.scale_damage is not None:
            setattr(found, codec.scale_damage, int(masks["L"].sum() + masks["R"].sum()))
        if codec.code_damage is not None:
            for which in ("L", "R"):
                bad = self._bad_codes(which)
                if bad is not None:
                    setattr(found, codec.code_damage, getattr(found, codec.code_damage) + int(np.count_nonzero(bad)))
        if h.nic:
            found.nan_values += int(np.count_nonzero(~np.isfinite(self.records["index"])))
        return found

    def damaged_records(self) -> dict[str, np.ndarray]:
        """Which of the ``n`` records hold each kind of row damage :attr:`problems` counts.

        Returns
        -------
        dict
            ``bad_scales`` (v2), ``bad_radii`` (v3), ``nan_codes`` (v2), ``nan_values`` (v1 rows,
            and indexer rows of any version) -> bool[n]: the record holds at least one. Kinds the
            tier cannot hold are absent. A full scan of the rows, like :attr:`problems`.
        """
        codec = self.tier.row_codec
        found: dict[str, np.ndarray] = {}

        def mark(kind: str, hit: np.ndarray) -> None:
            found[kind] = found[kind] | hit if kind in found else hit

        masks = self._bad_row_masks
        if codec.scale_damage is not None:
            mark(codec.scale_damage, np.asarray(masks["L"].any(axis=1) | masks["R"].any(axis=1)))
        if codec.code_damage is not None:
            hit = np.zeros(self.n, dtype=bool)
            for which in ("L", "R"):
                bad = self._bad_codes(which)
                if bad is not None:
                    hit |= bad.any(axis=(1, 2))
            mark(codec.code_damage, hit)
        if self.geometry.nic:
            mark("nan_values", np.asarray(~np.isfinite(self.records["index"]).all(axis=(1, 2))))
        return found

    def quantized(self, which: str) -> tuple[np.ndarray, np.ndarray | None]:
        """Raw stored rows of ``which`` (``"L"`` or ``"R"``), sanitized, layer-major.

        Returns
        -------
        codes : u8[n_layers, n, row] (fp8 codes for v2, packed TQ bytes for v3), u16[n_layers, n,
            width] (bf16 bit patterns for v4)
        scales : f32[n_layers, n] (fp8 scales for v2, radii for v3), None for v4

        Corrupt rows come back inert (codes 0, scale 1 / radius 0) and NaN codes as 0, so a consumer
        that decodes in hardware sees what the LUT decoder sees; v4 values come back as stored.
        """
        codec = self.tier.row_codec
        if codec.codes_dtype.kind == "f":
            raise CodecMismatch(
                f"a v{self.tier.version} file stores {self.tier.name} rows, not codes: use dequantize()"
            )
        if which not in ("L", "R"):
            raise ValueError("which must be 'L' or 'R'")
        # Always copies (never a view of the loaded bytes): sanitizing below must not write
        # through to the buffer, which may be read-only or shared.
        codes = self._layer_field(which + "c").transpose(1, 0, 2).copy()
        if not codec.scaled:  # v4 values: as dequantize() reads them (a stored NaN stays, as in v1)
            return codes, None
        bad_codes = codec.bad_codes(codes)
        if bad_codes is not None:
            codes[bad_codes] = 0
        scales = self._layer_field(which + "s").T.copy()
        bad = self._bad_row_masks[which].T
        if bad.any():
            codes[bad] = 0
            scales[bad] = codec.inert_scale
        return codes, scales

    def _dequantize_field(self, which: str, width: int, out: np.ndarray | None = None) -> np.ndarray:
        n_layers = self.geometry.n_layers
        codec = self.tier.row_codec
        if out is None:
            out = np.empty((n_layers, self.n, width), dtype=np.float32)
        codes = self._layer_field(which + "c")
        scales = self._layer_field(which + "s") if codec.scaled else None
        bad = self._bad_row_masks[which]
        for layer in range(n_layers):
            layer_codes = codes[:, layer]
            layer_scales = None if scales is None else np.ascontiguousarray(scales[:, layer])
            if layer_scales is not None and bad[:, layer].any():
                # A corrupt row is inert: zero codes and a neutral scale/radius (on copies: the
                # loaded bytes may be read-only or shared).
                layer_scales = layer_scales.copy()
                layer_codes = layer_codes.copy()
                layer_codes[bad[:, layer]] = 0
                layer_scales[bad[:, layer]] = codec.inert_scale
            with np.errstate(over="ignore", invalid="ignore"):
                codec.dequantize(layer_codes, layer_scales, width, out=out[layer])
            if codec.decode_can_overflow:
                # A radius near the f32 limit (only a damaged file has one) can overflow on the
                # way back; such a row reads as zeros, like a bad radius.
                overflowed = ~np.isfinite(out[layer]).all(axis=-1)
                if overflowed.any():
                    out[layer][overflowed] = 0.0
        return out

    def dequantize(self) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """Decode every safe record, sanitized.

        Returns
        -------
        L : f32[n_layers, n, kv_lora]
        R : f32[n_layers, n, qk_rope]
        I : f32[nic, n, index_hd] or None when nic == 0
        """
        g = self.geometry
        L = self._dequantize_field("L", g.kv_lora)
        R = self._dequantize_field("R", g.qk_rope)
        index = None
        if g.nic:
            index = np.ascontiguousarray(self.records["index"].transpose(1, 0, 2))
        return L, R, index

    def rows(self) -> np.ndarray:
        """Decode every safe record into one array f32 ``[n_layers, n, kv_lora + qk_rope]`` (the
        latent part, then the rope part: a row as an MLA cache keeps it), sanitized as
        :meth:`dequantize` does — written in place, with no L and R arrays to join after."""
        g = self.geometry
        out = np.empty((g.n_layers, self.n, g.kv_lora + g.qk_rope), dtype=np.float32)
        self._dequantize_field("L", g.kv_lora, out[..., : g.kv_lora])
        self._dequantize_field("R", g.qk_rope, out[..., g.kv_lora :])
        return out

    def values(self) -> np.ndarray:
        """A value tier's rows as stored, in one array ``[n_layers, n, kv_lora + qk_rope]`` of the
        file's own element type — f32 (v1) or bf16 bit patterns, u16 (v4) — copied, not decoded:
        a bf16 file's rows at half the bytes of :meth:`rows`, which they widen to exactly.

        Raises
        ------
        CodecMismatch
            The file stores codes and scales (v2, v3): use :meth:`rows`.
        """
        view = self.values_view()
        return np.array(view, dtype=view.dtype.newbyteorder("="), order="C")

    def values_view(self) -> np.ndarray:
        """:meth:`values` with no copy: a read-only view ``[n_layers, n, kv_lora + qk_rope]`` of the
        records themselves — in a value tier's record a layer's latent and rope values lie side by
        side, so a row is one stride away from the next — for a reader that only reads them (a
        decode pass and a fresh array saved). It keeps the records' whole buffer alive.

        Raises
        ------
        CodecMismatch
            The file stores codes and scales (v2, v3): use :meth:`rows`.
        """
        codec = self.tier.row_codec
        if not codec.holds_values:
            raise CodecMismatch(f"a v{self.tier.version} file stores {self.tier.name} codes, not values: use rows()")
        g = self.geometry
        latent = self._layer_field("Lc")  # [n, n_layers, kv_lora], from the first record's first row
        layer = self.records.dtype["layers"].base  # one layer's fields: Lc, then Rc, no scales
        rope_at = (layer.fields or {}).get("Rc", (None, -1))[1]
        if layer.itemsize != (g.kv_lora + g.qk_rope) * latent.itemsize or rope_at != g.kv_lora * latent.itemsize:
            raise AssertionError("a value tier's layer is not its latent values then its rope values")  # a bug
        return np.lib.stride_tricks.as_strided(
            latent,
            shape=(g.n_layers, self.n, g.kv_lora + g.qk_rope),
            strides=(layer.itemsize, self.records.strides[0], latent.itemsize),
            writeable=False,
        )

    def sanitized(self) -> tuple[np.ndarray, list[str]]:
        """A copy of the records with every damaged row neutralized as a load reads it, and one
        line per kind of change (what ``kvstore repair`` writes and reports).

        Rows with a corrupt scale/radius become inert (codes 0, the codec's neutral scale), codes
        no encoder writes become 0 (fp8 NaN codes; non-finite f32 values), and so do non-finite
        indexer values.

        Returns
        -------
        records : structured array [n] of :func:`record_dtype`, a copy
        actions : list of str
        """
        codec = self.tier.row_codec
        fixed = self.records.copy()
        layers = fixed["layers"]
        actions = []
        for which in ("L", "R"):
            codes = layers[which + "c"]
            bad_codes = codec.bad_codes(codes)  # before the inert rows are zeroed: all are counted
            if codec.scaled:
                bad = codec.corrupt_scales(layers[which + "s"])
                if bad.any():
                    codes[bad] = 0
                    layers[which + "s"][bad] = codec.inert_scale
                    actions.append(f"made {int(bad.sum())} {which}c rows with a bad {codec.scale_kind} inert")
            if bad_codes is not None and codec.code_damage is not None and bad_codes.any():
                codes[bad_codes] = 0
                text = _CODE_DAMAGE_TEXT[codec.code_damage].replace("f32", codec.name)
                actions.append(f"zeroed {int(bad_codes.sum())} {text} in {which}c rows")
        if self.geometry.nic:
            index = fixed["index"]
            bad = ~np.isfinite(index)
            if bad.any():
                index[bad] = 0.0
                actions.append(f"zeroed {int(bad.sum())} non-finite f32 values in indexer rows")
        return fixed, actions

    def slice(self, start: int, stop: int) -> KVRecords:
        """Records ``start .. stop`` as their own KVRecords (a view, no copy)."""
        part = self.records[start:stop]
        return KVRecords(self.header.with_nrec(part.shape[0]), part, HEADER_BYTES + part.nbytes)

    def check_scales(self, source: str) -> None:
        """Refuse these records if one holds a scale/radius no encoder writes (:func:`check_scales`).

        For callers that want strictness; without it the loader makes such rows inert and counts
        them (:attr:`problems`, ``damaged_records()``). ``source`` names the file in the reason.
        """
        check_scales(self.records, self.tier, source=source)

    def record_bytes(self, start: int = 0, stop: int | None = None) -> bytes:
        """The raw bytes of records ``start .. stop`` (no header), as stored."""
        return self.records[start:stop].tobytes()


#: What :func:`check_scales` tells the reader of a damaged file to do (a store names its own tools).
FILE_ADVICE = (
    "the file is damaged: kvstore inspect shows where, kvstore repair neutralizes it, a load without strict "
    "reads such rows as zeros"
)


def check_scales(
    records: np.ndarray, tier: Tier, *, source: str, first_record: int = 0, advice: str = FILE_ADVICE
) -> None:
    """Raise :class:`BadScale` if a record holds a stored scale (fp8) or radius (int4, polarB) that
    :meth:`Tier.corrupt_scales` calls corrupt — the one bound of every reader, applied strictly.

    Parameters
    ----------
    records : structured array [n] of :func:`record_dtype` (``tier``'s)
    source : what the records are read from (a path), named in the reason
    first_record : the index of ``records[0]`` in its file (for a chunk of a longer file)
    advice : what the reason tells the user to do (default :data:`FILE_ADVICE`)

    >>> import numpy as np
    >>> from kvstore.formats import tiers
    >>> from kvstore.formats.coli_kv import encode_records
    >>> g = Geometry(1, 4, 2, 0, 0, 10)
    >>> rows = encode_records(g, tiers.FP8, [1, 2], np.ones((1, 2, 4)), np.ones((1, 2, 2)))
    >>> rows["layers"]["Rs"][1, 0] = 1e37
    >>> check_scales(rows, tiers.FP8, source="chat.coli_kv", first_record=40)
    Traceback (most recent call last):
    ...
    kvstore.formats.errors.BadScale: chat.coli_kv: record 41 (token 2), layer 0: the R row's scale 1e+37 is outside (0, 7.589e+35], the range every encoder writes (1 of these 2 records holds one); the file is damaged: kvstore inspect shows where, kvstore repair neutralizes it, a load without strict reads such rows as zeros
    """
    if not tier.file_tier.row_codec.scaled or records.shape[0] == 0:
        return
    layers = records["layers"]
    check_row_scales(
        tier,
        layers["Ls"],
        layers["Rs"],
        source=source,
        first_record=first_record,
        tokens=records["token"],
        advice=advice,
    )


def check_row_scales(
    tier: Tier,
    l_scales: np.ndarray,
    r_scales: np.ndarray,
    *,
    source: str,
    first_record: int = 0,
    first_layer: int = 0,
    tokens: np.ndarray | None = None,
    advice: str = FILE_ADVICE,
) -> None:
    """:func:`check_scales` on the scales alone: ``l_scales``/``r_scales`` f32[n, layers] (record
    ``first_record + i``, layer ``first_layer + j``), as a device upload holds them."""
    tier = tier.file_tier
    bad = {"L": tier.corrupt_scales(l_scales), "R": tier.corrupt_scales(r_scales)}  # bool[n, layers]
    hit = np.asarray(bad["L"].any(axis=1) | bad["R"].any(axis=1))  # bool[n]
    if not hit.any():
        return
    record = int(np.argmax(hit))
    which = "L" if bad["L"][record].any() else "R"
    layer = int(np.argmax(bad[which][record]))
    value = float((l_scales if which == "L" else r_scales)[record, layer])
    token = f" (token {int(tokens[record])})" if tokens is not None else ""
    kind = tier.row_codec.scale_kind
    count = int(np.count_nonzero(hit))
    raise BadScale(
        f"{source}: record {first_record + record}{token}, layer {first_layer + layer}: the {which} row's {kind} "
        f"{value:g} is outside {tier.scale_range}, the range every encoder writes ({count} of these {hit.shape[0]} "
        f"records hold{'s' * (count == 1)} one); {advice}"
    )
