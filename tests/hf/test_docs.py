"""docs/HF.md's persist / restart / continue examples run as written, each in a new process."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from kvstore.cli import main

DOC = Path(__file__).resolve().parents[2] / "docs" / "HF.md"


def _script(name: str) -> str:
    """The python block that follows the line introducing ``name``."""
    text = DOC.read_text()
    found = re.search(rf"`{re.escape(name)}`[^\n]*:\n\n```python\n(.*?)```", text, re.S)
    assert found is not None, f"docs/HF.md lost the {name} example"
    return found.group(1)


def test_the_documented_example_resumes_in_a_new_process(tmp_path, capsys):
    assert main(["new-model", str(tmp_path / "models" / "tiny")]) == 0  # the documented one command
    capsys.readouterr()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    outputs = []
    for name in ("save_turn.py", "resume_turn.py", "continue_turn.py"):
        (tmp_path / name).write_text(_script(name))
        proc = subprocess.run(
            [sys.executable, name], cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        outputs.append(proc.stdout)
    assert "stored 31 tokens" in outputs[0]  # 15 bytes of prompt + 16 answered
    assert "reused 31, prefilled 10" in outputs[1]  # only " And then?" ran through the model
    # 31 + 10 + 16 stored; no new turn: the last stored token runs again, not the conversation (issue 21)
    assert "reused 56, prefilled 1" in outputs[2]
