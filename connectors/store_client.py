"""The few store calls a KV connector makes, over a local store folder or a running ``kvstore serve``.

:class:`~kvstore.connectors.prefix_cache.PrefixCache` runs one code path over either:

- :class:`LocalClient` (embedded mode): a store (:class:`~kvstore.store.Store`) opened in the engine's process,
  acting for one owner;
- :class:`ServiceClient` (service mode): the kvstore HTTP API with an API key (the key decides the
  owner), so engine processes on several machines share one store. Lookups are ``POST /lookup``,
  saves ``POST /sessions`` then ``POST /sessions/{id}/append`` (raw ``.coli_kv`` records of the
  session's tier), loads ``GET /sessions/{id}/resume?format=coli_kv`` with the fingerprint stated,
  so the server refuses rows of another fingerprint (409) and, with ``verify``, serves no damaged
  turn.

Both raise kvstore's typed errors: :class:`SessionExists` when a save finds the prompt stored
already, :class:`ServiceError` for any other refusal or an unreachable service.

A save hands over records already encoded (:func:`encode_rows`), so the bytes the connector hashes
for its fast check (``prefix_cache.rows_digest``) are the bytes the journal holds.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Protocol

import httpx
import numpy as np

from kvstore import tiers
from kvstore.errors import ConfigError, KeyShredded, KVStoreError, SessionExists, SessionNotFound
from kvstore.formats import coli_kv
from kvstore.formats.coli_kv import KVRecords
from kvstore.store import Fingerprint, ModelInfo, Store, validate_owner

# Through a service, how old the owner's shred mark may be before a hit from memory asks again
SHRED_CHECK_S = 1.0


class ServiceError(KVStoreError, RuntimeError):
    """The kvstore service refused a call or could not be reached (the reason carries its answer)."""


@dataclass(frozen=True)
class Found:
    """A stored session sharing ``tokens`` leading tokens with a prompt."""

    session_id: str
    tokens: int


@dataclass(frozen=True)
class Stored:
    """What the index says of one stored session: its fingerprint, the rows a resume serves, its tags."""

    fingerprint_key: str
    watermark: int
    tags: tuple[str, ...] = ()


def encode_rows(fingerprint: Fingerprint, tokens: np.ndarray, L, R) -> np.ndarray:
    """Rows as the records the store writes (structured array [n]; non-finite values stored as 0,
    as the journal does). ``L``/``R``: f32, or for the bf16 tier u16 bf16 bit patterns (a bf16
    cache's own bits, copied as they are: the same records as their f32 widening's)."""
    if np.asarray(L).dtype == np.uint16 and fingerprint.tier is tiers.BF16:
        return coli_kv.encode_bf16_records(fingerprint.geometry, tokens, L, R)
    return coli_kv.encode_records_counted(fingerprint.geometry, fingerprint.tier, tokens, L, R)[0]


@dataclass(frozen=True)
class Served:
    """What a load read: the served records (up to the watermark, verified when asked) and, when a
    verify found a bad turn, the first damaged record."""

    records: KVRecords
    damaged_from: int | None


class StoreClient(Protocol):
    """One owner's view of a store, as a connector uses it."""

    owner: str

    def lookup(self, fingerprint: Fingerprint, tokens: np.ndarray) -> Found | None: ...

    def fingerprints(self) -> list[Fingerprint]:
        """The distinct fingerprints of the owner's sessions."""
        ...

    def resume(self, session_id: str, expect: Fingerprint, verify: bool) -> Served: ...

    def stored(self, session_id: str) -> Stored | None:
        """The owner's session ``session_id`` as the index has it (no journal read), None when missing."""
        ...

    def create(self, session_id: str, fingerprint: Fingerprint, tags: tuple[str, ...] = ()) -> None: ...

    def append_records(self, session_id: str, records: np.ndarray) -> None:
        """Append records of :func:`encode_rows` as one complete turn."""
        ...

    def delete(self, session_id: str) -> None: ...

    def shred_mark(self) -> float | None:
        """When the owner's data keys were last destroyed (``kvstore crypto shred``): an encrypted
        embedded store's keyring says it (one ``stat``); a service says it in each lookup's answer
        and in ``GET /console/me``'s, asked when no answer came for :data:`SHRED_CHECK_S`. None for
        a plaintext store or before any shred."""
        ...


class LocalClient:
    """A store folder opened in this process (embedded mode)."""

    def __init__(self, store: Store, owner: str):
        self.store = store
        self.owner = validate_owner(owner)

    def shred_mark(self) -> float | None:
        return self.store.keys_destroyed_at(self.owner)

    def lookup(self, fingerprint: Fingerprint, tokens: np.ndarray) -> Found | None:
        found = self.store.lookup(self.owner, fingerprint, tokens)
        return Found(found.session_id, found.matched_tokens) if found is not None else None

    def fingerprints(self) -> list[Fingerprint]:
        seen: dict[str, Fingerprint] = {}
        for info in self.store.list(owner=self.owner):
            seen.setdefault(info.fingerprint_key, info.fingerprint)
        return list(seen.values())

    def resume(self, session_id: str, expect: Fingerprint, verify: bool) -> Served:
        resumed = self.store.resume(session_id, owner=self.owner, verify=verify, expect=expect)
        return Served(resumed.records, resumed.damaged_from)

    def stored(self, session_id: str) -> Stored | None:
        try:
            info = self.store.get(session_id, owner=self.owner)
        except SessionNotFound:
            return None
        return Stored(info.fingerprint_key, info.watermark, tuple(info.tags))

    def create(self, session_id: str, fingerprint: Fingerprint, tags: tuple[str, ...] = ()) -> None:
        self.store.create(
            self.owner, fingerprint.geometry, fingerprint.tier, fingerprint.model, session_id=session_id, tags=tags
        )

    def append_records(self, session_id: str, records: np.ndarray) -> None:
        self.store.append_records(session_id, records, complete_turn=True, owner=self.owner)

    def delete(self, session_id: str) -> None:
        self.store.delete(session_id, owner=self.owner)


def _fingerprint_json(fingerprint: Fingerprint) -> dict:
    return {
        "model": fingerprint.model.to_dict(),
        "geometry": dataclasses.asdict(fingerprint.geometry),
        "tier": fingerprint.tier.name,
    }


class ServiceClient:
    """A running ``kvstore serve`` (service mode): ``url`` and an API key; the key's owner is asked
    from the service once (``GET /console/me``), so a wrong key stops the engine at start."""

    def __init__(self, url: str, api_key: str, *, timeout: float = 60.0):
        if not url.startswith(("http://", "https://")):
            raise ConfigError(f"kvstore connector: 'url' must start with http:// or https://, got {url!r}")
        self.url = url.rstrip("/")
        self._shred_mark: float | None = None  # when the owner's keys were destroyed (lookup answers say)
        self._shred_checked = float("-inf")
        self.http = httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {api_key}"}, timeout=timeout)
        try:
            me = self.http.get("/console/me")
        except httpx.HTTPError as exc:
            raise ConfigError(f"kvstore connector: the service at {self.url} cannot be reached: {exc}") from exc
        if me.status_code == 401:
            raise ConfigError(f"kvstore connector: the service at {self.url} refused the API key (401)")
        self.owner = str(self._checked(me, "who am I").json()["owner"])

    def close(self) -> None:
        self.http.close()

    def shred_mark(self) -> float | None:
        if time.monotonic() - self._shred_checked > SHRED_CHECK_S:
            try:  # "who am I" carries it too, and counts no lookup
                me = self._checked(self._call("GET", "/console/me", "who am I"), "who am I")
                self._shred_mark = me.json().get("keys_destroyed_at")
                self._shred_checked = time.monotonic()
            except KVStoreError:  # unreachable for now: the last answer stands until the next check
                pass
        return self._shred_mark

    def _call(self, method: str, path: str, what: str, **kwargs) -> httpx.Response:
        try:
            answer = self.http.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise ServiceError(f"{what}: the service at {self.url} did not answer: {exc}") from exc
        return answer

    @staticmethod
    def _checked(answer: httpx.Response, what: str) -> httpx.Response:
        if answer.status_code < 400:
            return answer
        try:
            body = answer.json()
            name, reason = body.get("error", ""), body.get("reason", answer.text)
        except ValueError:
            name, reason = "", answer.text[:500]
        if name == "SessionExists":
            raise SessionExists(reason)
        if name == "KeyShredded":  # the connector drops what it holds of the owner's rows
            raise KeyShredded(reason)
        raise ServiceError(f"{what}: {answer.status_code} {name or 'error'}: {reason}")

    def lookup(self, fingerprint: Fingerprint, tokens: np.ndarray) -> Found | None:
        body = {**_fingerprint_json(fingerprint), "tokens": np.asarray(tokens).tolist()}
        answer = self._checked(self._call("POST", "/lookup", "lookup", json=body), "lookup")
        self._shred_mark = answer.json().get("keys_destroyed_at")
        self._shred_checked = time.monotonic()
        match = answer.json()["match"]
        return Found(match["session_id"], int(match["matched_tokens"])) if match is not None else None

    def fingerprints(self) -> list[Fingerprint]:
        answer = self._checked(self._call("GET", "/sessions", "list"), "list")
        seen: dict[str, Fingerprint] = {}
        for s in answer.json()["sessions"]:
            if s["fingerprint"] not in seen:
                geometry = coli_kv.Geometry(**s["geometry"])
                seen[s["fingerprint"]] = Fingerprint(
                    ModelInfo.from_dict(s["model"]), geometry, tiers.get(s["tier"]["name"])
                )
        return list(seen.values())

    def resume(self, session_id: str, expect: Fingerprint, verify: bool) -> Served:
        model = expect.model
        params = {
            "format": "coli_kv",
            "verify": "true" if verify else "false",
            "model_name": model.name,
            "model_revision": model.revision,
            "tier": expect.tier.name,
            "geometry": ",".join(str(w) for w in expect.geometry.words()),
        }
        # the optional model fields too, so the server compares every part of the fingerprint
        for field in ("weights_hash", "tokenizer_hash", "chat_template_hash", "attention_variant"):
            value = getattr(model, field)
            if value is not None:
                params[field] = value
        what = f"resume {session_id}"
        answer = self._checked(self._call("GET", f"/sessions/{session_id}/resume", what, params=params), what)
        records = coli_kv.parse(answer.content, expect=expect.geometry, tier=expect.tier)
        damaged = answer.headers.get("X-KV-Damaged-From")
        return Served(records, int(damaged) if damaged is not None else None)

    def stored(self, session_id: str) -> Stored | None:
        what = f"get {session_id}"
        answer = self._call("GET", f"/sessions/{session_id}", what)
        if answer.status_code == 404:
            return None
        session = self._checked(answer, what).json()
        return Stored(str(session["fingerprint"]), int(session["watermark"]), tuple(session.get("tags") or ()))

    def create(self, session_id: str, fingerprint: Fingerprint, tags: tuple[str, ...] = ()) -> None:
        body = {"id": session_id, **_fingerprint_json(fingerprint), "tags": list(tags)}
        self._checked(self._call("POST", "/sessions", "create", json=body), "create")

    def append_records(self, session_id: str, records: np.ndarray) -> None:
        what = f"append {session_id}"
        answer = self._call(
            "POST",
            f"/sessions/{session_id}/append",
            what,
            params={"complete_turn": "true"},
            content=records.tobytes(),
            headers={"Content-Type": "application/octet-stream"},
        )
        self._checked(answer, what)

    def delete(self, session_id: str) -> None:
        what = f"delete {session_id}"
        self._checked(self._call("DELETE", f"/sessions/{session_id}", what), what)
