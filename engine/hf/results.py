"""What a restore hands back: :class:`Restored` (one session) and :class:`BatchRestored` (a batch),
with the inputs ``generate`` takes next."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np
import torch

from kvstore.engine.hf.layout import cache_length
from kvstore.engine.hf.tokens import next_input_ids
from kvstore.errors import InvalidRequest
from kvstore.tiers import Tier

if TYPE_CHECKING:
    from kvstore.store import SessionInfo

__all__ = ["BatchRestored", "Restored"]


@dataclass
class Restored:
    """A session restored into a transformers cache. Unpacks as ``tokens, cache``.

    Attributes
    ----------
    tokens : int32[n] — the conversation restored
    cache : ``DynamicCache`` with rows ``[1, 1, r, kv_lora]`` / ``[1, 1, r, qk_rope]`` for the first
        ``r = reused_tokens`` tokens
    reused_tokens : r — the tokens the caller need not run through the model again: ``n``, or
        ``n - 1`` once :meth:`input_ids` with no new turn has handed the last one back
    session_id : the session restored (None when a prefix restore found nothing)
    info : its SessionInfo at restore time
    tier : the tier its rows were stored in (lossy unless ``f32``)
    verified : whether the turn hashes were checked
    damaged_from : first record of the first damaged turn when ``verify`` found one (not served)
    """

    tokens: np.ndarray
    cache: Any
    reused_tokens: int
    session_id: str | None = None
    info: "SessionInfo | None" = None
    tier: Tier | None = None
    verified: bool = False
    damaged_from: int | None = None

    def __iter__(self):
        return iter((self.tokens, self.cache))

    def prefilled_tokens(self, context_tokens: int) -> int:
        """Tokens a context of ``context_tokens`` still has to run through the model."""
        return context_tokens - self.reused_tokens

    def input_ids(self, new_tokens=(), device=None) -> torch.Tensor:
        """``int64[1, n + m]``: the stored tokens then ``new_tokens`` — what ``generate`` takes.

        With no new turn, the last stored token is handed back as the input (the cache gives up
        its row, ``reused_tokens`` becomes ``n - 1``), so ``generate(restored.input_ids())``
        continues the conversation exactly where it stopped instead of running it twice. See
        :func:`~kvstore.engine.hf.next_input_ids`.

        Raises
        ------
        InvalidRequest
            Nothing to continue (an empty conversation and no new turn).
        ConversationMismatch
            The cache has been continued past the restored tokens: build the input from
            ``generate``'s output row instead.
        """
        ids = next_input_ids(self.cache, self.tokens, new_tokens, device=device)
        self.reused_tokens = cache_length(self.cache)
        return ids


@dataclass
class BatchRestored:
    """Sessions restored into one left-padded batched cache.

    Row ``b`` of the cache is ``N - n_b`` padding rows (zeros, masked out) then the session's
    ``n_b`` rows, ``N = max n_b``; every row keeps the positions it was stored with (``0..n_b-1``).

    Attributes
    ----------
    tokens : list of int32[n_b]
    cache : ``DynamicCache`` with rows ``[B, 1, N, w]``
    attention_mask : int64[B, N] — 1 for a restored row, 0 for padding
    reused_tokens : list of n_b
    session_ids, infos, tiers, damaged_from : per session, as in :class:`Restored`
    """

    tokens: list[np.ndarray]
    cache: Any
    attention_mask: torch.Tensor
    reused_tokens: list[int]
    session_ids: list[str]
    infos: list["SessionInfo"]
    tiers: list[Tier]
    damaged_from: list[int | None]

    def inputs(
        self, new_tokens: Sequence[Sequence[int]], pad_token_id: int = 0, device=None
    ) -> dict[str, torch.Tensor]:
        """The batch's next inputs: ``{"input_ids", "attention_mask", "position_ids"}``, each ``[B, N + M]``.

        Row ``b`` is ``[pad | stored tokens | pad | new_tokens[b]]`` with ``M = max len(new_tokens[b])``
        (every row needs at least one new token: its last one gives the next token's logits); the
        mask is 0 on both paddings and ``position_ids`` count real tokens only, so each sequence
        continues at position ``n_b``. Pass ``input_ids`` and ``attention_mask`` to ``generate`` (it
        derives the same positions from the mask); ``position_ids`` is for a hand-written loop.

        Raises
        ------
        InvalidRequest
            Not one turn per sequence, or an empty turn (a session continued as it stands is
            restored alone: :meth:`Restored.input_ids` hands its last token back).
        """
        batch, cached = self.attention_mask.shape
        if len(new_tokens) != batch:
            raise InvalidRequest(f"{len(new_tokens)} new turns for a batch of {batch}")
        turns = [np.asarray(turn, dtype=np.int64).reshape(-1) for turn in new_tokens]
        if any(turn.size == 0 for turn in turns):
            raise InvalidRequest(
                "every sequence needs at least one new token (the last one gives the next token's logits); "
                "to continue a session as it stands, restore it alone and call input_ids()"
            )
        width = max(turn.size for turn in turns)
        ids = torch.full((batch, cached + width), pad_token_id, dtype=torch.int64)
        mask = torch.zeros((batch, cached + width), dtype=torch.int64)
        mask[:, :cached] = self.attention_mask.cpu()
        for b, (stored, turn) in enumerate(zip(self.tokens, turns)):
            ids[b, cached - stored.size : cached] = torch.from_numpy(stored.astype(np.int64))
            ids[b, cached + width - turn.size :] = torch.from_numpy(turn)
            mask[b, cached + width - turn.size :] = 1
        positions = (mask.cumsum(-1) - 1).clamp_min(0)
        out = {"input_ids": ids, "attention_mask": mask, "position_ids": positions}
        return {k: v.to(device) for k, v in out.items()} if device is not None else out
