"""API keys of a data folder: records in ``<data>/keys.json``, created, listed and revoked here.

The service (``kvstore.api.keys``) and the command line (``kvstore keys ...``) both use this module,
so neither needs the other to manage keys.

A key is ``kvs_<id>_<secret>``. The id (``k_`` and 12 hex digits) is public: ``kvstore keys list``
shows it, ``revoke`` takes it, logs name it, and it finds the key's record without trying every
record's salt. The secret is 32 random bytes (43 URL-safe characters) and is never stored: a record
keeps ``HMAC-SHA256(salt, secret)`` with a 16-byte random salt of its own. The secrets are random,
so a slow password hash would add nothing against guessing; the salt keeps one digest from standing
for the same key in two files. ``keys.json``::

    {"keys": [
      {"id": "k_3f9c0a12b7e4", "owner": "alice", "created": "2025-05-01T10:00:00Z",
       "expires": "2025-06-01T00:00:00Z", "revoked": null, "hint": "Qx7a",
       "salt": "<32 hex>", "hmac_sha256": "<64 hex>"},
      {"owner": "bob", "sha256": "<64 hex: SHA-256 of the whole key>"},
      {"owner": "carol", "key": "<the key itself, at least 16 characters>"}
    ]}

Times (``created``, ``expires``, ``revoked``) are ISO 8601, read as UTC, and must lie in
:data:`EARLIEST` .. :data:`LATEST` wherever they are parsed (``--expires``, ``keys.json``, the shared
index), so no time a key carries can overflow a date computation later. An entry ``keys.json`` cannot
use (a time out of that range, a malformed digest, an id given twice ...) is skipped, never the whole
file: the others keep working, :meth:`KeyFile.records` logs the entry once (by its position, id and
owner, never its digest), ``kvstore keys`` warns about it, and a change written by this module
keeps it as it was.

The last two forms (written before key ids, or by hand) are still read, and keys of any form in
``KVSTORE_API_KEYS`` too: such a key is checked by the SHA-256 of the whole key. An entry without an
id gets one derived from that digest, so ``list`` and ``revoke`` reach it; the first write by this
module stores the id, and a plain ``key`` as its SHA-256 (a key that is not ``kvs_<id>_<secret>``
has no id to find a salt by).

Writes (a new key, a revocation, the first key of a new folder) hold ``locks/keys.lock`` from the
read to the rename, so two ``kvstore keys`` processes never lose each other's change, and replace
the file atomically (:class:`kvstore.durable.AtomicFile`, mode 0600): a server re-reading it sees
the old file or the new one, never half of one.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import logging
import os
import re
import secrets
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, Literal, TypeVar

from kvstore import DEFAULT_OWNER
from kvstore.durable import AtomicFile
from kvstore.errors import ConfigError, InvalidRequest, PathRefused
from kvstore.journal import open_regular
from kvstore.locks import DEFAULT_LOCK_TIMEOUT_S, FileLock
from kvstore.store.values import OWNER_PATTERN

KEYS_FILE = "keys.json"
LOCK_FILE = "keys.lock"  # in locks/, beside the store's evict.lock (the store's sweep leaves it alone)
MIN_KEY_CHARS = 16  # a hand-written or environment key
MAX_FILE_BYTES = 64 << 20  # ~200k records: a larger keys.json is not one this module wrote
KEY_ID = re.compile(r"^k_[0-9a-f]{12}$")
_KEY = re.compile(r"^kvs_(k_[0-9a-f]{12})_([A-Za-z0-9_-]{16,256})$")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_HEX32 = re.compile(r"^[0-9a-f]{32}$")
_SPAN = re.compile(r"^(\d{1,6})([hdw])$")
_SPAN_UNITS = {"h": "hours", "d": "days", "w": "weeks"}
# What a key without a record is checked against, so that an unknown id costs one HMAC and one
# comparison exactly like a known one.
_NO_SALT = bytes(16)
_NO_DIGEST = bytes(32)

#: The range every key time must lie in (a span or date past it is refused; an entry holding one is skipped).
EARLIEST = datetime(1970, 1, 1, tzinfo=timezone.utc)
LATEST = datetime(9999, 12, 31, 23, 59, 59, tzinfo=timezone.utc)

KeyState = Literal["active", "expired", "revoked"]
_T = TypeVar("_T")

log = logging.getLogger("kvstore.keys")


def utc_now() -> datetime:
    return datetime.now(timezone.utc)


def format_time(when: datetime | None) -> str | None:
    """``2025-05-01T10:00:00Z`` (UTC, whole seconds), or None."""
    return None if when is None else when.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class TimeOutOfRange(ValueError):
    """A time that parses but lies outside :data:`EARLIEST` .. :data:`LATEST`."""


def _range_text() -> str:
    return f"{format_time(EARLIEST)} .. {format_time(LATEST)}"


def checked_time(when: datetime) -> datetime:
    """``when`` as an aware UTC datetime, if it lies in :data:`EARLIEST` .. :data:`LATEST` (a naive
    one is UTC). Raises :class:`TimeOutOfRange` otherwise, never ``OverflowError``."""
    try:
        utc = when.replace(tzinfo=timezone.utc) if when.tzinfo is None else when.astimezone(timezone.utc)
    except (OverflowError, ValueError):  # in its own zone near year 1 or 9999, past the ends in UTC
        raise TimeOutOfRange(f"{when.isoformat()} is outside {_range_text()}") from None
    if not EARLIEST <= utc <= LATEST:
        raise TimeOutOfRange(f"{utc.isoformat().replace('+00:00', 'Z')} is outside {_range_text()}")
    return utc


def parse_time(text: str) -> datetime:
    """An ISO 8601 date or time as an aware UTC datetime: a date is its 00:00 UTC, a time without a
    zone is UTC. Raises ``ValueError`` for anything else, :class:`TimeOutOfRange` (a ``ValueError``)
    for a time outside :data:`EARLIEST` .. :data:`LATEST`."""
    text = text.strip()
    when = datetime.fromisoformat(text[:-1] + "+00:00" if text.endswith(("Z", "z")) else text)
    return checked_time(when)


def parse_expires(text: str, now: datetime | None = None) -> datetime:
    """When a new key stops working: a span from ``now`` (``12h``, ``30d``, ``2w``) or an ISO date or
    time (``2026-01-31`` is its 00:00 UTC; ``2026-01-31T12:00:00+02:00``).

    Raises
    ------
    InvalidRequest
        Neither form, a zero span, a moment that is not in the future, or one past :data:`LATEST`.
    """
    now = now or utc_now()
    span = _SPAN.fullmatch(text.strip())
    if span is not None:
        count = int(span[1])
        if count == 0:
            raise InvalidRequest(f"--expires {text!r}: a key must live longer than 0 {_SPAN_UNITS[span[2]]}")
        length = timedelta(**{_SPAN_UNITS[span[2]]: count})
        if length > LATEST - now:
            raise InvalidRequest(
                f"--expires {text!r}: that ends after {format_time(LATEST)}, the latest time a key may expire "
                f"(give a shorter span, or no --expires for a key that never expires)"
            )
        return now + length
    try:
        when = parse_time(text)
    except TimeOutOfRange as exc:
        raise InvalidRequest(f"--expires {text!r}: {exc} (the times a key may carry)") from None
    except ValueError:
        raise InvalidRequest(
            f"--expires {text!r}: give a span (12h, 30d, 2w) or an ISO date or time "
            "(2026-01-31, which is its 00:00 UTC, or 2026-01-31T12:00:00Z)"
        ) from None
    if when <= now:
        raise InvalidRequest(
            f"--expires {text!r}: {format_time(when)} is not in the future (now is {format_time(now)})"
        )
    return when


def check_owner(owner: Any) -> str:
    """``owner`` when it is an owner name (what sessions take), else :class:`InvalidRequest` naming it."""
    if not isinstance(owner, str) or not OWNER_PATTERN.fullmatch(owner):
        raise InvalidRequest(
            f"invalid owner {owner!r}: use 1-128 letters, digits, '_', '.', '@' or '-', starting with a letter or digit"
        )
    return owner


def plain_digest(key: str) -> bytes:
    """SHA-256 of a whole key: how keys without a record of their own (older files, the environment)
    are checked."""
    return hashlib.sha256(key.encode()).digest()


def salted_digest(salt: bytes, secret: str) -> bytes:
    return hmac.new(salt, secret.encode(), hashlib.sha256).digest()


def derived_id(digest: bytes) -> str:
    """The id of a key known only by its plain digest: stable, and tells nothing about the key."""
    return "k_" + hashlib.sha256(b"kvstore key id\0" + digest).hexdigest()[:12]


def split_key(key: str) -> tuple[str, str] | None:
    """``kvs_<id>_<secret>`` -> ``(id, secret)``; None for a key of another form."""
    parts = _KEY.fullmatch(key)
    return None if parts is None else (parts[1], parts[2])


@dataclass(frozen=True)
class KeyRecord:
    """One key as stored: never the key itself.

    Attributes
    ----------
    id : ``k_`` and 12 hex digits (public)
    owner : the owner the key acts for
    digest : HMAC-SHA256 of the secret under ``salt``; without ``salt``, SHA-256 of the whole key
    salt : 16 random bytes, or None for a key known only by its plain digest
    created, expires, revoked : aware UTC datetimes or None (not known / never / not revoked)
    hint : the key's last 4 characters (None when not known), to tell keys apart in a listing
    """

    id: str
    owner: str
    digest: bytes
    salt: bytes | None = None
    created: datetime | None = None
    expires: datetime | None = None
    revoked: datetime | None = None
    hint: str | None = None

    def state(self, now: datetime | None = None) -> KeyState:
        if self.revoked is not None:
            return "revoked"
        if self.expires is not None and (now or utc_now()) >= self.expires:
            return "expired"
        return "active"

    def public(self, now: datetime | None = None) -> dict[str, Any]:
        """What may be shown: no key, no digest, no salt."""
        return {
            "id": self.id,
            "owner": self.owner,
            "state": self.state(now),
            "created": format_time(self.created),
            "expires": format_time(self.expires),
            "revoked": format_time(self.revoked),
            "hint": self.hint,
        }

    def entry(self) -> dict[str, Any]:
        """The record as a ``keys.json`` entry."""
        stored: dict[str, Any] = {
            "id": self.id,
            "owner": self.owner,
            "created": format_time(self.created),
            "expires": format_time(self.expires),
            "revoked": format_time(self.revoked),
            "hint": self.hint,
        }
        if self.salt is None:
            stored["sha256"] = self.digest.hex()
        else:
            stored["salt"], stored["hmac_sha256"] = self.salt.hex(), self.digest.hex()
        return stored


def new_record(owner: str, *, expires: datetime | None = None, now: datetime | None = None) -> tuple[KeyRecord, str]:
    """A fresh key for ``owner`` and its record: ``(record, key)``; the key exists only in the answer."""
    key_id, secret = "k_" + secrets.token_hex(6), secrets.token_urlsafe(32)
    key = f"kvs_{key_id}_{secret}"
    salt = secrets.token_bytes(16)
    record = KeyRecord(
        id=key_id,
        owner=check_owner(owner),
        digest=salted_digest(salt, secret),
        salt=salt,
        created=(now or utc_now()).replace(microsecond=0),
        expires=expires,
        hint=key[-4:],
    )
    return record, key


def env_records(value: str | None) -> list[KeyRecord]:
    """``KVSTORE_API_KEYS`` (``key:owner,key:owner``) as records checked by the plain digest."""
    records = []
    for item in (value or "").split(","):
        item = item.strip()
        if not item:
            continue
        key, sep, owner = item.rpartition(":")
        if not sep or len(key) < MIN_KEY_CHARS:
            raise ConfigError(
                f"KVSTORE_API_KEYS entries are key:owner with keys of at least {MIN_KEY_CHARS} characters"
            )
        if not OWNER_PATTERN.fullmatch(owner):
            raise ConfigError(f"KVSTORE_API_KEYS: invalid owner {owner!r} (letters, digits, '_', '.', '@', '-')")
        digest = plain_digest(key)
        records.append(KeyRecord(id=derived_id(digest), owner=owner, digest=digest))
    return records


# ---------------------------------------------------------------------------- reading keys.json
def _time_field(entry: dict, name: str, where: str) -> datetime | None:
    value = entry.get(name)
    if value is None:
        return None
    try:
        if not isinstance(value, str):
            raise ValueError
        return parse_time(value)
    except TimeOutOfRange as exc:
        raise ConfigError(f"{where}: {name!r} {value!r} is out of range: {exc}") from None
    except ValueError:
        raise ConfigError(
            f"{where}: {name!r} must be an ISO 8601 time like 2025-05-01T10:00:00Z, not {value!r}"
        ) from None


def _record_of(entry: Any, where: str) -> KeyRecord:
    """One ``keys.json`` entry as a record (a key written in clear becomes its plain digest)."""
    if not isinstance(entry, dict):
        raise ConfigError(f"{where}: every key entry is an object")
    owner = entry.get("owner")
    if not isinstance(owner, str) or not OWNER_PATTERN.fullmatch(owner):
        raise ConfigError(f"{where}: invalid owner {owner!r} (letters, digits, '_', '.', '@', '-')")
    salt_hex, salted_hex, plain_hex, key = (entry.get(k) for k in ("salt", "hmac_sha256", "sha256", "key"))
    if isinstance(salt_hex, str) and isinstance(salted_hex, str):
        if not (_HEX32.fullmatch(salt_hex) and _HEX64.fullmatch(salted_hex)):
            raise ConfigError(f"{where}: 'salt' is 32 hex digits and 'hmac_sha256' 64")
        salt, digest = bytes.fromhex(salt_hex), bytes.fromhex(salted_hex)
    elif isinstance(plain_hex, str) and _HEX64.fullmatch(plain_hex):
        salt, digest = None, bytes.fromhex(plain_hex)
    elif isinstance(key, str) and len(key) >= MIN_KEY_CHARS:
        salt, digest = None, plain_digest(key)
    else:
        raise ConfigError(
            f"{where}: an entry needs 'salt' and 'hmac_sha256', a 64-hex 'sha256', or a 'key' of at least "
            f"{MIN_KEY_CHARS} characters"
        )
    key_id = entry.get("id")
    if key_id is None and salt is not None:
        raise ConfigError(f"{where}: a salted entry needs its 'id' (the k_... inside its key)")
    if key_id is None:
        key_id = derived_id(digest)
    elif not isinstance(key_id, str) or not KEY_ID.fullmatch(key_id):
        raise ConfigError(f"{where}: 'id' is k_ and 12 hex digits, not {key_id!r}")
    elif salt is None and key_id != derived_id(digest):
        raise ConfigError(f"{where}: key {key_id} has no salt, so its id must be {derived_id(digest)}")
    hint = entry.get("hint")
    if hint is None and isinstance(key, str):
        hint = key[-4:]
    elif hint is not None and (not isinstance(hint, str) or len(hint) > 8):
        raise ConfigError(f"{where}: 'hint' is the key's last 4 characters")
    record = KeyRecord(
        id=key_id,
        owner=owner,
        digest=digest,
        salt=salt,
        created=_time_field(entry, "created", where),
        expires=_time_field(entry, "expires", where),
        revoked=_time_field(entry, "revoked", where),
        hint=hint,
    )
    return record


@dataclass(frozen=True)
class SkippedEntry:
    """A ``keys.json`` entry that could not be used: its position, the entry as written (kept, so
    a rewrite of the file does not lose it) and why."""

    index: int
    entry: Any
    reason: str

    def describe(self, where: str) -> str:
        """One line naming the entry by position, id and owner (never a digest or a key)."""
        named = ""
        if isinstance(self.entry, dict):
            parts = [
                f"{field} {self.entry[field]!r}" for field in ("id", "owner") if isinstance(self.entry.get(field), str)
            ]
            named = f" ({', '.join(parts)})" if parts else ""
        return (
            f"{where}: key entry {self.index}{named} is skipped, the other keys work: {self.reason}; "
            "fix or remove the entry"
        )


@dataclass(frozen=True)
class KeyDocument:
    """A parsed ``keys.json``: its records, its other top-level fields (kept as they are) and the
    entries skipped (:func:`parse_document` with ``skip_bad``)."""

    records: tuple[KeyRecord, ...]
    rest: dict[str, Any]
    skipped: tuple[SkippedEntry, ...] = ()


def parse_document(text: bytes | str, where: str, *, skip_bad: bool = False) -> KeyDocument:
    """Parse a ``keys.json`` image.

    Raises
    ------
    ConfigError
        The file is not JSON, or has no ``keys`` list; an entry that cannot be used (each reason
        names the entry), unless ``skip_bad``: then such entries (and a second entry for an id) are
        left out of the records and listed in ``skipped``.
    """
    try:
        document = json.loads(text)
    except ValueError as exc:
        raise ConfigError(f"{where} is not readable JSON ({exc})") from None
    entries = document.get("keys") if isinstance(document, dict) else None
    if not isinstance(entries, list):
        raise ConfigError(f'{where} must hold {{"keys": [{{"owner": ..., "id": ..., ...}}, ...]}}')
    records, seen, skipped = [], set(), []
    for index, entry in enumerate(entries):
        try:
            record = _record_of(entry, where)
            if record.id in seen:
                raise ConfigError(f"{where}: two entries are key {record.id} (the same key twice, or a repeated id)")
        except ConfigError as exc:
            if not skip_bad:
                raise
            skipped.append(SkippedEntry(index, entry, exc.reason.removeprefix(f"{where}: ")))
            continue
        seen.add(record.id)
        records.append(record)
    rest = {name: value for name, value in document.items() if name != "keys"}
    return KeyDocument(tuple(records), rest, tuple(skipped))


# ---------------------------------------------------------------------------- the file
class KeyFile:
    """``<data_dir>/keys.json``: read it, and change it under ``locks/keys.lock``.

    Raises (every method)
    ---------------------
    ConfigError : the file is not one this module can read (the reason names the entry)
    PathRefused : ``keys.json`` is a symbolic link or not a regular file
    JournalLocked : another process kept the lock for ``lock_timeout`` seconds
    """

    def __init__(self, data_dir: str | os.PathLike, *, lock_timeout: float = DEFAULT_LOCK_TIMEOUT_S):
        self.data_dir = Path(data_dir)
        self.path = self.data_dir / KEYS_FILE
        self.lock_timeout = lock_timeout
        self._reported: set[str] = set()  # skipped entries already logged (each is logged once)

    def stamp(self) -> tuple[int, int, int, int] | None:
        """Changes whenever the file does (an atomic replace is a new inode); None when missing."""
        try:
            st = os.stat(self.path, follow_symlinks=False)
        except FileNotFoundError:
            return None
        return (st.st_ino, st.st_mtime_ns, st.st_ctime_ns, st.st_size)

    def document(self) -> KeyDocument:
        """The file as it is now (no records when it is missing); entries that cannot be used are
        in ``skipped``, not in the records."""
        try:
            fd = open_regular(self.path, os.O_RDONLY, what=KEYS_FILE)
        except FileNotFoundError:
            return KeyDocument((), {})
        with os.fdopen(fd, "rb") as source:
            text = source.read(MAX_FILE_BYTES + 1)
        if len(text) > MAX_FILE_BYTES:
            raise ConfigError(f"{self.path} is larger than {MAX_FILE_BYTES >> 20} MiB; it is not a keys file")
        return parse_document(text, str(self.path), skip_bad=True)

    def records(self) -> tuple[KeyRecord, ...]:
        """The usable keys; each entry skipped is logged (a warning), once for this object."""
        document = self.document()
        for skipped in document.skipped:
            line = skipped.describe(str(self.path))
            if line not in self._reported:
                self._reported.add(line)
                log.warning("%s", line)
        return document.records

    def create(
        self, owner: str, *, expires: datetime | None = None, now: datetime | None = None
    ) -> tuple[KeyRecord, str]:
        """Add a fresh key for ``owner``: ``(record, key)``. The key is in the answer only."""
        record, key = new_record(owner, expires=expires, now=now)
        self._change(lambda records: ([*records, record], None))
        return record, key

    def revoke(self, key_id: str, *, now: datetime | None = None) -> tuple[KeyRecord, bool]:
        """Mark key ``key_id`` revoked: ``(record, changed)``; a key revoked before stays as it was.

        Raises
        ------
        InvalidRequest : no key has this id
        """
        when = (now or utc_now()).replace(microsecond=0)

        def change(records: list[KeyRecord]) -> tuple[list[KeyRecord] | None, tuple[KeyRecord, bool]]:
            for at, record in enumerate(records):
                if record.id == key_id:
                    if record.revoked is not None:
                        return None, (record, False)
                    records[at] = dataclasses.replace(record, revoked=when)
                    return records, (records[at], True)
            raise InvalidRequest(
                f"no API key has id {key_id!r} in {self.path} (`kvstore keys list` shows the ids, like k_3f9c0a12b7e4)"
            )

        return self._change(change)

    def first_key(self, owner: str = DEFAULT_OWNER) -> tuple[KeyRecord, str] | None:
        """When ``keys.json`` is missing, create it with one fresh key for ``owner``: ``(record,
        key)``; None when the file exists (its keys stay as they are)."""
        record, key = new_record(owner)
        with self._locked():
            if os.path.lexists(self.path):
                return None
            try:
                self._write([record], replace=False)
            except FileExistsError:  # made meanwhile by a process that does not take the lock
                return None
        return record, key

    # ---- writing
    def _locked(self) -> FileLock:
        self.data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        locks = self.data_dir / "locks"
        if locks.is_symlink():
            raise PathRefused(f"{locks} is a symbolic link; the data folder's locks/ must be a real folder")
        locks.mkdir(mode=0o700, exist_ok=True)
        return FileLock(
            locks / LOCK_FILE,
            timeout=self.lock_timeout,
            busy_reason=f"{self.path} is being changed by another kvstore process; try again",
        )

    def _change(self, change: Callable[[list[KeyRecord]], tuple[list[KeyRecord] | None, _T]]) -> _T:
        """Read, ``change(records) -> (new records or None for no write, answer)``, write; under the lock."""
        with self._locked():
            document = self.document()
            records, answer = change(list(document.records))
            if records is not None:
                self._write(records, rest=document.rest, skipped=document.skipped)
        return answer

    def _write(
        self,
        records: Iterable[KeyRecord],
        *,
        rest: dict[str, Any] | None = None,
        skipped: Iterable[SkippedEntry] = (),
        replace: bool = True,
    ) -> None:
        entries: list[Any] = [record.entry() for record in records]
        for kept in skipped:  # as written, where they were: a change never drops an entry it cannot read
            entries.insert(min(kept.index, len(entries)), kept.entry)
        image = json.dumps({**(rest or {}), "keys": entries}, indent=2) + "\n"
        with AtomicFile(self.path, replace=replace) as out:  # 0600, fsync, rename, fsync folder
            out.write(image.encode())


# ---------------------------------------------------------------------------- the shared index
class IndexKeys:
    """The keys in a shared index (PostgreSQL table ``kv_keys``, docs/SCALE.md): every replica of a
    shared store reads the same keys. The same interface as :class:`KeyFile` (``records``, ``create``,
    ``revoke``); each change is one transaction, so two processes never lose each other's change.

    Raises (every method)
    ---------------------
    IndexUnavailable : PostgreSQL cannot be reached now; retry
    """

    def __init__(self, url: str):
        from kvstore.store.shared.index import SharedIndex, redacted_url

        self.index = SharedIndex(url)
        self.path = f"the shared index {redacted_url(url)}"  # where the keys are, for messages
        self._reported: set[str] = set()  # rows skipped and already logged (each is logged once)

    def close(self) -> None:
        self.index.close()

    def __enter__(self) -> "IndexKeys":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def records(self) -> tuple[KeyRecord, ...]:
        """The usable keys; a row whose times are out of range is skipped and logged."""
        records = []
        for row in self.index.key_rows():
            try:
                records.append(_record_of_row(row))
            except TimeOutOfRange as exc:
                line = f"{self.path}: key {row.get('id')} of owner {row.get('owner')!r} is skipped, the other keys work: {exc}"
                if line not in self._reported:
                    self._reported.add(line)
                    log.warning("%s", line)
        return tuple(records)

    def create(
        self, owner: str, *, expires: datetime | None = None, now: datetime | None = None
    ) -> tuple[KeyRecord, str]:
        """Add a fresh key for ``owner``: ``(record, key)``. The key is in the answer only."""
        record, key = new_record(owner, expires=expires, now=now)
        self.index.add_key({"id": record.id, "owner": record.owner, "salt": record.salt, "digest": record.digest,
                            "created": record.created, "expires": record.expires, "revoked": record.revoked,
                            "hint": record.hint})  # fmt: skip
        return record, key

    def revoke(self, key_id: str, *, now: datetime | None = None) -> tuple[KeyRecord, bool]:
        """Mark key ``key_id`` revoked: ``(record, changed)`` (see :meth:`KeyFile.revoke`)."""
        found = self.index.revoke_key(key_id, (now or utc_now()).replace(microsecond=0))
        if found is None:
            raise InvalidRequest(
                f"no API key has id {key_id!r} in {self.path} (`kvstore keys list` shows the ids, like k_3f9c0a12b7e4)"
            )
        row, changed = found
        return _record_of_row(row), changed


def _record_of_row(row: dict[str, Any]) -> KeyRecord:
    def utc(when: datetime | None) -> datetime | None:
        return None if when is None else checked_time(when)

    return KeyRecord(
        id=row["id"],
        owner=row["owner"],
        digest=row["digest"],
        salt=row["salt"],
        created=utc(row["created"]),
        expires=utc(row["expires"]),
        revoked=utc(row["revoked"]),
        hint=row["hint"],
    )


def _secret_of(key: str) -> str:
    """What the salted digest covers: the secret of a ``kvs_<id>_<secret>`` key, else the whole key."""
    parts = split_key(key)
    return key if parts is None else parts[1]


# ---------------------------------------------------------------------------- checking a key
class Keyring:
    """The keys accepted at one moment; :meth:`match` does the same work whatever the key.

    Every key without a salt (older entries, the environment) is compared by ``hmac.compare_digest``
    with the presented key's SHA-256, none skipped and none looked up by hash; then the id in the
    presented key picks at most one salted record, and one HMAC and one comparison are made whether
    it exists or not. How long a check takes does not depend on which key matches, whether one
    does, or how many leading bytes a guess shares with a stored digest.
    """

    def __init__(self, records: Iterable[KeyRecord]):
        self._plain: list[KeyRecord] = []
        self._salted: dict[str, tuple[bytes, KeyRecord]] = {}
        for record in records:
            if record.salt is None:
                self._plain.append(record)
            else:
                self._salted.setdefault(record.id, (record.salt, record))

    def __len__(self) -> int:
        return len(self._plain) + len(self._salted)

    def match(self, key: str) -> KeyRecord | None:
        """The record ``key`` belongs to (the first of equal plain digests), or None. Expiry and
        revocation are the caller's to check: the record says both."""
        presented = plain_digest(key)
        found = None
        for record in self._plain:
            if hmac.compare_digest(presented, record.digest) and found is None:
                found = record
        parts = split_key(key)
        salt, record = self._salted.get(parts[0], (_NO_SALT, None)) if parts is not None else (_NO_SALT, None)
        stored = record.digest if record is not None else _NO_DIGEST
        if hmac.compare_digest(salted_digest(salt, _secret_of(key)), stored) and record is not None and found is None:
            found = record
        return found
