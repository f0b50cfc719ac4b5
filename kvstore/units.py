"""Sizes written by people (``512M``, ``10G``): parsed once, here, for every layer that takes one.

>>> parse_size("1.5K"), parse_size("2GiB"), parse_size(7), parse_size(None)
(1536, 2147483648, 7, None)
"""

from __future__ import annotations

import re

from kvstore.errors import ConfigError

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str | int | None) -> int | None:
    """``"512M"``, ``"10G"``, ``"1048576"`` -> bytes (binary units); an int is taken as bytes; None stays None.

    Raises
    ------
    ConfigError
        Text that is not a number with an optional K, M, G or T suffix.
    """
    if text is None or isinstance(text, int):
        return text
    match = _SIZE.match(text)
    if match is None:
        raise ConfigError(f"{text!r} is not a size: use a number of bytes with an optional K, M, G or T suffix")
    number, unit = match.groups()
    return int(float(number) * _UNITS[(unit or "")[:1].lower()])
