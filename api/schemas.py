"""Request and response bodies (JSON). Rows never travel as JSON: see the binary media types."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from kvstore.formats import coli_kv
from kvstore.formats.coli_kv import Geometry, Tier
from kvstore.sessions import Fingerprint, ModelInfo

INT32_MAX = 2**31 - 1
RAW_MEDIA_TYPE = "application/octet-stream"
ARROW_MEDIA_TYPE = "application/vnd.apache.arrow.stream"
COLI_KV_MEDIA_TYPE = "application/x-coli-kv"


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


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


class TierIn(Strict):
    """Record format: 1 = f32, 2 = fp8 e4m3, 3 = TurboQuant (codec ``int4`` with 4 bits, or ``polar`` 2-6)."""

    version: Literal[1, 2, 3] = 2
    codec: Literal["polar", "int4"] | None = None
    bits: int | None = Field(default=None, ge=2, le=6)

    def to_tier(self) -> Tier:
        return Tier.parse(f"v{self.version}", self.codec, self.bits)


class TierOut(BaseModel):
    version: int
    codec: str | None
    bits: int | None
    description: str


class CreateSession(Strict):
    id: str | None = Field(default=None, description="1-64 of [A-Za-z0-9_-], starting with a letter or digit; generated if absent")
    model: ModelIn
    geometry: GeometryIn
    tier: TierIn = TierIn()
    tags: list[str] = Field(default_factory=list, max_length=32)


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


class SessionList(BaseModel):
    sessions: list[SessionOut]


class TagsIn(Strict):
    tags: list[str] = Field(max_length=32)


class AppendOut(BaseModel):
    session: SessionOut
    appended: int
    turn: list[int] | None = Field(description="[start, end): the records this call hashed as one turn")


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
    to: Literal["v1", "v2", "v3"]
    codec: Literal["polar", "int4"] | None = None
    bits: int | None = Field(default=None, ge=2, le=6)

    def to_tier(self) -> Tier:
        return Tier.parse(self.to, self.codec, self.bits)


class LookupIn(Strict):
    model: ModelIn
    geometry: GeometryIn
    tier: TierIn = TierIn()
    tokens: list[int] = Field(description="the prompt's token ids")

    @field_validator("tokens")
    @classmethod
    def _in_int32(cls, tokens: list[int]) -> list[int]:
        if tokens and (min(tokens) < 0 or max(tokens) > INT32_MAX):
            raise ValueError("token ids are non-negative 32-bit integers")
        return tokens

    def fingerprint(self) -> Fingerprint:
        return Fingerprint(self.model.to_model(), self.geometry.to_geometry(), self.tier.to_tier())


class LookupMatch(BaseModel):
    session_id: str
    matched_tokens: int = Field(description="the common prefix: tokens a resume of that session reuses")
    state: str
    n_records: int
    watermark: int


class LookupOut(BaseModel):
    match: LookupMatch | None


class JobOut(BaseModel):
    id: str
    kind: Literal["park", "unpark", "migrate"]
    session_id: str
    state: Literal["queued", "running", "done", "failed"]
    done: int
    total: int
    result: dict[str, Any] | None
    error: ErrorBody | None
    created: float
    finished: float | None


class HealthOut(BaseModel):
    status: Literal["ok"]
    version: str
    schema_version: int
