"""Token ids in, and the input ``generate`` takes next (issue 21: never the conversation twice).

transformers' ``generate`` runs the input tokens past the cache's length: ``input_ids[:,
cache_length:]``. When the cache already holds a row for every input token, that slice is empty
and ``generate`` runs the *whole* input again on top of the cache — a silently wrong continuation
(the rows of the conversation twice) rather than an error. Two guards make that impossible here:

- :func:`next_input_ids` builds the next input from a conversation and its cache. With no new turn
  and a row for every token, the cache gives up its last row and that token is handed back as the
  input, so ``generate`` recomputes it and continues exactly where the conversation stopped
  (``Restored.input_ids()`` is this function).
- :func:`prefill_length` checks an input built any other way before ``generate`` runs, and refuses
  one the cache already covers.
"""

from __future__ import annotations

import numpy as np
import torch

from kvstore.engine.errors import ConversationMismatch
from kvstore.engine.hf.layout import cache_length
from kvstore.errors import InvalidRequest

__all__ = ["next_input_ids", "prefill_length"]


def token_array(tokens, vocab: int | None = None, what: str = "tokens") -> np.ndarray:
    """``int64[S]`` token ids from a list, numpy array or torch tensor of shape ``[S]`` or ``[1, S]``.

    Raises
    ------
    InvalidRequest
        Not a 1-D sequence of integers, or (with ``vocab``) an id outside ``[0, vocab)``.
    """
    if isinstance(tokens, torch.Tensor):
        tokens = tokens.detach().cpu().numpy()
    array = np.asarray(tokens)
    if array.ndim == 2 and array.shape[0] == 1:
        array = array[0]
    if array.ndim != 1 or (array.size and not np.issubdtype(array.dtype, np.integer)):
        raise InvalidRequest(f"{what} must be a 1-D sequence of token ids, got shape {list(array.shape)}")
    array = array.astype(np.int64)
    if vocab is not None and array.size and (array.min() < 0 or array.max() >= vocab):
        raise InvalidRequest(f"{what} must be ids in [0, {vocab}), got {array.min()}..{array.max()}")
    return array


def first_difference(a: np.ndarray, b: np.ndarray) -> int | None:
    """Index of the first position where ``a`` and ``b`` differ (over their common length), or None."""
    n = min(a.shape[0], b.shape[0])
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else None


def next_input_ids(cache, tokens, new_tokens=(), *, device=None) -> torch.Tensor:
    """The input ``generate`` continues a conversation from: its tokens, then the new turn.

    Parameters
    ----------
    cache : ``DynamicCache`` (batch 1) holding the rows of the first ``r <= n`` tokens
    tokens : int[n] — the conversation so far
    new_tokens : int[m] — the next turn; may be empty
    device : where the ids go (default: the CPU)

    Returns
    -------
    ``int64[1, n + m]``. With no new turn (``m == 0``) and a row for every token (``r == n``), the
    cache gives up its last row (``cache.crop(-1)``, in place) and that token is handed back as the
    input: ``generate`` recomputes its row and continues exactly where the conversation stopped
    (f32: token for token the uninterrupted run). Called again, nothing more is dropped.

    Raises
    ------
    InvalidRequest
        No tokens and no new turn: nothing to continue.
    ConversationMismatch
        The cache holds more rows than ``tokens`` (it has been continued since: build the input
        from ``generate``'s output row instead).
    """
    stored = token_array(tokens, what="tokens")
    turn = token_array(new_tokens, what="new_tokens")
    rows, n = cache_length(cache), stored.shape[0]
    if rows > n:
        raise ConversationMismatch(
            f"the cache holds {rows} rows but the conversation only {n} tokens: it has been continued since; "
            f"continue from generate's output row (and check it with hf.prefill_length)"
        )
    if turn.size == 0:
        if n == 0:
            raise InvalidRequest("nothing to continue: the conversation is empty and no new turn was given")
        if rows == n:  # the last token goes back to the input: generate must run at least one token
            cache.crop(-1)
    ids = torch.from_numpy(np.concatenate([stored, turn]))[None]
    return ids.to(device) if device is not None else ids


def prefill_length(cache, input_ids) -> int:
    """Tokens of ``input_ids`` that ``generate`` will run through the model on top of ``cache``.

    Call it on an input built by hand, before ``generate``: an input the cache already covers
    would be run through the model a second time, on top of its own rows.

    Parameters
    ----------
    cache : ``DynamicCache`` holding ``r`` rows (per sequence)
    input_ids : int[S] or int[B, S] — what ``generate`` is about to take

    Returns
    -------
    ``S - r``, at least 1.

    Raises
    ------
    InvalidRequest
        ``r == S``: the cache already holds a row for every input token.
    ConversationMismatch
        ``r > S``: the cache is not this input's.
    """
    width = int(torch.as_tensor(input_ids).shape[-1])
    rows = cache_length(cache)
    if rows > width:
        raise ConversationMismatch(
            f"the cache holds {rows} rows, more than the {width} input tokens: it is not this input's cache"
        )
    if rows == width:
        raise InvalidRequest(
            f"the cache already holds a row for each of the {width} input tokens: generate would run all of them "
            f"again on top of it; append the new turn to the input, or continue the conversation as it stands "
            f"with restored.input_ids() / hf.next_input_ids(cache, tokens), which hand the last token back"
        )
    return width - rows
