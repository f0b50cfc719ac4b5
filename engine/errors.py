"""Typed errors of the engine, on the ``KVStoreError`` root of ``kvstore.formats.errors``.

The engine's own errors: model folders, cache tiers, caches, generation, and the engine joined to
the session store (restores, transformers interop). The format errors the engine raises too
(``GeometryMismatch``, ``CodecMismatch``) are re-exported here. Each carries the reason shown to
the user (the CLI prints it; the API returns it with the status ``kvstore.api.errors`` maps the
class to) and subclasses the matching built-in so ``except ValueError`` still works.
"""

from __future__ import annotations

from kvstore.formats.errors import CodecMismatch, GeometryMismatch, KVStoreError

__all__ = [
    "CacheError",
    "CacheLayoutUnsupported",
    "CodecMismatch",
    "ConversationMismatch",
    "GenerationError",
    "GeometryMismatch",
    "KVStoreError",
    "ModelConfigError",
    "RestoreFailed",
    "ServerBusy",
    "TierUnsupported",
    "WeightsError",
]


# ---- the model folder (kvstore.engine.config, kvstore.engine.weights) -------------------------
class ModelConfigError(KVStoreError, ValueError):
    """A ``config.json`` the engine cannot run: wrong architecture, missing or inconsistent fields.

    The reason names the field; the engine runs MLA models (DeepSeek-V3 / GLM style).
    """


class WeightsError(KVStoreError, ValueError):
    """A model folder whose tensors are missing, misshapen or in a layout the loader does not know.

    The reason names the tensor; check the folder holds every shard of the model.
    """


# ---- caches and generation (kvstore.engine.cache, kvstore.engine.generate) --------------------
class TierUnsupported(KVStoreError, ValueError):
    """A cache tier that cannot hold this model's rows (e.g. TQ needs power-of-two widths).

    Pick another tier: ``f32``, ``bf16`` and ``fp8`` hold rows of any width.
    """


class CacheError(KVStoreError, ValueError):
    """A cache operation out of range: a write past the rows held, a restore of inconsistent rows.

    The cache is unchanged; the reason gives the rows it holds.
    """


class GenerationError(KVStoreError, ValueError):
    """Bad generation arguments: empty prompt, token ids outside the vocabulary, top_p not in (0, 1].

    The reason names the argument and the range it takes.
    """


# ---- the engine joined to the session store (kvstore.engine.session, kvstore.engine.hf) -------
class CacheLayoutUnsupported(KVStoreError, ValueError):
    """The transformers model (or version) does not cache the MLA latent rows kvstore stores.

    The reason says what its cache holds; use an MLA model whose cache keeps the compressed rows.
    """


class ConversationMismatch(KVStoreError, ValueError):
    """The tokens or cache given do not continue the conversation the session holds.

    Send the session's own history (or only the new turn), or fork the session where they diverge.
    """


class RestoreFailed(KVStoreError, RuntimeError):
    """Restoring a session into the engine's cache failed (e.g. device memory); nothing changed.

    The session and the cache are as they were: free device memory, or use a smaller tier, and retry.
    """


# ---- serving many conversations (kvstore.engine.scheduler) ------------------------------------
class ServerBusy(KVStoreError, RuntimeError):
    """The scheduler runs as many turns as it allows (for this owner, or in all); this one was not
    started and nothing was changed. Retry after ``retry_after`` seconds (the API's ``Retry-After``).
    """

    def __init__(self, reason: str, retry_after: float = 1.0):
        super().__init__(reason)
        self.retry_after = retry_after
