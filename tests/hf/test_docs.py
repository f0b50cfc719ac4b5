"""docs/HF.md runs as written, every block in order, in a new terminal (nothing of kvstore on PATH
until the page activates it) and the folder the page says to work in: the model, the command line
turns, then the persist / restart / continue scripts, each saved under the name the page gives it
and run in a new process; then the first script once more, as a reader trying it again does."""

from __future__ import annotations

import re
from pathlib import Path

from doc_blocks import Terminal, fenced_blocks

DOC = Path(__file__).resolve().parents[2] / "docs" / "HF.md"


def _script_name(prose: str) -> str | None:
    """The file a python block is saved as: the first ``name.py`` of the line introducing it."""
    lines = prose.strip().splitlines()
    found = re.search(r"`(\w+\.py)`", lines[-1]) if lines and lines[-1].endswith(":") else None
    return found.group(1) if found else None


def test_the_documented_example_resumes_in_a_new_process(tmp_path):
    terminal = Terminal(tmp_path / "home")
    terminal.env["OMP_NUM_THREADS"] = "1"
    ran: dict[str, str] = {}
    chat_log = ""
    for prose, language, code in fenced_blocks(DOC, ("sh", "python")):
        name = _script_name(prose) if language == "python" else None
        if name is not None:
            (terminal.cwd / name).write_text(code)  # the reader saves it; a later block runs it
            continue
        done = terminal.run(language, code, timeout=300)
        assert done.returncode == 0, f"{code}\n{done.stdout}\n{done.stderr[-3000:]}"
        if "kvstore hf-chat" in code:
            chat_log = done.stderr
        command = re.fullmatch(r"python (\w+\.py)\n", code)
        if command:
            ran[command.group(1)] = done.stdout
    assert terminal.cwd.is_relative_to(terminal.home)  # the page's own folder, not the checkout
    assert list(ran) == ["save_turn.py", "resume_turn.py", "continue_turn.py"]  # each saved script is run
    # the command line: the second turn reuses the first (15 bytes of prompt + 32 answered), as documented
    documented = re.search(r"```\n(\[reused 47, prefilled 10[^\n]*\])\n```", DOC.read_text())
    assert documented is not None and documented.group(1) in chat_log, chat_log
    assert "stored 31 tokens" in ran["save_turn.py"]  # 15 bytes of prompt + 16 answered
    assert "reused 31, prefilled 10" in ran["resume_turn.py"]  # only " And then?" ran through the model
    # 31 + 10 + 16 stored; no new turn: the last stored token runs again, not the conversation (issue 21)
    assert "reused 56, prefilled 1" in ran["continue_turn.py"]
    # run again, as a reader trying it twice does: save_turn.py starts the conversation over
    again = terminal.run("sh", "python save_turn.py", timeout=300)
    assert again.returncode == 0 and again.stdout == ran["save_turn.py"], again.stderr[-3000:]
