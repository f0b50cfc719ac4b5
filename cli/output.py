"""How every command prints: a report as text or as JSON (``--json``) and a stream of JSON lines
(stdout carries only the answer, so it can be piped; progress bars are ``kvstore.cli.progress``).
A streamed answer ends with :func:`end_stream` before its report goes to stderr, so the two never
share a line where they meet (a terminal, ``2>&1``)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def emit(args: argparse.Namespace, payload: Any, text: str) -> None:
    """Print ``payload`` as indented JSON when the command ran with ``--json``, else ``text``."""
    if getattr(args, "json", False):
        print(json.dumps(payload, indent=2))
    else:
        print(text)


def end_stream() -> None:
    """End a streamed answer on stdout: its newline, flushed before anything goes to stderr (stdout is
    buffered when it is not a terminal; unflushed, its last line would land after the report)."""
    sys.stdout.write("\n")
    sys.stdout.flush()


def warn(reason: str) -> None:
    """``kvstore: warning: <reason>`` on stderr, on one line (what a command went on despite)."""
    print(f"kvstore: warning: {' '.join(reason.splitlines())}", file=sys.stderr)


def json_line(payload: Any) -> None:
    """One JSON object on one line, flushed: a record of a stream (a generated turn, a chat turn)."""
    print(json.dumps(payload), flush=True)


def table(report: dict[str, Any]) -> str:
    """A flat report as aligned ``key  value`` lines (lists joined by ``;``, dicts as ``k=v``)."""
    width = max(len(key) for key in report)
    lines = []
    for key, value in report.items():
        if isinstance(value, list):
            value = "; ".join(map(str, value)) if value else "-"
        elif isinstance(value, dict):
            value = ", ".join(f"{k}={v}" for k, v in value.items())
        elif isinstance(value, float):
            value = f"{value:.3f}"
        lines.append(f"{key:<{width}}  {value}")
    return "\n".join(lines)
