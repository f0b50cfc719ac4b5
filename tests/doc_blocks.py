"""Run a document's fenced examples as a reader would: blocks in order, the ``sh`` blocks as one
terminal (``export`` lines carry over), the ``python`` blocks with this interpreter, and this
environment's scripts (``kvstore``) on PATH."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path


def fenced_blocks(doc: Path, languages: tuple[str, ...]) -> list[tuple[str, str, str]]:
    """(prose before the block, language, code) of the blocks in ``languages``, in document order."""
    fence = re.compile(rf"```({'|'.join(map(re.escape, languages))})\n(.*?)```", re.DOTALL)
    text = doc.read_text()
    out, last = [], 0
    for match in fence.finditer(text):
        out.append((text[last : match.start()], match.group(1), match.group(2)))
        last = match.end()
    return out


class Terminal:
    """One reader's terminal in ``cwd``: :meth:`run` runs a block and keeps its exports."""

    def __init__(self, cwd: Path):
        self.cwd = cwd
        self.exports: list[str] = []
        self.env = {**os.environ, "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]}

    def run(self, language: str, code: str, timeout: float) -> subprocess.CompletedProcess:
        if language == "sh":
            command = ["bash", "-euo", "pipefail", "-c", "\n".join(self.exports + [code])]
            self.exports += [line for line in code.splitlines() if line.startswith("export ")]
        else:
            command = [sys.executable, "-c", code]
        return subprocess.run(command, cwd=self.cwd, env=self.env, capture_output=True, text=True, timeout=timeout)
