"""One conformance suite every registered codec passes (subclass per codec)."""

import json

import numpy as np
import pytest

from kvstore.formats import codec as codecs
from kvstore.formats import coli_kv
from kvstore.formats.coli_kv import Geometry, Tier
from kvstore.formats.errors import FormatError


class CodecConformance:
    codec: codecs.Codec
    #: relative L2 error allowed on Gaussian rows
    tolerance: float
    widths = (32, 64, 512)

    def rows(self, n, count=17, seed=0):
        rng = np.random.default_rng(seed)
        return (rng.standard_normal((count, n)) * rng.uniform(0.01, 50, (count, 1))).astype(np.float32)

    def test_config_round_trips_through_json(self):
        config = json.loads(json.dumps(self.codec.get_config()))
        assert codecs.get_codec(config) == self.codec
        assert config["id"] in codecs.REGISTRY

    @pytest.mark.parametrize("lead", [(), (3,), (2, 5)])
    def test_shapes(self, lead):
        n = self.widths[0]
        rows = self.rows(n, count=int(np.prod(lead, dtype=int)) or 1).reshape(*lead, n) if lead else self.rows(n, 1)[0]
        stored = self.codec.encode(rows)
        assert stored.dtype == np.uint8 and stored.shape == (*rows.shape[:-1], self.codec.row_bytes(n))
        assert self.codec.decode(stored, n).shape == rows.shape

    @pytest.mark.parametrize("n_index", [0, 1, 2])
    def test_round_trip_error(self, n_index):
        n = self.widths[n_index]
        rows = self.rows(n, seed=n)
        back = self.codec.decode(self.codec.encode(rows), n)
        rel = np.linalg.norm(back - rows, axis=-1) / np.linalg.norm(rows, axis=-1)
        assert rel.max() <= self.tolerance

    def test_decode_into_out(self):
        n = self.widths[1]
        rows = self.rows(n)
        out = np.full(rows.shape, np.nan, np.float32)
        assert self.codec.decode(self.codec.encode(rows), n, out=out) is out
        assert np.isfinite(out).all()

    def test_zero_rows_decode_to_zero(self):
        n = self.widths[1]
        back = self.codec.decode(self.codec.encode(np.zeros((4, n), np.float32)), n)
        assert (back == 0).all()



class FileCodecConformance(CodecConformance):
    """Codecs of a .coli_kv version: a stored row is byte for byte the row inside a record."""

    def test_stored_rows_are_the_file_rows(self):
        g = Geometry(1, 64, 32, 0, 0, 10)
        tier = {1: Tier(1), 2: Tier(2)}.get(self.codec.version) or Tier(3, self.codec.tq_codec, self.codec.bits)
        L = self.rows(64, 3)[None]
        R = self.rows(32, 3, seed=5)[None]
        records = coli_kv.parse(coli_kv.encode_file(g, np.arange(3, dtype=np.int32), L, R, version=tier.version,
                                                    codec=tier.codec, bits=tier.bits)).records
        layer = records["layers"][:, 0]
        width = self.codec.row_bytes(64)
        stored_L = np.frombuffer(layer.tobytes(), np.uint8).reshape(3, -1)[:, :width]
        assert (stored_L == self.codec.encode(L[0])).all()


class TestF32(FileCodecConformance):
    codec = codecs.F32()
    tolerance = 0.0


class TestFp8(FileCodecConformance):
    codec = codecs.Fp8()
    tolerance = 0.06


class TestTQInt4(FileCodecConformance):
    codec = codecs.TQInt4()
    tolerance = 0.16


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6])
def test_polar_bits_are_configurable(bits):
    codec = codecs.get_codec({"id": "tq-polar", "bits": bits})
    assert codec.row_bytes(512) == -(-(256 * bits + 255 * max(bits - 1, 1)) // 8) + 4


class TestTQPolar4(FileCodecConformance):
    codec = codecs.TQPolar(bits=4)
    tolerance = 0.25


class TestQ8(CodecConformance):
    codec = codecs.Q8_0()
    tolerance = 0.01


def test_unknown_codec_and_bad_config_are_typed_errors():
    with pytest.raises(FormatError, match="unknown codec"):
        codecs.get_codec({"id": "zfp"})
    with pytest.raises(FormatError):
        codecs.get_codec({"id": "tq-int4", "bits": 3})
    with pytest.raises(FormatError):
        codecs.get_codec({"id": "fp8", "group": 3})
