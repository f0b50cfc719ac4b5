"""Verify, inspect and prefix lookup on the shared store, with the embedded store's answers.

A turn of the embedded store (one append, hashed in the index) is a segment here (one append, one
immutable object whose blake2b-256 the commit recorded), so :func:`verify_session` answers the
:class:`~kvstore.store.results.VerifyReport` over the committed segments, and
:func:`inspect_session` the embedded ``inspect`` report over the session's ``.coli_kv`` image
(:func:`kvstore.store.results.records_report`). Both read one committed snapshot
(``SharedIndex.read_plan``), so an append committed meanwhile is neither half seen nor mistaken
for damage. :func:`record_of` gives a shared index row as the embedded index's record.
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np

from kvstore.errors import InvalidRequest, SessionDamaged, SessionNotFound
from kvstore.filetools import CHUNK_BYTES, chunks_reader, scan_stream
from kvstore.formats import coli_kv
from kvstore.formats.coli_kv import HEADER_BYTES
from kvstore.migrations import index as prefix_schema
from kvstore.store.results import LookupResult, VerifyReport, common_prefix, query_tokens, records_report
from kvstore.store.shared.store import UNKNOWN_MODEL, SharedStore, fingerprint_key_of
from kvstore.store.values import Fingerprint, IndexRecord, ModelInfo, Progress, SessionInfo, public_id, tier_record


def verify_session(shared: SharedStore, key: str, progress: Progress | None = None) -> VerifyReport:
    """Re-hash every committed segment of ``key`` against the digest its commit recorded.

    The segments are fetched whole, several in parallel (``SharedStore.first_damaged``: a replica's
    cached copy is re-hashed, and one that fails is refetched from the object store);
    ``progress(bytes_hashed, bytes_total)`` is called as each is checked.

    Returns
    -------
    VerifyReport : ``first_bad`` is the first segment (turn) whose bytes differ, or the records the
        committed segments do not cover; ``good_records`` the records before it.
    """
    plan = shared.index.read_plan(key)
    segments = plan.segments
    bad_record = shared.first_damaged(key, plan, plan.n_records, progress)
    first_bad = None
    expected = 0
    for turn, segment in enumerate(segments):
        # a gap or an overlap in the committed list: nothing past it is vouched for
        if segment.first_record != expected or (bad_record is not None and segment.first_record >= bad_record):
            first_bad = {"turn": turn, "start": expected, "end": segment.end}
            break
        expected = segment.end
    if first_bad is None and expected != plan.n_records:
        first_bad = {"turn": len(segments), "start": expected, "end": plan.n_records}
    good = first_bad["start"] if first_bad is not None else plan.n_records
    return VerifyReport(public_id(key), first_bad is None, plan.n_records, len(segments), first_bad, good)


def inspect_session(shared: SharedStore, key: str, info: SessionInfo) -> dict[str, Any]:
    """What the session's ``.coli_kv`` image holds (header fields, sizes, what a loader would
    neutralize), read from one committed snapshot; ``info`` is the session as the index holds it.

    ``file`` says where the image lives: its bytes and the segment objects holding its records.

    Raises
    ------
    SessionDamaged : a segment object is missing, or its bytes do not match its digest
    """
    plan = shared.index.read_plan(key)
    header = bytearray(plan.header)
    header[32:36] = np.int32(plan.n_records).tobytes()  # nrec = the committed count, as file_bytes writes it
    # judged a chunk at a time as the records stream in, one block of whole segments at a time
    # (each checked against its digest): never the whole image in memory
    per = max(1, CHUNK_BYTES // plan.rec_bytes)
    chunks = shared.stream_planned(key, plan, 0, plan.n_records, per, read_ahead_bytes=0)
    try:
        size = HEADER_BYTES + plan.n_records * plan.rec_bytes
        scan = scan_stream(chunks_reader(itertools.chain([bytes(header)], chunks)), size=size)
    finally:
        chunks.close()
    return {
        "session": info.to_dict(),
        "turns": len(plan.segments),
        "file": {"objects": len(plan.segments), "bytes": scan.file_size},
        **records_report(scan),
    }


def longest_prefix(shared: SharedStore, owner: str, fingerprint: Fingerprint, tokens) -> LookupResult | None:
    """The owner's session (same fingerprint) sharing the longest token prefix with ``tokens``.

    The chain hashes of the query's 64-token blocks are matched against ``kv_prefix`` in one query
    (written by the commits that moved each session's watermark); the deepest sessions' match is
    extended past their last whole block from their stored tokens (at most 63 records read).
    Capped at each session's watermark; less than one block matches nothing. Ties go to the most
    recently used session, as on the embedded store.
    """
    tokens = query_tokens(owner, fingerprint, tokens)
    if tokens is None:
        return None
    chains = prefix_schema.chain_hashes(prefix_schema.chain_seed(owner, fingerprint.key()), tokens)
    block = prefix_schema.PREFIX_BLOCK_TOKENS
    best: tuple[int, int, dict[str, Any]] | None = None
    for row in shared.index.prefix_matches(owner, chains):
        matched = int(row["depth"]) * block
        upto = min(int(row["watermark"]), tokens.shape[0])
        if upto > matched:
            try:
                _, stored = shared.read_records(row["key"], matched, upto)
            except (SessionNotFound, InvalidRequest, SessionDamaged):
                continue  # truncated or deleted since the query: not a match now
            header = coli_kv.parse_header(row["header"])
            stored_tokens = np.frombuffer(stored, dtype=coli_kv.record_dtype(header.geometry, header.tier))["token"]
            matched += common_prefix(stored_tokens, tokens[matched : matched + stored_tokens.shape[0]])
        if best is None or (matched, int(row["last_used_ns"])) > best[:2]:
            best = (matched, int(row["last_used_ns"]), row)
    if best is None:
        return None
    matched, _, row = best
    return LookupResult(public_id(row["key"]), matched, row["state"], int(row["n_records"]), int(row["watermark"]))


def record_of(row: dict[str, Any]) -> IndexRecord:
    """A shared index row as the embedded index's record (what :class:`SessionInfo` reads)."""
    header = coli_kv.parse_header(row["header"])
    stored = row["record"] or {}
    model = ModelInfo.from_dict(stored["model"]) if stored.get("model") else UNKNOWN_MODEL
    fingerprint = fingerprint_key_of(row)
    return {
        "id": row["key"],
        "owner": row["owner"],
        "model": model.to_dict(),
        "geometry": list(header.geometry.words()),
        "tier": tier_record(header.tier),
        "n_records": int(row["n_records"]),
        "watermark": int(row["watermark"]),
        "created": row["created_ns"] / 1e9,
        "created_ns": int(row["created_ns"]),  # exactly: the listing order and its cursors
        "updated": row["updated_ns"] / 1e9,
        "last_used": row["last_used_ns"] / 1e9,
        "last_used_ns": int(row["last_used_ns"]),
        "size_bytes": int(row["size_bytes"]),
        "tags": list(stored.get("tags") or ()),
        "state": row["state"],
        "parent": stored.get("parent"),
        "fork_point": stored.get("fork_point"),
        "problem": stored.get("problem"),
        "fingerprint": fingerprint,
        "prefix_blocks": 0,
        "ttl_s": int(row["ttl_ns"]) / 1e9 if row.get("ttl_ns") is not None else None,
        "expires_ns": int(row["expires_ns"]) if row.get("expires_ns") is not None else None,
    }
