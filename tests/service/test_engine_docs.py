"""docs/ENGINE.md runs as written: new-model, serve, chat with curl and httpx, stop, start again,
continue with no re-prefill — in fp8 (the documented outputs are checked line for line) and in f32
(the same steps, the same split), in a new terminal (nothing of kvstore on PATH until the document
activates it) and the folder the document says to work in."""

from __future__ import annotations

import re
import shlex
import shutil
from pathlib import Path

import pytest

from doc_blocks import Terminal, fenced_blocks
from service.support import Server

DOC = Path(__file__).resolve().parents[2] / "docs" / "ENGINE.md"


def _split(output: str) -> dict[str, str]:
    return dict(line.split(": ", 1) for line in output.splitlines() if line.lower().startswith("x-kv-"))


@pytest.mark.skipif(shutil.which("curl") is None, reason="the examples use curl")
@pytest.mark.parametrize("tier", ["fp8", "f32"])
def test_the_documented_chat_restart_and_continue_runs_as_written(tmp_path, tier, hash_cache):
    examples = fenced_blocks(DOC, ("sh", "python", "text"))
    serve = next(code for _, _, code in examples if "kvstore serve" in code)
    env_keys = re.search(r'KVSTORE_API_KEYS="([^"]+)"', serve).group(1)
    serve_args = shlex.split(serve.split("kvstore serve", 1)[1])
    assert serve_args[serve_args.index("--tier") + 1] == "fp8"
    serve_args[serve_args.index("--tier") + 1] = tier
    terminal = Terminal(tmp_path / "home")
    server: Server | None = None
    logs, outputs = [], []
    try:
        for index, (prose, language, code) in enumerate(examples):
            if language == "text" or "kvstore serve" in code:
                continue  # outputs are checked below; the test runs the server itself
            paragraph = prose.strip().split("\n\n")[-1].lower()
            if "start it again" in paragraph:
                logs.append(server.stop())
                server = None
            if server is None and "127.0.0.1:8000" in code:
                # started where the document says: its --model and ./data are in the walkthrough's folder
                folder = terminal.cwd
                assert folder.is_relative_to(terminal.home), folder
                server = Server(folder / "data", *serve_args, env={"KVSTORE_API_KEYS": env_keys}, cwd=folder).start()
            if server is not None:
                code = code.replace("http://127.0.0.1:8000", server.url)
            done = terminal.run(language, code, timeout=180)
            assert done.returncode == 0, f"{code}\n{done.stdout}\n{done.stderr}"
            shown = examples[index + 1] if index + 1 < len(examples) and examples[index + 1][1] == "text" else None
            if shown is not None and tier == "fp8":
                printed, documented = done.stdout, shown[2]
                if 'data["text"]' in code:
                    # The first line is the random model's answer: its bytes follow float rounding, which
                    # differs between CPUs (and the doc says so). What the example reports is compared.
                    assert printed.split("\n", 1)[0].strip(), printed
                    printed, documented = printed.split("\n", 1)[1], documented.split("\n", 1)[1]
                assert printed == documented, f"{code}\n--- printed\n{done.stdout}--- documented\n{shown[2]}"
            outputs.append(done.stdout)
        logs.append(server.stop())
        server = None
    finally:
        if server is not None and server.running():  # a failed step: never leave a server behind
            server.kill()

    # outputs: the set-up, new-model, then the three turns
    first, streamed, resumed = outputs[2], outputs[3], outputs[4]
    assert _split(first) == {"x-kv-reused-tokens": "0", "x-kv-prefilled-tokens": "15", "x-kv-source": "new"}
    live = re.search(r"^live: reused (\d+), prefilled 13, (\d+) records stored$", streamed, re.MULTILINE)
    assert live, streamed
    stored = int(live.group(2))
    # after the restart: the journal's rows are reused, only " Still there?" (13 tokens) is prefilled
    assert _split(resumed) == {
        "x-kv-reused-tokens": str(stored),
        "x-kv-prefilled-tokens": "13",
        "x-kv-source": "journal",
    }
    assert f"kvstore_prefilled_tokens_total 13.0\nkvstore_reused_tokens_total {stored}.0\n" in resumed
    assert f"turn session=chat-1 source=journal reused={stored} prefilled=13" in logs[-1]
