"""The API speaks the tier vocabulary: canonical names in and out, old spellings for one release.

A tier given the old way (the ``{version, codec, bits}`` object, ``v2``, ``polar-3``, ``v3:polar:3``,
migrate's ``{to, codec, bits}``) works and is answered with ``Deprecation: true`` and
``Warning: 299 - "<note>"`` naming the canonical spelling; the server logs each old spelling once.
An unknown tier is ``422 UnknownTier`` with the known names. Served end to end by a real server;
the pieces without HTTP (headers, notes, settings) are checked directly too.
"""

from __future__ import annotations

import re
import warnings

import pytest

from kvstore import tiers
from kvstore.api.settings import Settings
from kvstore.api.tier_fields import SESSION_TIERS, TierObject, deprecation_headers, read_tier
from kvstore.errors import ConfigError
from served import wait_job
from store.support import MODEL

GEOMETRY_JSON = {"n_layers": 2, "kv_lora": 32, "qk_rope": 8, "index_hd": 4, "nic": 1, "vocab": 1000}
WARNING = re.compile(r'^299 - "(?P<note>[^"\\]*(?:\\.[^"\\]*)*)"$')

#: Every old way of naming a session's tier, and the canonical name it means.
OLD_FORMS = [
    ({}, "fp8"),
    ({"version": 2}, "fp8"),
    ({"version": 1}, "f32"),
    ({"version": 3, "codec": "int4", "bits": 4}, "int4"),
    ({"version": 3, "codec": "polar", "bits": 3}, "polar3"),
    ({"version": 3, "codec": "polar"}, "polar4"),
    ("v1", "f32"),
    ("v2", "fp8"),
    ("polar-3", "polar3"),
    ("v3:polar:3", "polar3"),
    ("v3:int4:4", "int4"),
    ("tq-int4", "int4"),
    ("tq-polar", "polar4"),
]


def create(client, sid, tier=None):
    body = {"id": sid, "model": MODEL, "geometry": GEOMETRY_JSON}
    if tier is not None:
        body["tier"] = tier
    return client.post("/sessions", json=body)


def assert_deprecated(response, name: str) -> str:
    """The response carries the deprecation headers, the note naming ``name``; returns the note."""
    assert response.headers.get("deprecation") == "true", dict(response.headers)
    match = WARNING.match(response.headers.get("warning", ""))
    assert match, response.headers.get("warning")
    note = match.group("note")
    assert "deprecated" in note and repr(name) in note, note
    return note


def assert_current(response) -> None:
    assert "deprecation" not in response.headers and "warning" not in response.headers, dict(response.headers)


# ------------------------------------------------------------------ over HTTP
def test_canonical_names_in_and_out(alice):
    for name in SESSION_TIERS:
        created = create(alice, f"s-{name}", name)
        assert created.status_code == 201, created.text
        assert_current(created)
        tier = tiers.get(name)
        expected = {
            "name": name,
            "version": tier.version,
            "codec": tier.codec_name,
            "bits": tier.bits,
            "description": tier.describe(),
        }
        assert created.json()["tier"] == expected
        assert alice.get(f"/sessions/s-{name}").json()["tier"] == expected
        resumed = alice.get(f"/sessions/s-{name}/resume", params={"tier": name})
        assert resumed.status_code == 200 and resumed.headers["x-kv-tier-name"] == name
        assert_current(resumed)
    assert {s["tier"]["name"] for s in alice.get("/sessions").json()["sessions"]} == set(SESSION_TIERS)
    default = create(alice, "default-tier")
    assert default.status_code == 201 and default.json()["tier"]["name"] == "fp8"
    assert_current(default)
    looked = alice.post("/lookup", json={"model": MODEL, "geometry": GEOMETRY_JSON, "tier": "fp8", "tokens": [1, 2]})
    assert looked.status_code == 200 and looked.json() == {"match": None, "keys_destroyed_at": None}
    assert_current(looked)
    migrated = alice.post("/sessions/default-tier/file/migrate", json={"tier": "polar3"})
    assert migrated.status_code == 202
    assert_current(migrated)
    job = wait_job(alice, migrated.json())
    assert job["state"] == "done" and job["result"]["tier"]["name"] == "polar3"
    assert alice.get("/sessions/default-tier/resume").headers["x-kv-tier-name"] == "polar3"


def test_every_old_form_is_accepted_with_deprecation_headers_and_logged_once(server, alice):
    for i, (old, name) in enumerate(OLD_FORMS):
        created = create(alice, f"old-{i}", old)
        assert created.status_code == 201, (old, created.text)
        assert created.json()["tier"]["name"] == name
        assert_deprecated(created, name)
    again = create(alice, "old-again", "v2")  # a second request with the same spelling
    assert_deprecated(again, "fp8")

    resumed = alice.get("/sessions/old-again/resume", params={"tier": "v2"})
    assert resumed.status_code == 200 and resumed.headers["x-kv-tier-name"] == "fp8"
    assert_deprecated(resumed, "fp8")
    assert alice.get("/sessions/old-again/resume", params={"tier": "v3:int4:4"}).status_code == 409  # still compared

    looked = alice.post(
        "/lookup", json={"model": MODEL, "geometry": GEOMETRY_JSON, "tier": {"version": 2}, "tokens": [1]}
    )
    assert looked.status_code == 200
    assert_deprecated(looked, "fp8")

    migrated = alice.post("/sessions/old-again/file/migrate", json={"to": "v3", "codec": "polar", "bits": 3})
    assert migrated.status_code == 202
    note = assert_deprecated(migrated, "polar3")
    assert "tier" in note
    assert wait_job(alice, migrated.json())["result"]["tier"]["name"] == "polar3"
    back = alice.post("/sessions/old-again/file/migrate", json={"to": "v1"})
    assert_deprecated(back, "f32")
    assert wait_job(alice, back.json())["result"]["tier"]["name"] == "f32"

    server.stop()
    logged = [line for line in server.output.splitlines() if "deprecated tier spelling" in line]
    assert sum("tier 'v2' is deprecated" in line for line in logged) == 1, logged  # sent three times
    assert sum("polar-3" in line for line in logged) == 1
    assert sum("{to: v3, codec: polar, bits: 3}" in line for line in logged) == 1


def test_unknown_and_cache_only_tiers_are_refused_with_a_reason(alice):
    for bad in ("fp9", "v4", "polar7", "polar-1", "v3:int4:3", "int4:4", " "):
        refused = create(alice, "nope", bad)
        assert refused.status_code == 422, (bad, refused.text)
        body = refused.json()
        assert body["error"] in ("UnknownTier", "InvalidRequest") and body["reason"], body
    unknown = create(alice, "nope", "fp9").json()
    assert unknown["error"] == "UnknownTier" and "fp9" in unknown["reason"] and "polar3" in unknown["reason"]
    # the names listed are the ones this route takes: a session's tiers (bf16 is one: v4), never q8
    fp16 = create(alice, "nope", "fp16").json()
    assert fp16 == {
        "error": "UnknownTier",
        "reason": f"unknown tier 'fp16'; a session holds one of {', '.join(SESSION_TIERS)}",
    }
    words = set(re.findall(r"\w+", fp16["reason"]))
    assert "q8" not in words and "bf16" in words, fp16
    for cache_only in ("q8", "int8"):
        refused = create(alice, "nope", cache_only)
        assert refused.status_code == 422 and refused.json()["error"] == "UnknownTier"
        assert "cache tier" in refused.json()["reason"] and "fp8" in refused.json()["reason"]
    for wrong_type in (2, True, ["fp8"], {"version": 4}, {"version": 2, "codec": "zip"}, {"name": "fp8"}, "x" * 33):
        refused = create(alice, "nope", wrong_type)
        assert refused.status_code == 422 and refused.json()["error"] == "InvalidRequest", (wrong_type, refused.text)
    assert alice.get("/sessions/nope").status_code == 404

    assert create(alice, "there", "fp8").status_code == 201
    for params in ({"tier": "fp9"}, {"tier": "q8"}):
        refused = alice.get("/sessions/there/resume", params=params)
        assert refused.status_code == 422 and refused.json()["error"] == "UnknownTier", refused.text
    lookup = alice.post("/lookup", json={"model": MODEL, "geometry": GEOMETRY_JSON, "tier": "fp9", "tokens": [1]})
    assert lookup.status_code == 422 and lookup.json()["error"] == "UnknownTier"
    for body in (
        {"tier": "fp9"},
        {"tier": "q8"},
        {"tier": "int4", "to": "v3"},  # both forms
        {},  # neither
        {"tier": "polar3", "bits": 3},  # bits go with the old form only
        {"to": "v2", "codec": "polar"},
        {"tier": 4},
    ):
        refused = alice.post("/sessions/there/file/migrate", json=body)
        assert refused.status_code == 422 and refused.json()["reason"], (body, refused.text)
    assert alice.get("/jobs").json() == []
    assert alice.get("/sessions/there").json()["tier"]["name"] == "fp8"


def test_the_openapi_schema_names_the_tiers(server):
    with server.client(None) as anonymous:
        schema = anonymous.get("/openapi.json").json()
    create_tier = schema["components"]["schemas"]["CreateSession"]["properties"]["tier"]
    assert create_tier["default"] == "fp8" and "polar3" in create_tier["description"]
    assert {"type": "string", "minLength": 1, "maxLength": 32} in create_tier["anyOf"]
    assert schema["components"]["schemas"]["TierObject"]["deprecated"] is True
    assert schema["components"]["schemas"]["TierOut"]["required"][0] == "name"
    migrate = schema["components"]["schemas"]["MigrateIn"]["properties"]
    assert migrate["to"]["deprecated"] is True and "deprecated" not in migrate["tier"]


# ------------------------------------------------------------------ the pieces, without HTTP
def test_read_tier_gives_the_tier_and_the_note():
    assert read_tier("int4") == (tiers.INT4, None)
    assert read_tier(" FP8 ") == (tiers.FP8, None)
    tier, note = read_tier("v3:polar:3")
    assert tier is tiers.polar(3) and "'polar3'" in note
    tier, note = read_tier(TierObject(version=3, codec="int4", bits=4))
    assert (
        tier is tiers.INT4
        and note == "the tier object {version: 3, codec: int4, bits: 4} is deprecated: send the name 'int4' instead"
    )
    assert read_tier("bf16", sessions=False) == (tiers.BF16, None)
    with pytest.raises(tiers.UnknownTier, match="cache tier"):
        read_tier("q8")
    with pytest.raises(tiers.UnknownTier, match="unknown tier") as refused:
        read_tier("fp16")
    assert "bf16" in refused.value.reason and "q8" not in refused.value.reason
    with pytest.raises(tiers.UnknownTier, match=r"known: f32, bf16, fp8"):  # an engine's tier: every name
        read_tier("fp16", sessions=False)


def test_warning_headers_are_ascii_quoted_strings():
    assert deprecation_headers(None) == {}
    headers = deprecation_headers('tier "x\\y" é is deprecated', "second")
    assert headers["Deprecation"] == "true"
    assert headers["Warning"] == '299 - "tier \\"x\\\\y\\" \\\\xe9 is deprecated", 299 - "second"'
    headers["Warning"].encode("ascii")


def test_tier_json_keeps_the_old_fields_and_adds_the_name():
    assert tiers.polar(3).to_dict() == {
        "name": "polar3",
        "version": 3,
        "codec": "polar",
        "bits": 3,
        "description": tiers.polar(3).describe(),
    }
    assert tiers.F32.to_dict() == {
        "name": "f32",
        "version": 1,
        "codec": None,
        "bits": None,
        "description": tiers.F32.describe(),
    }


def test_engine_settings_take_canonical_names(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert Settings(data_dir=tmp_path).tier == "f32"
        assert Settings(data_dir=tmp_path, tier="polar3").tier == "polar3"
        assert Settings(data_dir=tmp_path, tier=tiers.Q8).tier == "q8"
    with pytest.warns(tiers.TierSpellingDeprecated, match="'polar3'"):
        old = Settings(data_dir=tmp_path, tier="tq-polar", bits=3)
    assert (old.tier, old.bits) == ("polar3", None)
    with pytest.warns(tiers.TierSpellingDeprecated, match="'q8'"):
        assert Settings(data_dir=tmp_path, tier="int8").tier == "q8"
    with pytest.raises(ConfigError, match="engine's tier.*unknown tier 'fp9'"):
        Settings(data_dir=tmp_path, tier="fp9")
