"""Every walkthrough in README.md and docs/*.md runs as a new reader runs it (issue 19): in a new
terminal that has nothing of kvstore until the document says how to get it, in a folder of its own.

This module checks that each document with runnable ``sh``/``python`` blocks has a test that runs
them (``tests/doc_blocks.py``: a block not meant to run says why in a ``<!-- not run: ... -->``
line), that the walkthroughs do not share a folder (and so a data folder, and session ids), and
runs README.md's blocks itself."""

from __future__ import annotations

import re
import shutil

import pytest

from doc_blocks import NOT_RUN, ROOT, Terminal, blocks, fenced_blocks

#: A command that runs the engine (the ``engine`` extra): a walkthrough installs the extra before it.
ENGINE_COMMAND = re.compile(
    r"\bkvstore (new-model|generate|chat|hf-chat)\b|\bkvstore serve\b.*--model\b|kvstore\.engine\b"
)
#: The line that adds the engine extra to the activated virtualenv.
ENGINE_INSTALL = re.compile(r"^pip install (-q )?'kvstore\[engine\]'", re.MULTILINE)

#: The document -> the test that runs every runnable block of it.
WALKTHROUGHS = {
    "README.md": "tests/test_docs.py",
    "docs/API.md": "tests/api/test_docs_examples.py",
    "docs/ENGINE.md": "tests/service/test_engine_docs.py",
    "docs/HF.md": "tests/hf/test_docs.py",
}
LANGUAGES = ("sh", "python")


def _documents() -> list[str]:
    return ["README.md", *sorted(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md"))]


def test_every_document_with_runnable_examples_has_a_test_that_runs_them():
    uncovered = []
    for name in _documents():
        if not fenced_blocks(ROOT / name, LANGUAGES):
            continue  # prose, tables, outputs and synopses only
        test = WALKTHROUGHS.get(name)
        if test is None:
            uncovered.append(f"{name}: runnable blocks and no walkthrough test (or mark them '{NOT_RUN} why -->')")
        elif name.split("/")[-1] not in (ROOT / test).read_text():
            uncovered.append(f"{name}: {test} does not read it")
    assert uncovered == []
    assert len(WALKTHROUGHS) == 4 and all((ROOT / name).is_file() for name in WALKTHROUGHS)


def test_a_block_not_meant_to_run_says_so_on_the_line_before_it(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text(
        "Run this:\n\n```sh\necho one\n```\n\n"
        "<!-- not run: a synopsis -->\n```sh\nkvstore inspect PATH [--json]\n```\n\n"
        "```python\nprint(2)\n```\n\n```text\nan output\n```\n"
    )
    found = blocks(doc, ("sh", "python"))
    assert [(block.language, block.code, block.runs) for block in found] == [
        ("sh", "echo one\n", True),
        ("sh", "kvstore inspect PATH [--json]\n", False),
        ("python", "print(2)\n", True),
    ]
    assert [code for _, _, code in fenced_blocks(doc, ("sh", "python"))] == ["echo one\n", "print(2)\n"]


def engine_before_use(doc) -> list[str]:
    """Where a runnable block of ``doc`` uses the engine before any block installed it (empty: none)."""
    installed = False
    for _, _, code in fenced_blocks(doc, LANGUAGES):
        install, used = ENGINE_INSTALL.search(code), ENGINE_COMMAND.search(code)
        if used and not installed and (install is None or install.start() > used.start()):
            return [f"{doc.name}: {used.group(0)!r} runs before the engine extra is installed"]
        installed = installed or install is not None
    return []


def server_on_port_8000_without_a_word_on_make_run(doc) -> list[str]:
    """A runnable ``kvstore serve`` on the default port whose prose does not say that ``make run``
    holds that port (stop it, or ``--port``)."""
    found = []
    for prose, _, code in fenced_blocks(doc, LANGUAGES):
        if "kvstore serve" in code and "--port" not in code:
            paragraph = prose.strip().split("\n\n")[-1]
            if "make run" not in paragraph or "--port" not in paragraph:
                found.append(
                    f"{doc.name}: {code.strip().splitlines()[0]!r} takes port 8000 and says nothing of make run"
                )
    return found


def test_each_walkthrough_installs_the_engine_before_it_uses_it():
    problems = [p for name in WALKTHROUGHS for p in engine_before_use(ROOT / name)]
    assert problems == []
    # and each of them uses it: the install line is there for a reason
    assert all(
        ENGINE_COMMAND.search((ROOT / name).read_text()) for name in ("README.md", "docs/ENGINE.md", "docs/HF.md")
    )


def test_the_engine_check_catches_a_walkthrough_that_skips_the_install(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text("```sh\n. .venv/bin/activate\n```\n\n```sh\nkvstore new-model models/tiny\n```\n")
    assert engine_before_use(doc) == ["doc.md: 'kvstore new-model' runs before the engine extra is installed"]
    doc.write_text("```sh\n. .venv/bin/activate\npip install -q 'kvstore[engine]'\nkvstore new-model m\n```\n")
    assert engine_before_use(doc) == []
    doc.write_text("```sh\nkvstore new-model m\npip install 'kvstore[engine]'\n```\n")  # too late
    assert engine_before_use(doc) == ["doc.md: 'kvstore new-model' runs before the engine extra is installed"]


def test_each_server_a_walkthrough_starts_says_how_to_share_port_8000_with_make_run(tmp_path):
    assert [p for name in WALKTHROUGHS for p in server_on_port_8000_without_a_word_on_make_run(ROOT / name)] == []
    doc = tmp_path / "doc.md"
    doc.write_text("Start the server:\n\n```sh\nkvstore serve --data ./data\n```\n")
    assert server_on_port_8000_without_a_word_on_make_run(doc) == [
        "doc.md: 'kvstore serve --data ./data' takes port 8000 and says nothing of make run"
    ]


def test_each_walkthrough_activates_kvstore_and_works_in_a_folder_of_its_own():
    folders = {}
    for name in WALKTHROUGHS:
        first = next(code for _, language, code in fenced_blocks(ROOT / name, LANGUAGES) if language == "sh")
        assert ". .venv/bin/activate" in first, f"{name} does not start by activating kvstore's virtualenv"
        folder = re.search(r"^cd (~/\S+)$", first, re.MULTILINE)
        assert folder is not None, f"{name} does not move to a folder of its own"
        folders[name] = folder.group(1)
    assert len(set(folders.values())) == len(folders), folders  # no two share a data folder


def test_a_new_terminal_has_no_kvstore_until_it_activates_the_virtualenv(tmp_path):
    terminal = Terminal(tmp_path / "home")
    assert terminal.run("sh", "command -v kvstore", timeout=30).returncode != 0
    # from the home folder: in the checkout, its kvstore/ folder would be imported as a package
    missing = terminal.run("sh", "(cd ~ && python3 -c 'import kvstore')", timeout=60)
    assert missing.returncode != 0 and "No module named 'kvstore'" in missing.stderr, missing.stderr
    assert terminal.run("sh", ". .venv/bin/activate\ncd ~\n", timeout=30).returncode == 0
    version = terminal.run("sh", "kvstore --version", timeout=60)
    assert version.returncode == 0 and version.stdout.startswith("kvstore "), version.stderr
    imported = terminal.run("python", "import kvstore, os; print(os.getcwd())", timeout=60)
    assert imported.returncode == 0 and imported.stdout.strip() == str(tmp_path / "home"), imported.stderr


@pytest.mark.skipif(shutil.which("bash") is None, reason="the examples are bash")
def test_the_readme_runs_as_written(tmp_path):
    terminal = Terminal(tmp_path / "home")
    terminal.env["OMP_NUM_THREADS"] = "1"
    outputs = []
    for _, language, code in fenced_blocks(ROOT / "README.md", LANGUAGES):
        done = terminal.run(language, code, timeout=300)
        assert done.returncode == 0, f"{code}\n{done.stdout}\n{done.stderr[-3000:]}"
        outputs.append(done.stdout + done.stderr)
    folder = terminal.cwd
    assert folder.is_relative_to(terminal.home)  # the examples wrote nothing into the checkout
    assert (folder / "models" / "tiny" / "config.json").is_file() and (folder / "chat.coli_kv").is_file()
    # the second `generate` resumed the journal the first wrote: only the new turn was prefilled
    resumed = re.findall(r"^\[\d+ tokens, \w+; prefilled (\d+), reused (\d+); tier fp8\]$", "\n".join(outputs), re.M)
    assert len(resumed) == 2 and resumed[0][1] == "0" and int(resumed[1][1]) > 0, resumed
    # `kvstore chat` made the store in ./data (no server), and `sessions list` shows its session
    assert (folder / "data" / "index").is_dir()
    assert re.search(r"^hello  owner=default  model=tiny@local  fp8 ", "\n".join(outputs), re.M), outputs
