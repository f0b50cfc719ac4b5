"""Sizes written by people (``512M``, ``10G``) for every layer that takes one (parsed by
``kvstore.config.size_bytes``, which the environment's sizes use too).

>>> parse_size("1.5K"), parse_size("2GiB"), parse_size(7), parse_size(None)
(1536, 2147483648, 7, None)
"""

from __future__ import annotations

from kvstore import config
from kvstore.errors import ConfigError


def parse_size(text: str | int | None) -> int | None:
    """``"512M"``, ``"10G"``, ``"1048576"`` -> bytes (binary units); an int is taken as bytes; None stays None.

    Raises
    ------
    ConfigError
        Text that is not a number with an optional K, M, G or T suffix.
    """
    if text is None or isinstance(text, int):
        return text
    try:
        return config.size_bytes(text)
    except ValueError:
        raise ConfigError(
            f"{text!r} is not a size: use a number of bytes with an optional K, M, G or T suffix"
        ) from None
