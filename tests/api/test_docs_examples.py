"""docs/API.md's curl and httpx examples run as written against a real server, restarts included."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[2] / "docs" / "API.md"
FENCE = re.compile(r"```(sh|python)\n(.*?)```", re.DOTALL)


def blocks():
    """(prose before the block, language, code) in document order."""
    text = DOC.read_text()
    out, last = [], 0
    for match in FENCE.finditer(text):
        out.append((text[last:match.start()], match.group(1), match.group(2)))
        last = match.end()
    return out


@pytest.mark.skipif(shutil.which("curl") is None, reason="the examples use curl")
def test_the_documented_conversation_runs_as_written(make_server, tmp_path):
    examples = blocks()
    start = next(code for _, _, code in examples if "KVSTORE_API_KEYS=" in code and "kvstore serve" in code)
    env_keys = re.search(r'KVSTORE_API_KEYS="([^"]+)"', start).group(1)
    server = make_server(env_keys=env_keys)
    env = {**os.environ, "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]}
    outputs, exports = [], []  # the sh blocks are one terminal: exports carry over
    for prose, language, code in examples:
        if "kvstore serve" in code:
            continue  # the test runs the server itself
        paragraph = prose.strip().split("\n\n")[-1].lower()
        if "restart" in paragraph or "start it again" in paragraph:
            server.kill()  # the docs say even kill -9 is fine
            server = make_server(env_keys=env_keys)
        code = code.replace("http://127.0.0.1:8000", server.url)
        if language == "sh":
            command = ["bash", "-euo", "pipefail", "-c", "\n".join(exports + [code])]
            exports += [line for line in code.splitlines() if line.startswith("export ")]
        else:
            command = [sys.executable, "-c", code]
        done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, f"{code}\n{done.stdout}\n{done.stderr}"
        outputs.append(done.stdout)
    joined = "\n".join(outputs)
    assert "resumed exactly" in joined
    assert re.search(r"x-kv-reused-tokens: 19", joined, re.IGNORECASE)
    assert outputs[-1].startswith("20 [")
