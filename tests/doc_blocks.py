"""Run a document's fenced examples as a new reader would: in a new terminal where nothing of
kvstore is on PATH (kvstore's virtualenv is not active, ``HOME`` is a new empty folder), started
in the repository root, so the document itself must say how to get ``kvstore`` and where to work.

Blocks run in order. The ``sh`` blocks are one terminal: the lines that change the shell
(``. .venv/bin/activate``, ``source``, ``cd``, ``export``) carry over to every later block; the
``python`` blocks run with the ``python`` that terminal finds. A block preceded by a line
``<!-- not run: <why> -->`` is a synopsis (placeholders, a GPU, the whole suite) and is skipped;
every other ``sh`` and ``python`` block of ``docs/*.md`` and ``README.md`` is run by a test
(``tests/test_docs.py`` checks that each such document has one)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: The line that marks the next block as not run, with the reason after the colon.
NOT_RUN = "<!-- not run:"
#: Lines of an ``sh`` block that change the terminal rather than run something in it.
_CARRIED = re.compile(r"^(export |\. |source |cd )")
#: Variables through which a parent process's Python environment would leak into the reader's.
#: ``PYTHONUNBUFFERED`` too: a reader's terminal buffers a piped stdout, which is how an answer and
#: its report on stderr can come out of order.
_LEAKS = (
    "VIRTUAL_ENV",
    "PYTHONPATH",
    "PYTHONHOME",
    "PYTHONSTARTUP",
    "CONDA_PREFIX",
    "PYTEST_ADDOPTS",
    "PYTHONUNBUFFERED",
)


@dataclass(frozen=True)
class Block:
    """One fenced block: the prose since the previous block, its language and code, whether it runs."""

    prose: str
    language: str
    code: str
    runs: bool


def blocks(doc: Path, languages: tuple[str, ...]) -> list[Block]:
    """Every block of ``doc`` in ``languages``, in document order, marked runnable or not."""
    fence = re.compile(rf"^```({'|'.join(map(re.escape, languages))})\n(.*?)^```", re.DOTALL | re.MULTILINE)
    text = doc.read_text()
    out, last = [], 0
    for match in fence.finditer(text):
        prose = text[last : match.start()]
        lines = prose.rstrip().splitlines()
        runs = not (lines and lines[-1].lstrip().startswith(NOT_RUN))
        out.append(Block(prose, match.group(1), match.group(2), runs))
        last = match.end()
    return out


def fenced_blocks(doc: Path, languages: tuple[str, ...]) -> list[tuple[str, str, str]]:
    """(prose before the block, language, code) of the runnable blocks in ``languages``, in order."""
    return [(block.prose, block.language, block.code) for block in blocks(doc, languages) if block.runs]


def fresh_environment(home: Path) -> dict[str, str]:
    """This process's environment as a new login would have it: no virtualenv on PATH, ``HOME`` new."""
    venv_bins = {Path(sys.prefix, "bin").resolve(), Path(sys.executable).parent.resolve()}
    path = [
        entry
        for entry in os.environ.get("PATH", "").split(os.pathsep)
        if entry and Path(entry).resolve() not in venv_bins
    ]
    env = {name: value for name, value in os.environ.items() if name not in _LEAKS}
    env["PATH"] = os.pathsep.join(path or ["/usr/local/bin", "/usr/bin", "/bin"])
    env["HOME"] = str(home)
    return env


class Terminal:
    """One reader's terminal, new: :meth:`run` runs a block and keeps the lines that change the shell.

    ``home`` is the reader's (empty) home folder; the terminal starts in the repository root.
    """

    def __init__(self, home: Path):
        home.mkdir(parents=True, exist_ok=True)
        self.home = home
        self.env = fresh_environment(home)
        self.state: list[str] = []

    def _bash(self, script: str, timeout: float, stdin: str | None = None) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["bash", "-euo", "pipefail", "-c", script],
            cwd=ROOT,
            env=self.env,
            input=stdin,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def run(self, language: str, code: str, timeout: float) -> subprocess.CompletedProcess:
        if language == "sh":
            done = self._bash("\n".join([*self.state, code]), timeout)
            self.state += [line for line in code.splitlines() if _CARRIED.match(line)]
            return done
        # the python the terminal finds, as a reader typing `python` there would get
        return self._bash("\n".join([*self.state, "exec python -"]), timeout, stdin=code)

    @property
    def cwd(self) -> Path:
        """The folder the terminal is in now (where a server started from it must run)."""
        done = self._bash("\n".join([*self.state, "pwd"]), 30)
        if done.returncode != 0:
            raise RuntimeError(f"the terminal's state does not run: {done.stderr}")
        return Path(done.stdout.strip())

    def python_env(self) -> dict[str, str]:
        """The environment a command the terminal starts sees (after its activations and exports)."""
        done = self._bash("\n".join([*self.state, "env -0"]), 30)
        if done.returncode != 0:
            raise RuntimeError(f"the terminal's state does not run: {done.stderr}")
        return dict(item.split("=", 1) for item in done.stdout.split("\0") if "=" in item)
