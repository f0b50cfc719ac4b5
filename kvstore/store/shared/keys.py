"""Encryption at rest of the shared store: owners' data keys in PostgreSQL, segment objects sealed.

The crypto core is the embedded store's (``kvstore.crypto``): the KEK behind ``KeyProvider``,
AES-256-GCM through ``seal_object`` / ``open_object``. What differs is where the wrapped data keys
live: here in the shared index (schema 10), so every replica sees the same keys, each replica
holding the KEK from its own settings (``--kek-file``, ``KVSTORE_KEK_FILE``, ``KVSTORE_KEK``).

Tables (``kvstore.store.shared.schema``, step 10)::

    kv_meta        'kek_id' = KeyProvider.key_id (present: the store was created encrypted),
                   'keys_epoch' = destructions of data keys so far (shred, retire)
    kv_key_owners  owner -> current version (NULL once shredded), next version, shredded_at
    kv_data_keys   (owner, version) -> the data key wrapped by the KEK, bound to (owner, version)

**Shredding across replicas.** A replica keeps the data keys it unwrapped in memory. Every read
starts with a read plan (``SharedIndex.read_plan``), which reads ``keys_epoch`` in the same snapshot
as the segments; when it moved, :meth:`SharedKeyring.saw_epoch` drops every key this replica holds
whose row is gone (and tells :attr:`SharedKeyring.on_change`) before a byte of an object is opened.
A write asks PostgreSQL for the owner's current key each time (:meth:`SharedKeyring.current`, one
small query), so no replica seals under a destroyed key. No TTL: a shred is seen by the next
request of any replica, on any session.

**Segment objects.** :class:`SegmentSealer` seals a segment's object (its records, or their zstd
frame when parked) with ``seal_object`` under the owner's current data key, the associated data
binding the owner, the object's name (which holds the creating session's key and a random part),
the segment's first record, record count, codec and key version: an object swapped with another
(of any owner), moved to another position or claimed by another owner fails authentication
(``SealBroken``) and nothing is decrypted. Forks share objects: the owner of a fork is its
source's, so one per-owner key opens both.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import psycopg

from kvstore import config
from kvstore.crypto.kek import KeyProvider, provider_from_settings
from kvstore.crypto.keyring import DataKey
from kvstore.crypto.seal import new_key, open_object, seal_object
from kvstore.errors import KeyShredded, KeyUnavailable, SealBroken
from kvstore.migrations.index import key_owner
from kvstore.store.values import public_id

if TYPE_CHECKING:
    from kvstore.store.shared.index import SharedIndex
    from kvstore.store.shared.rows import Segment
    from kvstore.store.shared.store import SharedStore

#: ``pg_advisory_xact_lock`` key serializing the key table's changes (create, rotate, shred, rewrap).
KEYS_LOCK = 0x6B7673_0004
PURPOSE = b"shared segment"


def _associated(owner: str, version: int) -> bytes:
    # another label than the embedded keyring's: a wrapped key cannot be moved between the two
    return f"kvstore shared data key v1\0{owner}\0{version}".encode()


def owner_of(key: str) -> str:
    owner = key_owner(key)
    if owner is None:
        raise KeyUnavailable(f"session {key!r} names no owner: an encrypted store seals per owner")
    return owner


class SharedKeyring:
    """The data keys of a shared store's owners, kept wrapped in PostgreSQL (see the module
    docstring); the same members as ``kvstore.crypto.Keyring`` that the CLI and the server use.

    Parameters
    ----------
    index : the shared index (its connection pool runs every query)
    provider : the KEK (``key_id`` must match the store's ``kek_id``: :func:`attach` checks it)
    """

    def __init__(self, index: SharedIndex, provider: KeyProvider):
        self.index = index
        self.provider = provider
        self._mutex = threading.Lock()
        self._cache: dict[tuple[str, int], bytes] = {}
        self._epoch: int | None = None
        self.on_change: list[Callable[[set[str]], None]] = []  # told the owners whose keys went away
        index.on_key_epoch.append(self.saw_epoch)

    # ------------------------------------------------------------------ epochs
    def saw_epoch(self, epoch: int) -> None:
        """A read plan (or a key query) saw ``keys_epoch``: if it moved since this replica last saw
        it, drop every unwrapped key whose row is gone (a shred or a retire, on any replica)."""
        with self._mutex:
            if epoch == self._epoch:
                return
            self._epoch = epoch
            held = sorted({owner for owner, _ in self._cache})
        if not held:
            return
        alive = set(
            self.index.run(
                "reading data keys",
                lambda conn: [
                    (str(o), int(v))
                    for o, v in conn.execute(
                        "SELECT owner, version FROM kv_data_keys WHERE owner = ANY(%s)", (held,)
                    ).fetchall()
                ],
            )
        )
        gone: set[str] = set()
        with self._mutex:
            for pair in list(self._cache):
                if pair not in alive:
                    del self._cache[pair]  # destroyed elsewhere: the plaintext key goes from memory
                    gone.add(pair[0])
        for callback in self.on_change if gone else ():
            callback(gone)

    def refresh(self) -> None:
        """Read ``keys_epoch`` now (what :class:`~kvstore.crypto.keyring.KeyringWatcher` calls)."""
        self.saw_epoch(self.index.run("reading the keys epoch", _epoch_of))

    def forget(self) -> None:
        """Drop every unwrapped key this process holds."""
        with self._mutex:
            self._cache.clear()

    # ------------------------------------------------------------------ reading
    def key(self, owner: str, version: int) -> DataKey:
        """The data key ``version`` of ``owner`` (from memory once unwrapped; the read plan that
        preceded this read has already dropped it if it was destroyed).

        Raises
        ------
        KeyShredded : destroyed (shredded or retired)
        KeyUnavailable : the KEK does not unwrap it
        """
        with self._mutex:
            cached = self._cache.get((owner, version))
        if cached is not None:
            return DataKey(owner, version, cached)

        def body(conn: psycopg.Connection) -> tuple[bytes | None, bool]:
            row = conn.execute(
                "SELECT k.wrapped, o.shredded_at IS NOT NULL FROM kv_key_owners o "
                "LEFT JOIN kv_data_keys k ON k.owner = o.owner AND k.version = %s WHERE o.owner = %s",
                (version, owner),
            ).fetchone()
            if row is None:
                return None, False
            return (bytes(row[0]) if row[0] is not None else None), bool(row[1])

        wrapped, shredded = self.index.run("reading a data key", body)
        if wrapped is None:
            what = "were shredded" if shredded else f"hold no version {version}"
            raise KeyShredded(f"the data keys of owner {owner!r} {what}: the rows sealed under them are unreadable")
        secret = self.provider.unwrap(wrapped, _associated(owner, version))
        with self._mutex:
            self._cache[(owner, version)] = secret
        return DataKey(owner, version, secret)

    def current(self, owner: str, *, create: bool = True) -> DataKey:
        """The owner's current data key (new objects are sealed under it), asked of PostgreSQL each
        call (so never a destroyed one), made on first use (a shredded owner gets a new version
        whose number never reuses a destroyed one)."""

        def body(conn: psycopg.Connection) -> tuple[int | None, int]:
            row = conn.execute(
                "SELECT (SELECT current FROM kv_key_owners WHERE owner = %s), "
                "(SELECT value FROM kv_meta WHERE name = 'keys_epoch')",
                (owner,),
            ).fetchone()
            if row is None:  # a SELECT of values always returns its row
                return None, 0
            return (int(row[0]) if row[0] is not None else None), int(row[1] or 0)

        version, epoch = self.index.run("reading a data key", body)
        self.saw_epoch(epoch)
        if version is None:
            if not create:
                raise KeyShredded(f"owner {owner!r} has no data key")
            version = self._make(owner)
        return self.key(owner, version)

    def _make(self, owner: str) -> int:
        secret = new_key()

        def body(conn: psycopg.Connection) -> int:
            with conn.transaction():
                conn.execute("SELECT pg_advisory_xact_lock(%s)", (KEYS_LOCK,))
                self._same_kek(conn)
                row = conn.execute("SELECT current, next FROM kv_key_owners WHERE owner = %s", (owner,)).fetchone()
                if row is not None and row[0] is not None:
                    return int(row[0])  # another replica made it first
                version = int(row[1]) if row is not None else 1
                conn.execute(
                    "INSERT INTO kv_key_owners (owner, current, next) VALUES (%s, %s, %s) "
                    "ON CONFLICT (owner) DO UPDATE SET current = EXCLUDED.current, next = EXCLUDED.next",
                    (owner, version, version + 1),
                )
                conn.execute(
                    "INSERT INTO kv_data_keys (owner, version, wrapped) VALUES (%s, %s, %s)",
                    (owner, version, self.provider.wrap(secret, _associated(owner, version))),
                )
                return version

        return self.index.run("making a data key", body)

    def _same_kek(self, conn: psycopg.Connection) -> None:
        """Refuse to wrap a new data key under this replica's KEK when the store's keys are wrapped
        by another now (``rotate-kek`` ran while this replica kept the old KEK): a key wrapped by the
        old one would be unreadable to every replica given the new one."""
        row = conn.execute("SELECT value FROM kv_meta WHERE name = 'kek_id'").fetchone()
        if row is None or str(row[0]) != self.provider.key_id:
            raise KeyUnavailable(
                "the shared store's data keys were re-wrapped under another key-encryption key (`kvstore crypto "
                "rotate-kek`): restart this replica with the new KEK; nothing was written"
            )

    def versions(self, owner: str) -> list[int]:
        rows = self.index.run(
            "reading data keys",
            lambda conn: conn.execute(
                "SELECT version FROM kv_data_keys WHERE owner = %s ORDER BY version", (owner,)
            ).fetchall(),
        )
        return [int(r[0]) for r in rows]

    def owners(self) -> list[str]:
        rows = self.index.run(
            "reading data keys",
            lambda conn: conn.execute(
                "SELECT owner FROM kv_key_owners WHERE current IS NOT NULL ORDER BY owner"
            ).fetchall(),
        )
        return [str(r[0]) for r in rows]

    def shredded(self) -> dict[str, float]:
        rows = self.index.run(
            "reading data keys",
            lambda conn: conn.execute(
                "SELECT owner, extract(epoch FROM shredded_at)::float8 FROM kv_key_owners "
                "WHERE shredded_at IS NOT NULL AND current IS NULL"
            ).fetchall(),
        )
        return {str(r[0]): float(r[1]) for r in rows}

    # ------------------------------------------------------------------ changing
    def rotate(self, owner: str) -> int:
        """A new data-key version for ``owner``; new objects are sealed under it at once, older
        objects keep the version they were sealed under until rewritten."""
        secret = new_key()

        def body(conn: psycopg.Connection) -> int:
            with conn.transaction():
                conn.execute("SELECT pg_advisory_xact_lock(%s)", (KEYS_LOCK,))
                self._same_kek(conn)
                row = conn.execute("SELECT current, next FROM kv_key_owners WHERE owner = %s", (owner,)).fetchone()
                if row is None or row[0] is None:
                    raise KeyShredded(f"owner {owner!r} has no data key to rotate")
                version = int(row[1])
                conn.execute(
                    "INSERT INTO kv_data_keys (owner, version, wrapped) VALUES (%s, %s, %s)",
                    (owner, version, self.provider.wrap(secret, _associated(owner, version))),
                )
                conn.execute(
                    "UPDATE kv_key_owners SET current = %s, next = %s WHERE owner = %s", (version, version + 1, owner)
                )
                return version

        return self.index.run("rotating a data key", body)

    def retire(self, owner: str, version: int) -> None:
        """Destroy one old version of ``owner``'s data key (never the current one)."""

        def body(conn: psycopg.Connection) -> None:
            with conn.transaction():
                conn.execute("SELECT pg_advisory_xact_lock(%s)", (KEYS_LOCK,))
                row = conn.execute("SELECT current FROM kv_key_owners WHERE owner = %s", (owner,)).fetchone()
                if row is not None and row[0] is not None and int(row[0]) == version:
                    raise KeyUnavailable(f"version {version} is owner {owner!r}'s current data key; rotate first")
                gone = conn.execute(
                    "DELETE FROM kv_data_keys WHERE owner = %s AND version = %s RETURNING 1", (owner, version)
                ).fetchone()
                if gone is not None:
                    _bump_epoch(conn)

        self.index.run("retiring a data key", body)
        self.refresh()

    def shred(self, owner: str) -> int:
        """Destroy every data key of ``owner`` in the shared index (one transaction; committed means
        durable in PostgreSQL, and its replicas' WAL): every object sealed under them, every copy in
        every replica's cache and every backup of the bucket is unreadable from then on. Every
        replica drops the keys it holds at its next read plan or write. Returns the versions destroyed."""

        def body(conn: psycopg.Connection) -> int:
            with conn.transaction():
                conn.execute("SELECT pg_advisory_xact_lock(%s)", (KEYS_LOCK,))
                destroyed = conn.execute("DELETE FROM kv_data_keys WHERE owner = %s RETURNING version", (owner,))
                count = len(destroyed.fetchall())
                conn.execute(
                    "INSERT INTO kv_key_owners (owner, current, next, shredded_at) VALUES (%s, NULL, 1, now()) "
                    "ON CONFLICT (owner) DO UPDATE SET current = NULL, shredded_at = now()",
                    (owner,),
                )
                _bump_epoch(conn)
                return count

        count = self.index.run("shredding an owner's data keys", body)
        self.refresh()
        return count

    def rewrap(self, new_provider: KeyProvider) -> int:
        """Wrap every data key anew under ``new_provider`` (KEK rotation, one transaction: no object
        is rewritten); returns how many keys. The store's ``kek_id`` becomes the new KEK's: a replica
        must be given the new KEK at its next start (a running one keeps the keys it holds)."""

        def body(conn: psycopg.Connection) -> int:
            with conn.transaction():
                conn.execute("SELECT pg_advisory_xact_lock(%s)", (KEYS_LOCK,))
                rows = conn.execute("SELECT owner, version, wrapped FROM kv_data_keys FOR UPDATE").fetchall()
                for owner, version, wrapped in rows:
                    bound = _associated(str(owner), int(version))
                    secret = self.provider.unwrap(bytes(wrapped), bound)
                    conn.execute(
                        "UPDATE kv_data_keys SET wrapped = %s WHERE owner = %s AND version = %s",
                        (new_provider.wrap(secret, bound), owner, version),
                    )
                conn.execute("UPDATE kv_meta SET value = %s WHERE name = 'kek_id'", (new_provider.key_id,))
                return len(rows)

        count = self.index.run("re-wrapping the data keys", body)
        self.provider = new_provider
        return count


def _epoch_of(conn: psycopg.Connection) -> int:
    row = conn.execute("SELECT value FROM kv_meta WHERE name = 'keys_epoch'").fetchone()
    return int(row[0]) if row is not None else 0


def _bump_epoch(conn: psycopg.Connection) -> None:
    conn.execute("UPDATE kv_meta SET value = (value::bigint + 1)::text WHERE name = 'keys_epoch'")


def attach(index: SharedIndex, provider: KeyProvider | None) -> SharedKeyring | None:
    """The keyring of the shared store ``index`` as its opener asks: None for a plaintext store.

    Without ``provider``, a store created encrypted, or a new store when ``KVSTORE_ENCRYPT=1``,
    takes the KEK this replica's settings name (``KVSTORE_KEK_FILE``, ``KVSTORE_KEK``). A store
    with no session yet becomes encrypted when opened with a KEK.

    Raises
    ------
    KeyUnavailable : an encrypted store opened without a KEK or with another one; a store holding
        plaintext sessions opened with one (the two are never mixed)
    """

    def state(conn: psycopg.Connection) -> tuple[str | None, bool]:
        kek = conn.execute("SELECT value FROM kv_meta WHERE name = 'kek_id'").fetchone()
        sessions = conn.execute("SELECT EXISTS (SELECT 1 FROM kv_sessions)").fetchone()
        return (str(kek[0]) if kek is not None else None), bool(sessions and sessions[0])

    kek_id, has_sessions = index.run("reading the store's encryption", state)
    if provider is None and (kek_id is not None or config.ENCRYPT.get()):
        provider = provider_from_settings()  # raises KeyUnavailable, saying how to name the KEK
    if provider is None:
        return None
    if kek_id is None:
        chosen = provider

        def mark(conn: psycopg.Connection) -> str:
            with conn.transaction():
                conn.execute("SELECT pg_advisory_xact_lock(%s)", (KEYS_LOCK,))
                conn.execute("LOCK TABLE kv_sessions IN SHARE MODE")  # no session comes in meanwhile
                if conn.execute("SELECT EXISTS (SELECT 1 FROM kv_sessions)").fetchone() == (True,):
                    found = conn.execute("SELECT value FROM kv_meta WHERE name = 'kek_id'").fetchone()
                    if found is None:
                        raise KeyUnavailable(
                            "this shared store was created without encryption and holds sessions; an encrypted "
                            "shared store starts in a new index and bucket (copy sessions over with `kvstore store "
                            "pull` / `push`), the two are never mixed"
                        )
                conn.execute(
                    "INSERT INTO kv_meta (name, value) VALUES ('kek_id', %s) ON CONFLICT (name) DO NOTHING",
                    (chosen.key_id,),
                )
                row = conn.execute("SELECT value FROM kv_meta WHERE name = 'kek_id'").fetchone()
                return str(row[0]) if row is not None else chosen.key_id

        if has_sessions:
            raise KeyUnavailable(
                "this shared store was created without encryption and holds sessions; an encrypted shared store "
                "starts in a new index and bucket, the two are never mixed"
            )
        kek_id = index.run("marking the store encrypted", mark)
    if kek_id != provider.key_id:
        raise KeyUnavailable(
            "the shared store's data keys are wrapped by another key-encryption key than the one given "
            "(after `kvstore crypto rotate-kek`, give every replica the new one)"
        )
    return SharedKeyring(index, provider)


def encrypted(shared: SharedStore, kek: KeyProvider | None) -> SharedStore:
    """``shared`` (a protocol-level :class:`~kvstore.store.shared.store.SharedStore`, as ``kvstore
    store push|pull`` opens one) sealing and opening objects as its index says (:func:`attach`:
    ``kek``, else the KEK the settings name when the store is encrypted)."""
    try:
        keyring = attach(shared.index, kek)
    except BaseException:
        shared.close()
        raise
    if keyring is not None:
        shared.encrypt(SegmentSealer(keyring))
    return shared


@dataclass(frozen=True)
class Sealed:
    """A segment object's bytes as stored, and the data-key version they are sealed under."""

    body: bytes | memoryview
    key_version: int


class SegmentSealer:
    """Seals and opens segment objects under their owner's data key (the module docstring says
    what the associated data binds)."""

    def __init__(self, keyring: SharedKeyring):
        self.keyring = keyring

    @staticmethod
    def associated(owner: str, name: str, first_record: int, n_records: int, codec: str, version: int) -> bytes:
        return f"kvstore shared segment v1\0{owner}\0{name}\0{first_record}\0{n_records}\0{codec}\0{version}".encode()

    def seal(
        self, key: str, name: str, first_record: int, n_records: int, codec: str, body: bytes | memoryview
    ) -> Sealed:
        """``body`` (the records, or their zstd frame) sealed for object ``name`` of session ``key``."""
        owner = owner_of(key)
        data_key = self.keyring.current(owner)
        bound = self.associated(owner, name, first_record, n_records, codec, data_key.version)
        return Sealed(seal_object(data_key.secret, body, bound, purpose=PURPOSE), data_key.version)

    def open(
        self, key: str, segment: Segment, sealed: bytes | memoryview, into: memoryview | None = None
    ) -> memoryview:
        """The plaintext of ``segment``'s object (read for session ``key``), decrypted into ``into``
        (exactly its size) when given.

        Raises
        ------
        KeyShredded : the owner's key of that version was destroyed
        SealBroken : any byte changed, or the object belongs to another owner, name or position
        """
        if segment.key_version is None:
            raise SealBroken(f"segment {segment.object} is not sealed in a store encrypted at rest; it is not served")
        owner = owner_of(key)
        data_key = self.keyring.key(owner, segment.key_version)
        bound = self.associated(
            owner, segment.object, segment.first_record, segment.n_records, segment.codec, segment.key_version
        )
        try:
            return open_object(data_key.secret, sealed, bound, purpose=PURPOSE, into=into)
        except SealBroken:
            raise SealBroken(
                f"session {public_id(key)!r}: object {segment.object} (records {segment.first_record}..) failed "
                "authentication (a changed byte, or an object moved from another session, position or owner); "
                "nothing was decrypted or served"
            ) from None


__all__ = ["SegmentSealer", "Sealed", "SharedKeyring", "attach", "encrypted", "owner_of"]
