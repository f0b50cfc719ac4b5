"""The shared index's PostgreSQL schema (docs/SCALE.md, "Tables") and its ordered upgrade steps.

Each step is SQL run in one transaction together with the bump of ``kv_meta.schema_version``, under
a transaction-level advisory lock, so replicas starting at once upgrade the schema exactly once.
"""

from __future__ import annotations

#: ``pg_advisory_xact_lock`` key serializing schema creation and upgrades across replicas.
SCHEMA_LOCK = 0x6B7673_0001

CURRENT_VERSION = 10

#: version reached -> the statements that reach it from the version before.
STEPS: dict[int, tuple[str, ...]] = {
    1: (
        """CREATE TABLE IF NOT EXISTS kv_sessions (
            key text PRIMARY KEY,
            owner text NOT NULL,
            header bytea NOT NULL CHECK (length(header) = 40),
            rec_bytes integer NOT NULL CHECK (rec_bytes > 0),
            n_records bigint NOT NULL DEFAULT 0 CHECK (n_records >= 0),
            size_bytes bigint NOT NULL DEFAULT 40,
            watermark bigint NOT NULL DEFAULT 0,
            record jsonb NOT NULL DEFAULT '{}',
            state text NOT NULL DEFAULT 'active',
            created_ns bigint NOT NULL,
            updated_ns bigint NOT NULL,
            last_used_ns bigint NOT NULL
        )""",
        # the global LRU (eviction across replicas) and an owner's sessions without a scan
        "CREATE INDEX IF NOT EXISTS kv_sessions_lru ON kv_sessions (last_used_ns)",
        "CREATE INDEX IF NOT EXISTS kv_sessions_owner ON kv_sessions (owner, key)",
        "CREATE SEQUENCE IF NOT EXISTS kv_fencing AS bigint",
        """CREATE TABLE IF NOT EXISTS kv_leases (
            key text PRIMARY KEY REFERENCES kv_sessions (key) ON DELETE CASCADE,
            holder text NOT NULL,
            token bigint NOT NULL,
            expires_at timestamptz NOT NULL
        )""",
        """CREATE TABLE IF NOT EXISTS kv_segments (
            key text NOT NULL REFERENCES kv_sessions (key) ON DELETE CASCADE,
            first_record bigint NOT NULL CHECK (first_record >= 0),
            n_records bigint NOT NULL CHECK (n_records > 0),
            object text NOT NULL UNIQUE,
            nbytes bigint NOT NULL,
            digest bytea NOT NULL,
            token bigint NOT NULL,
            complete boolean NOT NULL DEFAULT true,
            committed_at timestamptz NOT NULL DEFAULT clock_timestamp(),
            PRIMARY KEY (key, first_record)
        )""",
        # intents carry no foreign key: an intent outlives a deleted session until GC removes its object
        """CREATE TABLE IF NOT EXISTS kv_pending (
            object text PRIMARY KEY,
            key text NOT NULL,
            token bigint NOT NULL,
            nbytes bigint NOT NULL,
            created_at timestamptz NOT NULL DEFAULT clock_timestamp()
        )""",
        "CREATE INDEX IF NOT EXISTS kv_pending_age ON kv_pending (created_at)",
        # API keys as kvstore.keys.KeyRecord holds them (never a key: a salted digest, or the plain
        # SHA-256 of a key that has no salt)
        """CREATE TABLE IF NOT EXISTS kv_keys (
            id text PRIMARY KEY,
            owner text NOT NULL,
            salt bytea,
            digest bytea NOT NULL CHECK (length(digest) = 32),
            created timestamptz,
            expires timestamptz,
            revoked timestamptz,
            hint text,
            position bigserial
        )""",
        "CREATE INDEX IF NOT EXISTS kv_keys_owner ON kv_keys (owner, position)",
    ),
    # idempotency keys: (session, the client's Idempotency-Key) -> the first result, written by the
    # commit that appended it, so a retry through any replica answers it instead of appending again
    2: (
        """CREATE TABLE IF NOT EXISTS kv_idempotency (
            key text NOT NULL REFERENCES kv_sessions (key) ON DELETE CASCADE,
            request_key text NOT NULL,
            request_digest bytea NOT NULL CHECK (length(request_digest) = 32),
            first_record bigint NOT NULL,
            end_record bigint NOT NULL,
            created_at timestamptz NOT NULL DEFAULT clock_timestamp(),
            PRIMARY KEY (key, request_key)
        )""",
        "CREATE INDEX IF NOT EXISTS kv_idempotency_age ON kv_idempotency (created_at)",
    ),
    # fork: sessions share immutable objects, so an object may be listed by several segment rows;
    # an object a truncate or delete no longer lists waits in kv_dropped for GC (readers of an
    # older snapshot may still fetch it during the grace)
    3: (
        "ALTER TABLE kv_segments DROP CONSTRAINT IF EXISTS kv_segments_object_key",
        "CREATE INDEX IF NOT EXISTS kv_segments_object ON kv_segments (object)",
        """CREATE TABLE IF NOT EXISTS kv_dropped (
            object text PRIMARY KEY,
            dropped_at timestamptz NOT NULL DEFAULT clock_timestamp()
        )""",
    ),
    # prefix lookup: the chain hash of every whole 64-token block below a session's watermark
    # (kvstore.migrations.index.chain_hashes, seeded by owner and fingerprint), written by the
    # commit that moves the watermark
    4: (
        """CREATE TABLE IF NOT EXISTS kv_prefix (
            key text NOT NULL REFERENCES kv_sessions (key) ON DELETE CASCADE,
            block integer NOT NULL CHECK (block >= 0),
            chain bytea NOT NULL,
            PRIMARY KEY (key, block)
        )""",
        "CREATE INDEX IF NOT EXISTS kv_prefix_chain ON kv_prefix (chain, block)",
    ),
    # park: a segment's object may hold its records compressed (one zstd frame); the digest and
    # nbytes stay the records', stored_bytes is the object's own size
    5: (
        "ALTER TABLE kv_segments ADD COLUMN IF NOT EXISTS codec text NOT NULL DEFAULT 'raw'",
        "ALTER TABLE kv_segments ADD COLUMN IF NOT EXISTS stored_bytes bigint",
        "ALTER TABLE kv_segments DROP CONSTRAINT IF EXISTS kv_segments_codec",
        "ALTER TABLE kv_segments ADD CONSTRAINT kv_segments_codec CHECK "
        "(codec IN ('raw', 'zstd') AND (codec = 'raw') = (stored_bytes IS NULL))",
    ),
    # jobs (park, unpark, migrate) as the replica running each publishes them, so GET /jobs/{id}
    # answers through every replica; finished ones are forgotten by GC after a day
    6: (
        """CREATE TABLE IF NOT EXISTS kv_jobs (
            id text PRIMARY KEY,
            owner text NOT NULL,
            job jsonb NOT NULL,
            finished boolean NOT NULL DEFAULT false,
            updated_at timestamptz NOT NULL DEFAULT clock_timestamp()
        )""",
        "CREATE INDEX IF NOT EXISTS kv_jobs_owner ON kv_jobs (owner, updated_at)",
    ),
    # many sessions: a page of a list is an index range after the last page's (created_ns, key)
    # (keyset paging, oldest first); each owner's count of sessions is kept by a trigger on every
    # insert and delete of a session row (create, fork, push, delete, eviction), so the cap on an
    # owner's sessions reads one row, and its update serializes that owner's creates until commit
    7: (
        "CREATE INDEX IF NOT EXISTS kv_sessions_listing ON kv_sessions (owner, created_ns, key)",
        "CREATE INDEX IF NOT EXISTS kv_sessions_created ON kv_sessions (created_ns, key)",
        """CREATE TABLE IF NOT EXISTS kv_owners (
            owner text PRIMARY KEY,
            sessions bigint NOT NULL CHECK (sessions >= 0)
        )""",
        # no session row comes or goes while the counts are taken and the trigger is put in place
        "LOCK TABLE kv_sessions IN SHARE ROW EXCLUSIVE MODE",
        "DELETE FROM kv_owners",
        "INSERT INTO kv_owners (owner, sessions) SELECT owner, count(*) FROM kv_sessions GROUP BY owner",
        """CREATE OR REPLACE FUNCTION kv_count_owner_sessions() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            IF TG_OP = 'INSERT' THEN
                INSERT INTO kv_owners (owner, sessions) VALUES (NEW.owner, 1)
                    ON CONFLICT (owner) DO UPDATE SET sessions = kv_owners.sessions + 1;
            ELSE
                UPDATE kv_owners SET sessions = sessions - 1 WHERE owner = OLD.owner;
            END IF;
            RETURN NULL;
        END
        $$""",
        "DROP TRIGGER IF EXISTS kv_sessions_owner_count ON kv_sessions",
        "CREATE TRIGGER kv_sessions_owner_count AFTER INSERT OR DELETE ON kv_sessions "
        "FOR EACH ROW EXECUTE FUNCTION kv_count_owner_sessions()",
    ),
    # a segment's BLAKE3-256, matched before any byte of it is served (rows.check_of); segments
    # committed before keep NULL and are checked by their blake2b digest, as before
    8: ("ALTER TABLE kv_segments ADD COLUMN IF NOT EXISTS check_digest bytea",),
    # expiry: a session's own time-to-live (ttl_ns, NULL: none) and each owner's default
    # (kv_owner_ttl); expires_ns (NULL: never) = last_used_ns + the TTL in force, kept by a trigger
    # on every write of last_used_ns, ttl_ns or owner (a commit, a touch, a TTL change), so the sweep
    # reads the expired sessions from the front of one index, never every row
    9: (
        "ALTER TABLE kv_sessions ADD COLUMN IF NOT EXISTS ttl_ns bigint CHECK (ttl_ns > 0)",
        "ALTER TABLE kv_sessions ADD COLUMN IF NOT EXISTS expires_ns bigint",
        """CREATE TABLE IF NOT EXISTS kv_owner_ttl (
            owner text PRIMARY KEY,
            ttl_ns bigint NOT NULL CHECK (ttl_ns > 0)
        )""",
        """CREATE OR REPLACE FUNCTION kv_session_expiry() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            NEW.expires_ns := NEW.last_used_ns
                + coalesce(NEW.ttl_ns, (SELECT ttl_ns FROM kv_owner_ttl WHERE owner = NEW.owner));
            RETURN NEW;
        END
        $$""",
        "DROP TRIGGER IF EXISTS kv_sessions_expiry ON kv_sessions",
        "CREATE TRIGGER kv_sessions_expiry BEFORE INSERT OR UPDATE OF last_used_ns, ttl_ns, owner ON kv_sessions "
        "FOR EACH ROW EXECUTE FUNCTION kv_session_expiry()",
        "CREATE INDEX IF NOT EXISTS kv_sessions_expiry ON kv_sessions (expires_ns) WHERE expires_ns IS NOT NULL",
    ),
    # encryption at rest (docs/SECURITY.md, "The shared store"; kvstore.store.shared.keys): each
    # owner's data keys, wrapped by the KEK every replica reads from its own settings, kept here so
    # every replica sees them; kv_meta 'kek_id' marks a store created encrypted, 'keys_epoch' counts
    # the destructions (shred, retire) that every replica's read plan checks. A segment's object is
    # sealed under its owner's data key of version key_version (NULL: a plaintext object, whose
    # stored_bytes is NULL unless compressed); the trigger refuses a plaintext segment in a store
    # created encrypted, so a replica started without the KEK can never mix the two
    10: (
        "ALTER TABLE kv_segments ADD COLUMN IF NOT EXISTS key_version integer CHECK (key_version > 0)",
        "ALTER TABLE kv_segments DROP CONSTRAINT IF EXISTS kv_segments_codec",
        "ALTER TABLE kv_segments ADD CONSTRAINT kv_segments_codec CHECK "
        "(codec IN ('raw', 'zstd') AND (stored_bytes IS NULL) = (codec = 'raw' AND key_version IS NULL))",
        """CREATE TABLE IF NOT EXISTS kv_key_owners (
            owner text PRIMARY KEY,
            current integer,
            next integer NOT NULL CHECK (next > 0),
            shredded_at timestamptz
        )""",
        """CREATE TABLE IF NOT EXISTS kv_data_keys (
            owner text NOT NULL REFERENCES kv_key_owners (owner) ON DELETE CASCADE,
            version integer NOT NULL CHECK (version > 0),
            wrapped bytea NOT NULL,
            created_at timestamptz NOT NULL DEFAULT clock_timestamp(),
            PRIMARY KEY (owner, version)
        )""",
        "INSERT INTO kv_meta (name, value) VALUES ('keys_epoch', '0') ON CONFLICT (name) DO NOTHING",
        """CREATE OR REPLACE FUNCTION kv_refuse_plaintext_segment() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            IF NEW.key_version IS NULL AND EXISTS (SELECT 1 FROM kv_meta WHERE name = 'kek_id') THEN
                RAISE EXCEPTION 'kvstore: a plaintext segment in a shared store created encrypted'
                    USING ERRCODE = 'check_violation';
            END IF;
            RETURN NEW;
        END
        $$""",
        "DROP TRIGGER IF EXISTS kv_segments_sealed ON kv_segments",
        "CREATE TRIGGER kv_segments_sealed BEFORE INSERT ON kv_segments "
        "FOR EACH ROW EXECUTE FUNCTION kv_refuse_plaintext_segment()",
    ),
}

META_TABLE = "CREATE TABLE IF NOT EXISTS kv_meta (name text PRIMARY KEY, value text NOT NULL)"
