"""How the API reads and writes tiers: a canonical name in, the tier object with its name out.

**In.** The JSON field ``tier`` (session creation, ``/lookup``, migrate) and the ``tier`` query
parameter of resume take a canonical name of :mod:`kvstore.tiers`: ``"f32"``, ``"fp8"``,
``"int4"``, ``"polar2"`` .. ``"polar6"`` (a session holds file tiers only; ``bf16``/``q8`` are the
engine's cache tiers). For one release the old spellings are accepted too — the object
``{"version": 2, "codec": ..., "bits": ...}``, old strings (``"v2"``, ``"polar-3"``,
``"v3:polar:3"``, ``"tq-int4"``, ...) and migrate's ``{"to": "v3", "codec": ..., "bits": ...}`` —
and the response then carries ``Deprecation: true`` and ``Warning: 299 - "<note>"``, the note
naming the canonical spelling; the server logs each old spelling once. An unknown tier is
``422 UnknownTier`` with the names the field accepts (a session's: the file tiers only).

**Out.** ``{"name": "fp8", "version": 2, "codec": null, "bits": null, "description": "..."}``:
the object earlier releases returned, with the canonical ``name`` added.
"""

from __future__ import annotations

import logging
import threading
from typing import Annotated, Any, Literal, NamedTuple

from fastapi import Response
from pydantic import BaseModel, ConfigDict, Field, field_validator

from kvstore import config, tiers
from kvstore.formats.coli_kv import Tier

log = logging.getLogger("kvstore.api")

#: The tiers a session (a ``.coli_kv`` journal) can hold, in the vocabulary's order.
SESSION_TIERS = tuple(tiers.names(in_file=True))
MAX_TIER_CHARS = 32
DEFAULT_TIER = config.SESSION_TIER.value
_MAX_LOGGED_SPELLINGS = 256  # more than the old spellings that parse; bounds what a client can make it keep


class TierObject(BaseModel):
    """Deprecated: the tier as ``{"version": 1|2|3, "codec": "int4"|"polar", "bits": 2..6}``; send its name."""

    model_config = ConfigDict(extra="forbid", strict=True, json_schema_extra={"deprecated": True})

    version: Literal[1, 2, 3] = 2
    codec: Literal["polar", "int4"] | None = None
    bits: int | None = Field(default=None, ge=2, le=6)

    @field_validator("version", mode="before")
    @classmethod
    def _not_a_bool(cls, version: Any) -> Any:
        if isinstance(version, bool):  # True == 1: a literal check alone would take it as v1
            raise ValueError("version is 1, 2 or 3 (a number, not a boolean)")
        return version

    def spelled(self) -> str:
        """The object as the client wrote it (fields left out are not shown), for notes and logs."""
        given = self.model_dump(exclude_unset=True)
        return "{" + ", ".join(f"{key}: {value}" for key, value in given.items()) + "}"


#: The JSON ``tier`` field: a canonical name, or (deprecated) the old object.
TierField = Annotated[
    Annotated[str, Field(min_length=1, max_length=MAX_TIER_CHARS)] | TierObject,
    Field(
        description=f"the tier's name: {', '.join(SESSION_TIERS)} (the object form {{version, codec, bits}} and old "
        "spellings such as 'v2' or 'polar-3' are deprecated: accepted with a Deprecation header)",
        examples=["fp8"],
    ),
]


class TierRead(NamedTuple):
    """A tier the request named, and the deprecation note when it was named the old way (else None)."""

    tier: Tier
    note: str | None


def read_tier(spelled: str | TierObject, *, sessions: bool = True) -> TierRead:
    """The tier a request field or query parameter names.

    Parameters
    ----------
    spelled : a canonical name, an old string spelling, or the old object
    sessions : only the file tiers a session holds are accepted (``bf16``/``q8`` are refused)

    Raises
    ------
    tiers.UnknownTier
        A name (or object) that names no tier, or a cache-only tier where a session's is wanted.
    """
    if isinstance(spelled, TierObject):
        tier, _ = tiers.resolve(f"v{spelled.version}", codec=spelled.codec, bits=spelled.bits)
        note = f"the tier object {spelled.spelled()} is deprecated: send the name {tier.name!r} instead"
        key = f"object {spelled.version}/{spelled.codec}/{spelled.bits}"
    else:
        try:
            tier, note = tiers.resolve(spelled)
        except tiers.UnknownTier as exc:
            if not (sessions and exc.reason.startswith("unknown tier")):
                raise
            # where a session's tier is wanted, the names listed are the ones that are accepted
            raise tiers.UnknownTier(
                f"unknown tier {spelled!r}; a session holds one of {', '.join(SESSION_TIERS)}"
            ) from None
        key = spelled.strip().lower()
    if sessions and not tier.in_file:
        raise tiers.UnknownTier(
            f"tier {tier.name!r} is a cache tier of the engine, with no .coli_kv version of its own; "
            f"a session holds one of {', '.join(SESSION_TIERS)}"
        )
    if note is not None:
        _log_once(key, note)
    return TierRead(tier, note)


def read_migrate_target(tier: str | None, to: str | None, codec: str | None, bits: int | None) -> TierRead:
    """The target of a migrate body: ``{"tier": name}``, or (deprecated) ``{"to", "codec", "bits"}``.

    The body model has already checked that exactly one of ``tier`` and ``to`` is given.
    """
    if to is None:
        return read_tier(tier if tier is not None else "")
    target, _ = tiers.resolve(to, codec=codec, bits=bits)
    fields = (("to", to), ("codec", codec), ("bits", bits))
    given = ", ".join(f"{name}: {value}" for name, value in fields if value is not None)
    note = f"migrate's {{{given}}} is deprecated: send tier {target.name!r} instead"
    _log_once(f"migrate {to}/{codec}/{bits}", note)
    return TierRead(target, note)


_logged: set[str] = set()
_logged_lock = threading.Lock()


def _log_once(key: str, note: str) -> None:
    """Log a deprecated spelling the first time this process sees it."""
    with _logged_lock:
        if key in _logged or len(_logged) >= _MAX_LOGGED_SPELLINGS:
            return
        _logged.add(key)
    log.warning("deprecated tier spelling: %s", note)


def deprecation_headers(*notes: str | None) -> dict[str, str]:
    """``Deprecation: true`` and one ``Warning: 299 - "<note>"`` value per note (none without notes)."""
    given = [note for note in notes if note]
    if not given:
        return {}
    return {"Deprecation": "true", "Warning": ", ".join(f'299 - "{_quoted(note)}"' for note in given)}


def mark_deprecated(response: Response, *notes: str | None) -> None:
    """Add :func:`deprecation_headers` to the response FastAPI sends for this request."""
    for name, value in deprecation_headers(*notes).items():
        response.headers[name] = value


def _quoted(note: str) -> str:
    # A quoted-string of an HTTP header: ASCII, with quotes and backslashes escaped.
    ascii_note = note.encode("ascii", "backslashreplace").decode("ascii")
    return ascii_note.replace("\\", "\\\\").replace('"', '\\"')
