"""docs/API.md's curl and httpx examples run as written against a real server, restarts included,
in a new terminal (nothing of kvstore on PATH until the document activates it) and the folder the
document says to work in."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from doc_blocks import Terminal, fenced_blocks

DOC = Path(__file__).resolve().parents[2] / "docs" / "API.md"


@pytest.mark.skipif(shutil.which("curl") is None, reason="the examples use curl")
def test_the_documented_conversation_runs_as_written(make_server, tmp_path):
    examples = fenced_blocks(DOC, ("sh", "python"))
    start = next(code for _, _, code in examples if "KVSTORE_API_KEYS=" in code and "kvstore serve" in code)
    env_keys = re.search(r'KVSTORE_API_KEYS="([^"]+)"', start).group(1)
    assert "--data ./data" in start
    terminal = Terminal(tmp_path / "home")
    server = None
    outputs = []
    for prose, language, code in examples:
        if "kvstore serve" in code:
            continue  # the test runs the server itself
        if server is None and "127.0.0.1:8000" in code:
            # started where the document says: its ./data is in the walkthrough's own folder
            data = terminal.cwd / "data"
            assert data.parent.is_relative_to(terminal.home), data
            server = make_server(data=data, env_keys=env_keys)
        paragraph = prose.strip().split("\n\n")[-1].lower()
        if server is not None and ("restart" in paragraph or "start it again" in paragraph):
            server.kill()  # the docs say even kill -9 is fine
            server = make_server(data=data, env_keys=env_keys)
        if server is not None:
            code = code.replace("http://127.0.0.1:8000", server.url)
        done = terminal.run(language, code, timeout=120)
        assert done.returncode == 0, f"{code}\n{done.stdout}\n{done.stderr}"
        outputs.append(done.stdout)
    joined = "\n".join(outputs)
    assert "resumed exactly" in joined
    assert re.search(r"x-kv-reused-tokens: 19", joined, re.IGNORECASE)
    assert outputs[-1].startswith("20 [")
