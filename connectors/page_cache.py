"""Pages of MLA latent rows keyed by an engine's page hashes, over the session store.

SGLang's hierarchical cache (``HiCacheStorage``) names each page of ``page_size`` tokens by a
chain hash of its tokens and of the pages before it, and asks its storage for pages by those keys
only: it never hands over the token ids. :class:`PageCache` stores each page as one session of
``page_size`` rows (one complete turn), its id derived from the fingerprint and the page key, so:

- pages of another model, weights, cache dtype, geometry or tier are other ids: never found, never
  loaded; a page stored only under another fingerprint of the owner is a miss counted as
  ``refused`` (the same counters as :class:`~kvstore.connectors.prefix_cache.PrefixCache`);
- ids are per owner (the store keys sessions by id and owner), so owners never see each other's
  pages; in service mode the API key decides the owner;
- every load re-hashes the page's turn against the index first (``verify``): a changed byte is a
  failed load, never rows handed back as fine;
- the tier applies as everywhere: pages are stored as f32, fp8, int4, ... and dequantized on load.

The token column of a page's records holds 0 (the engine does not say which tokens they are) and
the geometry's vocabulary is 1; prefix lookups by token ids do not apply to these sessions.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from typing import Iterable

import numpy as np

from kvstore.connectors.hot_tier import HotTier
from kvstore.connectors.prefix_cache import LoadFailed, PrefixCache
from kvstore.connectors.store_client import StoreClient
from kvstore.errors import KVStoreError
from kvstore.store import Fingerprint, Store

# The vocabulary of a page session's geometry: its token column holds 0 (the engine gives none).
PAGE_VOCAB = 1
# How long the list of the owner's other fingerprints (for counting refusals) is reused: listing
# reads every session of the owner, so a miss must not pay it each time.
FINGERPRINTS_TTL_S = 30.0


class PageCache(PrefixCache):
    """Pages of ``page_size`` rows by key, in one owner's part of a store, for one fingerprint.

    Parameters
    ----------
    store, owner, fingerprint, verify, stats_path, hot : as :class:`PrefixCache` (a page loaded or
        saved is one hot-tier entry)
    page_size : tokens per page (rows per stored session)
    id_prefix : what the session ids start with (the engine's name)

    Counters (``stats``): ``lookups`` pages asked for by an existence check, each a ``hit`` or a
    ``miss`` (``refused``: a miss stored under another fingerprint); ``loads``/``loaded_tokens``
    pages read and their rows, ``load_errors`` pages missing, damaged or refused on read;
    ``saves``/``saved_tokens`` pages written, ``save_errors`` pages that could not be.
    """

    def __init__(
        self,
        store: StoreClient | Store,
        owner: str | None,
        fingerprint: Fingerprint,
        *,
        page_size: int,
        id_prefix: str = "page",
        verify: bool = True,
        stats_path: str | os.PathLike | None = None,
        hot: HotTier | None = None,
    ):
        super().__init__(store, owner, fingerprint, verify=verify, min_tokens=1, stats_path=stats_path, hot=hot)
        if page_size < 1:
            raise ValueError(f"page_size must be 1 or more, got {page_size}")
        self.page_size = page_size
        self.id_prefix = id_prefix
        self._zeros = np.zeros(page_size, dtype=np.int32)
        self._others: tuple[float, list[Fingerprint]] | None = None
        self._others_lock = threading.Lock()

    def page_id(self, key: str, fingerprint: Fingerprint | None = None) -> str:
        """The session id of page ``key`` under ``fingerprint`` (this cache's by default)."""
        salt = (fingerprint.key() if fingerprint is not None else self._key).encode()
        digest = hashlib.blake2b(salt + b"\0" + key.encode(), digest_size=16)
        return f"{self.id_prefix}-{digest.hexdigest()}"

    # ------------------------------------------------------------------ exists
    def _present(self, session_id: str, fingerprint_key: str) -> bool:
        stored = self.client.stored(session_id)
        return stored is not None and stored.fingerprint_key == fingerprint_key and stored.watermark >= self.page_size

    def count_present(self, keys: Iterable[str]) -> int:
        """How many of ``keys`` are stored, counted from the first up to the first missing one.

        Each key checked is one lookup, a hit or a miss; the keys after the first miss are not
        checked (a page is only usable after all the pages before it).
        """
        hits = 0
        missed = refused = False
        self._forget_if_shredded()
        for key in keys:
            try:
                if self._present(self.page_id(key), self._key):
                    hits += 1
                    continue
                refused = self._stored_elsewhere_page(key)
            except (KVStoreError, OSError) as exc:
                self._count(error=f"exists {key}: {exc}")
            missed = True
            break
        self._count(
            lookups=hits + int(missed),
            hits=hits,
            misses=int(missed),
            refused=int(refused),
            matched_tokens=hits * self.page_size,
        )
        return hits

    def _other_fingerprints(self) -> list[Fingerprint]:
        with self._others_lock:
            now = time.monotonic()
            if self._others is None or now - self._others[0] > FINGERPRINTS_TTL_S:
                others = [f for f in self.client.fingerprints() if f.key() != self._key]
                self._others = (now, others)
            return self._others[1]

    def _stored_elsewhere_page(self, key: str) -> bool:
        """Whether the owner holds page ``key`` under another fingerprint (counted, never loaded)."""
        for other in self._other_fingerprints():
            if self._present(self.page_id(key, other), other.key()):
                return True
        return False

    # ------------------------------------------------------------------ get / set
    def load_page(self, key: str, *, view: bool = False, native: bool = False) -> np.ndarray:
        """Page ``key``'s rows, f32 ``[n_layers, page_size, kv_lora + qk_rope]`` (``view``,
        ``native``: as :meth:`PrefixCache.load` takes them).

        Raises
        ------
        LoadFailed
            Missing, damaged (verification) or of another fingerprint; counted in ``load_errors``.
        """
        return self.load(self.page_id(key), 0, self.page_size, view=view, native=native)

    def save_page(self, key: str, rows: np.ndarray) -> bool:
        """Store page ``key``'s rows (f32 ``[n_layers, page_size, kv_lora + qk_rope]``); True when
        it is stored (now or before), False when it could not be (counted in ``save_errors``)."""
        g = self.fingerprint.geometry
        if rows.shape != (g.n_layers, self.page_size, self.row_width):
            raise ValueError(
                f"a page's rows must be [{g.n_layers}, {self.page_size}, {self.row_width}], got {list(rows.shape)}"
            )
        return self._store(self.page_id(key), self._zeros, rows) != "failed"


__all__ = ["PAGE_VOCAB", "LoadFailed", "PageCache"]
