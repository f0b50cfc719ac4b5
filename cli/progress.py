"""The progress bar of every long command (``migrate``, ``verify``, ``repair``, ``export``, ``sessions
park | unpark | migrate | repair | resume``): bytes done, bytes/s and ETA on stderr.

A bar is drawn only where a person watches: stderr is a terminal and the command runs without
``--json``. Otherwise nothing is drawn and nothing is printed — not even a carriage return — so
piped output and ``--json`` output are exactly what they would be without this module. stdout never
carries a bar (it holds the answer, which may be piped).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import TypeVar

Progress = Callable[[int, int], None]
T = TypeVar("T")


def wanted(enabled: bool = True) -> bool:
    """Whether a bar would be drawn: ``enabled`` (not ``--json``) and stderr is a terminal."""
    try:
        return enabled and sys.stderr.isatty()
    except (AttributeError, ValueError):  # replaced by an object without a descriptor, or closed
        return False


@contextmanager
def bar(label: str, *, enabled: bool = True, bytes_per_unit: int = 1) -> Iterator[Progress | None]:
    """A ``progress(done, total)`` callback drawing a bar on stderr, or None when no bar is wanted.

    Parameters
    ----------
    label : what is being done (``"migrate"``, ``"verify"``, ...)
    enabled : False for ``--json`` runs
    bytes_per_unit : bytes per unit of ``done``/``total`` (a record's bytes when the work counts
        records), so that every bar counts bytes

    The callable is None when there is no bar, so the work does not even call back.
    """
    if not wanted(enabled):
        yield None
        return
    from tqdm import tqdm

    shown: tqdm | None = None  # drawn at the first report: work that never reports draws nothing

    def update(done: int, total: int) -> None:
        nonlocal shown
        if shown is None:
            shown = tqdm(
                desc=label,
                total=total * bytes_per_unit,
                unit="B",
                unit_scale=True,
                unit_divisor=1024,
                file=sys.stderr,
                leave=False,
                miniters=1,
            )
        elif shown.total != total * bytes_per_unit:
            shown.total = total * bytes_per_unit
            shown.refresh()
        shown.update(done * bytes_per_unit - shown.n)  # update(), not n =: tqdm then computes the rate

    try:
        yield update
    finally:
        if shown is not None:
            shown.close()


def counted(chunks: Iterable[T], total_bytes: int, progress: Progress | None) -> Iterator[T]:
    """``chunks`` (arrays or bytes) unchanged, reporting the bytes passed on after each one."""
    done = 0
    if progress is not None:
        progress(0, total_bytes)
    for chunk in chunks:
        yield chunk
        done += getattr(chunk, "nbytes", None) or len(chunk)  # type: ignore[arg-type]
        if progress is not None:
            progress(min(done, total_bytes), total_bytes)
