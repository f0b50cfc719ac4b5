"""Every registered row codec passes the codec conformance suite; the registry itself."""

from __future__ import annotations

import pytest

from conformance.codecs import TOLERANCE, CodecConformance
from kvstore.formats import codecs, tq
from kvstore.formats.codecs import RowCodec, register_codec, registered_codecs
from kvstore.formats.errors import FormatError, UnknownTier

#: Codecs whose golden vectors and torch twin agree within the spec's bounds rather than bit for
#: bit (PolarQuant goes through atan2f/hypotf/cosf/sinf).
APPROXIMATE = {name for name, codec in registered_codecs().items() if isinstance(codec, tq.PolarCodec)}


def _suite(codec: RowCodec) -> type:
    attributes = {"codec": codec, "tolerance": TOLERANCE[codec.name], "exact": codec.name not in APPROXIMATE}
    return type(f"TestCodec_{codec.name}", (CodecConformance,), attributes)


# One test class per registered codec: a codec registered in formats is tested without a line here.
for _codec in registered_codecs().values():
    globals()[f"TestCodec_{_codec.name}"] = _suite(_codec)


def test_every_codec_has_a_tolerance():
    assert set(TOLERANCE) == set(registered_codecs())


def test_the_registry_lists_the_docs_order():
    assert list(registered_codecs()) == [
        "f32",
        "bf16",
        "fp8",
        "int4",
        "polar2",
        "polar3",
        "polar4",
        "polar5",
        "polar6",
        "q8",
    ]


def test_a_tier_name_is_registered_once():
    with pytest.raises(FormatError, match="already registered"):

        class AnotherInt4(tq.Int4Codec):
            pass

        register_codec(AnotherInt4)


def test_registering_the_same_family_again_keeps_the_first():
    held = dict(registered_codecs())
    assert register_codec(tq.PolarCodec) is tq.PolarCodec
    assert all(registered_codecs()[name] is codec for name, codec in held.items())


def test_unknown_ids_and_configs_are_typed_errors():
    with pytest.raises(UnknownTier, match="unknown codec 'zfp'"):
        codecs.codec_for("zfp")
    with pytest.raises(UnknownTier):
        codecs.codec_from_config({"id": 3})
    with pytest.raises(UnknownTier):
        codecs.codec_from_config("fp8")  # type: ignore[arg-type]  (a bare name is not a config)


@pytest.mark.parametrize(
    "codec, bits",
    [(tq.CODEC_INT4, 3), (tq.CODEC_POLAR, 7), (tq.CODEC_POLAR, 3.0), (tq.CODEC_POLAR, True), (2, 4), (None, 4)],
)
def test_tq_codec_refuses_what_no_family_takes(codec, bits):
    with pytest.raises(FormatError):
        tq.tq_codec(codec, bits)


def test_tq_codec_is_the_registered_codec():
    assert tq.tq_codec(tq.CODEC_POLAR, 3) == registered_codecs()["polar3"]
    assert tq.tq_codec(tq.CODEC_INT4, 4) == registered_codecs()["int4"]
