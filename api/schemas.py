"""Request and response bodies (JSON). Rows never travel as JSON: see the binary media types."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from kvstore.api.tier_fields import DEFAULT_TIER, MAX_TIER_CHARS, TierField, TierRead, read_migrate_target, read_tier
from kvstore.formats import coli_kv
from kvstore.formats.coli_kv import Geometry, Tier
from kvstore.store import Fingerprint, ModelInfo
from kvstore.store.values import MAX_TTL_S

INT32_MAX = 2**31 - 1
JSON_BODY_BYTES = 64 << 10  # a request body of small fields (create, fork, truncate, tags, migrate)
TOKENS_BODY_BYTES = 8 << 20  # a body with a token list: ~1.2M six-digit ids (lookup, generate)
_IDS_SLICE = 1 << 16
RAW_MEDIA_TYPE = "application/octet-stream"
ARROW_MEDIA_TYPE = "application/vnd.apache.arrow.stream"
COLI_KV_MEDIA_TYPE = "application/x-coli-kv"


class Strict(BaseModel):
    # strict: a JSON value must already have the field's type. In pydantic's lax mode
    # {"n_records": false} was read as 0 (a malformed truncate emptied the session) and "3" or 3.0
    # as 3; now they are refused with 422 like any other wrong type.
    model_config = ConfigDict(extra="forbid", strict=True)
    #: the largest JSON body of this model a route reads (413 past it; ``--max-body`` if smaller)
    max_body_bytes: ClassVar[int] = JSON_BODY_BYTES


def check_token_ids(tokens: list[int]) -> list[int]:
    """Refuse ids outside int32, a slice at a time: ``min``/``max`` hold the GIL for a whole pass, so
    a body of a million ids is checked in steps the event loop can run between."""
    for start in range(0, len(tokens), _IDS_SLICE):
        part = tokens[start : start + _IDS_SLICE]
        if min(part) < 0 or max(part) > INT32_MAX:
            raise ValueError("token ids are non-negative 32-bit integers")
    return tokens


_JSON_TYPES = {float: "a number with a fraction", bool: "a boolean", type(None): "null", str: "a string"}


def only_integers(items: Any) -> Any:
    """A ``mode="before"`` check of a token list: anything but integers is refused with one error.

    Pydantic reports every bad item: 8 MiB of ``0.5,`` made 2 million validation errors, ~45 s of
    CPU with the GIL held for up to 16 s (the event loop stalled). The items are looked at a slice
    at a time in Python, so the GIL is given up as it goes.
    """
    if isinstance(items, list):
        for start in range(0, len(items), _IDS_SLICE):
            part = items[start : start + _IDS_SLICE]
            if not all(type(item) is int for item in part):
                at, bad = next((start + i, x) for i, x in enumerate(part) if type(x) is not int)
                shown = _JSON_TYPES.get(type(bad), "an array" if isinstance(bad, list) else "an object")
                raise ValueError(f"token ids are integers; item {at} is {shown}")
    return items


def token_array(tokens: list[int]) -> np.ndarray:
    """``tokens`` as int64[n], converted a slice at a time (one ``np.asarray`` of a million Python
    ints holds the GIL for ~0.1 s, and the event loop waits that long)."""
    parts = [np.asarray(tokens[at : at + _IDS_SLICE], dtype=np.int64) for at in range(0, len(tokens), _IDS_SLICE)]
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)


class ErrorBody(BaseModel):
    """Every error response: the error's type and a reason a person can act on."""

    error: str = Field(examples=["SessionNotFound"])
    reason: str = Field(examples=["no session 'chat-1'"])


class ModelIn(Strict):
    name: str = Field(min_length=1, max_length=256, examples=["glm-4.5"])
    revision: str = Field(min_length=1, max_length=256, examples=["main"])
    weights_hash: str | None = Field(default=None, max_length=256)
    tokenizer_hash: str | None = Field(default=None, max_length=256)
    chat_template_hash: str | None = Field(default=None, max_length=256)
    attention_variant: str | None = Field(default=None, max_length=256)

    def to_model(self) -> ModelInfo:
        return ModelInfo.from_dict(self.model_dump())


class GeometryIn(Strict):
    """The six header words h0..h5 of the model's ``.coli_kv`` files."""

    n_layers: int = Field(ge=1, le=coli_kv.MAX_LAYERS, examples=[78])
    kv_lora: int = Field(ge=1, le=coli_kv.MAX_WIDTH, examples=[512])
    qk_rope: int = Field(ge=1, le=coli_kv.MAX_WIDTH, examples=[64])
    index_hd: int = Field(default=0, ge=0, le=coli_kv.MAX_WIDTH)
    nic: int = Field(default=0, ge=0, le=coli_kv.MAX_LAYERS)
    vocab: int = Field(ge=1, le=INT32_MAX, examples=[151552])

    def to_geometry(self) -> Geometry:
        return Geometry(self.n_layers, self.kv_lora, self.qk_rope, self.index_hd, self.nic, self.vocab)


class TierOut(BaseModel):
    name: str = Field(description="the tier's canonical name", examples=["fp8"])
    version: int = Field(description=".coli_kv version of the session's journal")
    codec: str | None = Field(description="v3 only: int4 or polar")
    bits: int | None = Field(description="v3 only")
    description: str


class CreateSession(Strict):
    id: str | None = Field(
        default=None, description="1-64 of [A-Za-z0-9_-], starting with a letter or digit; generated if absent"
    )
    model: ModelIn
    geometry: GeometryIn
    tier: TierField = DEFAULT_TIER
    tags: list[str] = Field(default_factory=list, max_length=32)
    ttl_s: float | None = Field(
        default=None,
        gt=0,
        le=MAX_TTL_S,
        description="its own time-to-live: it expires this many seconds after its last use (none: its owner's, if any)",
    )

    def read_tier(self) -> TierRead:
        return read_tier(self.tier)


class SessionOut(BaseModel):
    id: str
    owner: str
    model: dict[str, Any]
    geometry: dict[str, int]
    tier: TierOut
    record_bytes: int
    n_records: int
    watermark: int = Field(description="records that end on a complete turn: what resume serves")
    created: float
    updated: float
    last_used: float
    size_bytes: int
    tags: list[str]
    state: Literal["active", "parked", "damaged"]
    parent: str | None
    fork_point: int | None
    problem: str | None
    fingerprint: str
    ttl_s: float | None = Field(default=None, description="its own time-to-live in seconds (null: its owner's, if any)")
    expires_at: float | None = Field(
        default=None,
        description="when it expires: its last use plus the TTL in force (seconds since the epoch; null: never)",
    )


#: ``GET /sessions``: sessions per page when ``limit`` is not given, and the most one page may hold.
DEFAULT_PAGE = 100
MAX_PAGE = 1000


class SessionList(BaseModel):
    sessions: list[SessionOut] = Field(description="one page, oldest first")
    next_cursor: str | None = Field(description="pass it as ``cursor`` for the next page; null: this page is the last")


class SessionPatch(Strict):
    """``PATCH /sessions/{id}``: the fields given change, the others stay (at least one)."""

    tags: list[str] | None = Field(default=None, max_length=32, description="replace the tags")
    ttl_s: float | None = Field(
        default=None,
        gt=0,
        le=MAX_TTL_S,
        description="its own time-to-live in seconds, counted from now (a change is a use); null drops it",
    )

    @model_validator(mode="after")
    def _something(self) -> "SessionPatch":
        if not self.model_fields_set:
            raise ValueError("give tags, ttl_s or both")
        if "tags" in self.model_fields_set and self.tags is None:
            raise ValueError("tags is a list (an empty one drops every tag)")
        return self


class SanitizedOut(BaseModel):
    """NaN and infinite values in the appended rows, stored by the tier's rule (never as given)."""

    values: int = Field(description="non-finite values (NaN, +inf, -inf) in the rows")
    rows_zeroed: int = Field(
        description="L/R rows stored as all zeros because of them (fp8: a row holding an infinity; int4/polar: "
        "a row holding either); f32 and indexer values become 0 one by one"
    )


class AppendOut(BaseModel):
    session: SessionOut
    appended: int
    turn: list[int] | None = Field(description="[start, end): the records this call hashed as one turn")
    sanitized: SanitizedOut


class TruncateIn(Strict):
    n_records: int = Field(ge=0, le=INT32_MAX)


class ForkIn(Strict):
    at: int | None = Field(default=None, ge=0, le=INT32_MAX, description="records to copy (default: the watermark)")
    id: str | None = None
    tags: list[str] | None = Field(default=None, max_length=32)


class BadTurn(BaseModel):
    turn: int
    start: int
    end: int


class VerifyOut(BaseModel):
    session_id: str
    ok: bool
    n_records: int
    turns_checked: int
    first_bad: BadTurn | None
    good_records: int


class RepairOut(BaseModel):
    session_id: str
    dry_run: bool
    actions: list[str]
    kept_records: int
    dropped_records: int
    first_bad: BadTurn | None


class MigrateIn(Strict):
    """The target tier, by name. ``to``/``codec``/``bits`` are the deprecated form (one release)."""

    tier: str | None = Field(default=None, min_length=1, max_length=MAX_TIER_CHARS, examples=["int4"])
    to: Literal["v1", "v2", "v3"] | None = Field(default=None, json_schema_extra={"deprecated": True})
    codec: Literal["polar", "int4"] | None = Field(default=None, json_schema_extra={"deprecated": True})
    bits: int | None = Field(default=None, ge=2, le=6, json_schema_extra={"deprecated": True})

    @model_validator(mode="after")
    def _one_target(self) -> "MigrateIn":
        if (self.tier is None) == (self.to is None):
            raise ValueError("name the target as 'tier' (e.g. \"int4\"), not both 'tier' and 'to', and not neither")
        if self.tier is not None and (self.codec is not None or self.bits is not None):
            raise ValueError(
                "'codec' and 'bits' go with the deprecated 'to'; with 'tier', name the tier alone (e.g. \"polar3\")"
            )
        return self

    def read_tier(self) -> TierRead:
        return read_migrate_target(self.tier, self.to, self.codec, self.bits)


class LookupIn(Strict):
    max_body_bytes: ClassVar[int] = TOKENS_BODY_BYTES
    model: ModelIn
    geometry: GeometryIn
    tier: TierField = DEFAULT_TIER
    tokens: list[int] = Field(description="the prompt's token ids")

    @field_validator("tokens", mode="before")
    @classmethod
    def _only_integers(cls, tokens: Any) -> Any:
        return only_integers(tokens)

    @field_validator("tokens")
    @classmethod
    def _in_int32(cls, tokens: list[int]) -> list[int]:
        return check_token_ids(tokens)

    def read_tier(self) -> TierRead:
        return read_tier(self.tier)

    def fingerprint(self, tier: Tier) -> Fingerprint:
        return Fingerprint(self.model.to_model(), self.geometry.to_geometry(), tier)


class LookupMatch(BaseModel):
    session_id: str
    matched_tokens: int = Field(description="the common prefix: tokens a resume of that session reuses")
    state: str
    n_records: int
    watermark: int


class LookupOut(BaseModel):
    match: LookupMatch | None
    keys_destroyed_at: float | None = Field(
        None,
        description="on a store encrypted at rest, when the caller's data keys were destroyed (`kvstore crypto "
        "shred`, seconds since the epoch); a client holding the caller's rows in memory drops them",
    )


class JobOut(BaseModel):
    id: str
    kind: Literal["park", "unpark", "migrate"]
    session_id: str
    state: Literal["queued", "running", "done", "failed"]
    done: int = Field(description="work done, in the job's units (bytes; records for migrate)")
    total: int
    fraction: float = Field(ge=0, le=1, description="share of the work done (1 when done)")
    bytes_done: int = Field(description="bytes processed so far (journal bytes read or written)")
    bytes_total: int
    result: dict[str, Any] | None
    error: ErrorBody | None
    created: float
    finished: float | None


class HealthOut(BaseModel):
    status: Literal["ok"]
    version: str
    schema_version: int


# ---- generation (kvstore serve --model) ------------------------------------------------------
class GenerateIn(Strict):
    """One turn: the new tokens (ids, or text when the model folder has a tokenizer), not the history."""

    max_body_bytes: ClassVar[int] = TOKENS_BODY_BYTES
    tokens: list[int] | None = Field(default=None, description="the new turn's token ids")
    text: str | None = Field(default=None, max_length=1 << 20, description="the new turn as text (needs a tokenizer)")
    max_new_tokens: int = Field(default=64, ge=0, le=1 << 20)
    temperature: float = Field(default=0.0, ge=0.0, description="0 is greedy")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1)
    stop: list[int] | None = Field(default=None, description="stop token ids (default: the model's eos; [] for none)")
    stream: bool = Field(default=False, description="server-sent events (also with Accept: text/event-stream)")
    verify: bool = Field(
        default=False, description="re-hash the session's turns before restoring; a bad turn is a miss"
    )
    override: list[str] = Field(
        default_factory=list, max_length=8, description="fingerprint fields not to compare, e.g. model.weights_hash"
    )
    create: bool = Field(
        default=False, description="create the session (with the engine's fingerprint) if it does not exist"
    )
    tags: list[str] = Field(default_factory=list, max_length=32, description="tags of a session this call creates")

    @field_validator("tokens", "stop", mode="before")
    @classmethod
    def _only_integers(cls, tokens: Any) -> Any:
        return only_integers(tokens)

    @field_validator("tokens")
    @classmethod
    def _ids_in_int32(cls, tokens: list[int] | None) -> list[int] | None:
        return check_token_ids(tokens) if tokens is not None else None


class GenerateOut(BaseModel):
    session_id: str
    created: bool
    tokens: list[int]
    text: str | None
    finish_reason: Literal["stop", "length", "cancelled"]
    prompt_tokens: int = Field(description="tokens of the new turn")
    prefilled_tokens: int = Field(description="context tokens run through the model by this call (the new turn)")
    reused_tokens: int = Field(description="context tokens whose stored rows were reused, not prefilled")
    source: Literal["live", "journal", "new"] = Field(description="where the reused rows came from")
    restored_tokens: int
    damaged_from: int | None = Field(description="first record of a bad turn verify found (that tail was not served)")
    dropped_records: int = Field(description="stored records past the served ones, cut before appending")
    upgraded: str | None = Field(description="the session's file was upgraded to the engine's tier (v1 -> v2/v3)")
    appended: int
    seed: int | None
    timings: dict[str, float]
    session: SessionOut


class EngineOut(BaseModel):
    folder: str | None
    model: dict[str, Any]
    geometry: dict[str, int]
    cache_tier: str
    journal_tier: str
    bytes_per_token: int
    device: str
    dtype: str
    tokenizer: bool
    fingerprint: str
