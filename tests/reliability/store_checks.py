"""Checks shared by the store's reliability suites: what a store holds, read from its files."""

from __future__ import annotations

import os
from pathlib import Path

from kvstore.formats import coli_kv
from kvstore.formats.coli_kv import HEADER_BYTES
from kvstore.store import SessionStore, archive
from reliability.store_workload import TIER_NAMES, Session
from reliability.workload import GEOMETRY, turn_rows


def listing(folder: Path) -> set[str]:
    return {p.name for p in folder.iterdir()} if folder.exists() else set()


def journal_image(store: SessionStore, path: Path, *, exact: bool = False) -> bytes:
    """A journal's bytes as a ``.coli_kv`` image: as stored, or, in a store encrypted at rest, its
    committed frames decrypted (``exact``: a sealed file must hold nothing past them either)."""
    if not store.encrypted:
        return path.read_bytes()
    from crypto.support import sealed_image

    return sealed_image(store, path, exact=exact)


def archive_image(store: SessionStore, path: Path) -> bytes:
    if not store.encrypted:
        return b"".join(archive.stream_archive(path))
    from crypto.support import sealed_image

    return sealed_image(store, path, exact=True)


def set_aside_image(data: Path, name: str) -> bytes:
    """A journal recovery set aside in ``lost+found`` as a ``.coli_kv`` image (decrypted with the
    store's keyring when the store is encrypted at rest; its identity is the name it had)."""
    path = data / "lost+found" / name
    from kvstore.crypto.kek import provider_from_settings
    from kvstore.crypto.keyring import Keyring
    from kvstore.sealed import SealedImage, Sealing

    if not Keyring.exists(data):
        return path.read_bytes()
    fd = os.open(path, os.O_RDONLY)
    try:
        keyring = Keyring(data, provider_from_settings())
        image = SealedImage(fd, Sealing.for_key(keyring, name.split(".coli_kv")[0]), name)
        return image.header.to_bytes() + image.read_range(0, image.n_records)
    finally:
        os.close(fd)


def snapshot(store: SessionStore) -> dict[str, Session]:
    """Every visible session as its files hold it, after checking the index agrees with them."""
    out = {}
    journals = {n for n in listing(store.journals) if n.endswith(".coli_kv")}
    archives = {n for n in listing(store.archives) if n.endswith(".coli_kv.zst")}
    keys = set()
    for info in store.list():
        sid = info.id
        keys.add(info.key)  # files are named by the storage key, <id>~<owner>
        assert info.state in ("active", "parked"), (sid, info.state, info.problem)
        assert 0 <= info.watermark <= info.n_records, (sid, info.watermark, info.n_records)
        has_journal, has_archive = f"{info.key}.coli_kv" in journals, f"{info.key}.coli_kv.zst" in archives
        if info.state == "active":
            assert has_journal and not has_archive, (sid, has_journal, has_archive)
            path = store.journal_path(sid, owner=info.owner)
            image = journal_image(store, path, exact=True)
            assert info.size_bytes == path.stat().st_size
        else:
            assert has_archive and not has_journal, (sid, has_journal, has_archive)
            image = archive_image(store, store.archive_path(sid, owner=info.owner))
            assert info.size_bytes == store.archive_path(sid, owner=info.owner).stat().st_size
        header = coli_kv.parse_header(image)
        assert header.nrec == info.n_records and header.tier == info.tier, (sid, header.nrec, info.n_records)
        assert len(image) == HEADER_BYTES + info.n_records * info.record_bytes, (sid, "a torn or unacknowledged tail")
        out[sid] = Session(info.tier, image[HEADER_BYTES:], info.watermark, info.state)
    assert {n[: -len(".coli_kv")] for n in journals} <= keys, "a journal without an index entry"
    assert {n[: -len(".coli_kv.zst")] for n in archives} <= keys, "an archive without an index entry"
    leftovers = [n for n in listing(store.journals) | listing(store.archives) if ".tmp-" in n]
    assert leftovers == [], leftovers
    usage = store.usage()
    assert usage["reserved_bytes"] == 0
    assert usage["used_bytes"] == sum(info.size_bytes for info in store.list())
    return out


def describe(sessions: dict[str, Session]) -> dict:
    return {sid: (s.state, s.tier.describe(), s.n_records, s.watermark) for sid, s in sorted(sessions.items())}


def visible(store: SessionStore) -> dict[str, Session]:
    """Every visible session as the index and its files show it now, before any reconcile.

    An active session's bytes are its journal's first ``n_records`` (the journal may still hold
    records the index rolled back: they are never served); a parked one's, its archive's.
    """
    out = {}
    for info in store.list():
        assert 0 <= info.watermark <= info.n_records, (info.id, info.watermark, info.n_records)
        if info.state == "active":
            image = journal_image(store, store.journal_path(info.id, owner=info.owner))
            assert coli_kv.parse_header(image).nrec >= info.n_records, (
                info.id,
                "the index counts records the journal lost",
            )
        elif info.state == "parked":
            image = archive_image(store, store.archive_path(info.id, owner=info.owner))
        else:
            raise AssertionError(f"{info.id} is {info.state}: {info.problem}")
        body = image[HEADER_BYTES : HEADER_BYTES + info.n_records * info.record_bytes]
        assert len(body) == info.n_records * info.record_bytes, (info.id, "the file ends before the indexed records")
        out[info.id] = Session(info.tier, body, info.watermark, info.state)
    return out


def check_served(store: SessionStore, sessions: dict[str, Session]) -> None:
    """Every turn re-hashes, and resume serves exactly the rows up to the watermark."""
    for sid, session in sessions.items():
        assert store.verify(sid).ok, sid
        if session.state == "active":
            served = store.resume(sid).records.record_bytes()
            assert served == session.body[: session.watermark * session.record_bytes], sid


def turn_bytes(seed: int, turn: int) -> bytes:
    """The v2 records of turn ``turn`` of writer ``seed``."""
    return coli_kv.encode_records(GEOMETRY, TIER_NAMES["v2"], *turn_rows(seed, turn)).tobytes()


def acks_of(lines: list[list[str]]) -> list[tuple[int, int, int, int]]:
    """``(seed, turn, start, end)`` of each acknowledged append a role printed."""
    return [(int(f[1]), int(f[2]), int(f[3]), int(f[4])) for f in lines if f[0] == "ACK"]


def check_appends(body: bytes, record_bytes: int, writers: list[list[tuple[int, int, int, int]]]) -> int:
    """Every acknowledged turn ``(seed, turn, start, end)`` is whole at its range, in its writer's
    order, and the ranges tile ``body`` exactly once. Returns how many appends were acknowledged."""
    ranges = []
    for acks in writers:
        assert [a[1] for a in acks] == list(range(len(acks))), "a writer's turns are out of order or missing"
        starts = [a[2] for a in acks]
        assert starts == sorted(starts), "a writer's turns were stored out of its order"
        for seed, turn, start, end in acks:
            assert body[start * record_bytes : end * record_bytes] == turn_bytes(seed, turn), (seed, turn, start, end)
            ranges.append((start, end))
    ranges.sort()
    position = 0
    for start, end in ranges:
        assert start == position, f"records {position}..{start} belong to no acknowledged turn (or overlap)"
        position = end
    assert position * record_bytes == len(body), "records past the last acknowledged turn"
    return len(ranges)
