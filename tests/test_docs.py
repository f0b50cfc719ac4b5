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
    resumed = re.findall(r"prefilled (\d+), reused (\d+)", "\n".join(outputs))
    assert len(resumed) == 2 and resumed[0][1] == "0" and int(resumed[1][1]) > 0, resumed
