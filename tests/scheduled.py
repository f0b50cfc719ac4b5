"""Shared by the scheduler's tests: a submitted turn's events read to its end."""

from __future__ import annotations

from kvstore.engine.scheduler import Outcome, TurnWork


def drain(work: TurnWork, timeout: float = 120.0) -> tuple[list[int], Outcome]:
    """The tokens ``work``'s events carried, then its outcome (waits at most ``timeout`` per event)."""
    tokens = []
    while True:
        kind, value = work.events.get(timeout=timeout)
        if kind == "end":
            return tokens, value
        tokens.append(value)
