"""Every command that reads a file, given every kind of bad file, answers with one line that names it.

Issue 15, item 16: messages that named nothing (``Is a directory: None``, export errors without the
path, a corrupt header without the field). Each command below that reads a ``.coli_kv`` file is run
on each bad input — missing, a folder, unreadable, empty, a truncated header, a wrong magic, each
header field out of range, records too large, rows of another model — and must exit 2 with exactly
one stderr line ``kvstore: error: <the path as given>: ...`` holding what is wrong (the field, for
a header) and what was expected; nothing is written (no output, no lock sidecar, no backup).
"""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from kvstore.cli import main
from kvstore.formats.coli_kv import MAX_LAYERS, MAX_WIDTH

#: The header's words h0..h7 as docs/FORMAT.md section 1 names them (word i at bytes 8 + 4i).
HEADER_WORDS = ("n_layers", "kv_lora", "qk_rope", "index_hd", "nic", "vocab", "nrec", "tag")


def _word(name: str, value: int):
    index = HEADER_WORDS.index(name)

    def make(blob: bytearray) -> bytearray:
        struct.pack_into("<i", blob, 8 + 4 * index, value)
        return blob

    start = 8 + 4 * index
    return make, [f"{name} (h{index}, header bytes {start}..{start + 3}) is {value}, expected "]


def _huge(blob: bytearray) -> bytearray:
    struct.pack_into("<ii", blob, 8, MAX_LAYERS, MAX_WIDTH)  # every word in range, the record is not
    return blob


def _magic(blob: bytearray) -> bytearray:
    blob[:8] = b"COLIKV9\0"
    return blob


#: name -> (how to make it from the bytes of a good small.v2 file, or a special kind; fragments)
BAD_INPUTS = {
    "missing": ("missing", ["no such file; expected a .coli_kv"]),
    "folder": ("folder", ["is a folder; expected a .coli_kv"]),
    "unreadable": ("unreadable", ["permission denied; expected a .coli_kv"]),
    "empty": (lambda blob: bytearray(), ["file is 0 bytes, shorter than the 40-byte", "expected 40 header bytes"]),
    "truncated_header": (
        lambda blob: blob[:23],
        ["file is 23 bytes, shorter than the 40-byte .coli_kv header (expected 40 header bytes"],
    ),
    "wrong_magic": (_magic, ["not a .coli_kv file: magic (header bytes 0..7) is b'COLIKV9\\x00', expected b'COLIKV1"]),
    "n_layers": _word("n_layers", 0),
    "kv_lora": _word("kv_lora", -5),
    "qk_rope": _word("qk_rope", MAX_WIDTH * 2),
    "index_hd": _word("index_hd", 7),
    "nic": _word("nic", 9),
    "vocab": _word("vocab", 0),
    "nrec": _word("nrec", -1),
    "tag": _word("tag", 99),
    "record_too_large": (_huge, ["give records of", "bytes, expected at most 2147483647"]),
    "another_model": ("another_model", ["file is for another model: ", ": file ", ", expected "]),
}

#: name -> argv builder (tmp, path, model folder); the commands that read a file the user names
COMMANDS = {
    "inspect": lambda tmp, path, model: ["inspect", path],
    "export": lambda tmp, path, model: ["export", path, tmp / "out.npz"],
    "migrate": lambda tmp, path, model: ["migrate", path, tmp / "out.coli_kv", "--tier", "f32"],
    "repair": lambda tmp, path, model: ["repair", path],
    "sessions_create_like": lambda tmp, path, model: [
        *("sessions", "create", "--like", path, "--model-name", "m", "--model-revision", "r"),
        *("--data", tmp / "data"),
    ],
    "sessions_append": lambda tmp, path, model: ["sessions", "append", "s1", path, "--data", tmp / "data"],
    "sessions_lookup": lambda tmp, path, model: [
        *("sessions", "lookup", "--tokens-file", path, "--like-session", "s1", "--data", tmp / "data")
    ],
    "generate_journal": lambda tmp, path, model: ["generate", model, "--ids", "1", "--journal", path],
}

#: bad inputs that are not bad for a command: a missing journal is a new conversation; files with
#: no expected model are fine for the commands that expect none; unreadable is run only where it
#: needs no model folder and no store (a separate process without the right to override permissions)
NOT_AN_ERROR = {("generate_journal", "missing")} | {
    (command, "another_model")
    for command in ("inspect", "export", "migrate", "repair", "sessions_create_like", "sessions_lookup")
}
UNREADABLE_COMMANDS = ("inspect", "export", "migrate", "repair")

CASES = [
    pytest.param(command, bad, id=f"{command}-{bad}")
    for command in COMMANDS
    for bad in BAD_INPUTS
    if (command, bad) not in NOT_AN_ERROR and (bad != "unreadable" or command in UNREADABLE_COMMANDS)
]


def _make_input(tmp: Path, bad: str, vectors: Path) -> Path:
    kind, _ = BAD_INPUTS[bad]
    path = tmp / "in" / "bad.coli_kv"
    path.parent.mkdir()
    if kind == "missing":
        return path
    if kind == "folder":
        path.mkdir()
        return path
    if kind == "another_model":
        shutil.copy(vectors / "glm.v2.coli_kv", path)
        return path
    good = bytearray((vectors / "small.v2.coli_kv").read_bytes())
    path.write_bytes(bytes(good if kind == "unreadable" else kind(good)))
    return path


def _run_unprivileged(argv: list[str]) -> tuple[int, str]:
    """The command in a process that cannot override file permissions (root keeps no DAC capability)."""
    prefix: list[str] = []
    if os.geteuid() == 0:
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            pytest.skip("running as root without setpriv: file permissions are not enforced")
        prefix = [setpriv, "--bounding-set", "-dac_override,-dac_read_search"]
    done = subprocess.run(
        [*prefix, sys.executable, "-m", "kvstore", *argv], capture_output=True, text=True, timeout=120
    )
    return done.returncode, done.stderr


@pytest.fixture
def store_with_s1(tmp_path):
    """A store holding session ``s1`` of small.v2's geometry (fp8), for the commands that need one."""
    data = tmp_path / "data"
    argv = ["sessions", "create", "--id", "s1", "--geometry", "3,64,16,0,0,1000", "--tier", "fp8"]
    assert main([*argv, "--model-name", "m", "--model-revision", "r", "--data", str(data)]) == 0
    return data


@pytest.mark.parametrize("command,bad", CASES)
def test_every_file_reading_command_names_the_file_the_field_and_what_was_expected(
    command, bad, tmp_path, vectors, store_with_s1, capsys, request
):
    model = request.getfixturevalue("model_dir") if command == "generate_journal" else None
    path = _make_input(tmp_path, bad, vectors)
    argv = [str(arg) for arg in COMMANDS[command](tmp_path, path, model)]
    capsys.readouterr()
    files_before = sorted(p.name for p in path.parent.iterdir())
    if bad == "unreadable":
        path.chmod(0)
        try:
            code, err = _run_unprivileged(argv)
        finally:
            path.chmod(0o600)
    else:
        code = main(argv)
        err = capsys.readouterr().err
    lines = err.splitlines()
    assert code == 2 and len(lines) == 1, err
    line = lines[0]
    assert line.startswith(f"kvstore: error: {path}: "), line
    for fragment in BAD_INPUTS[bad][1]:
        assert fragment in line, (fragment, line)
    # refused before anything was written: no output, no lock sidecar, no backup, no session
    assert sorted(p.name for p in path.parent.iterdir()) == files_before
    assert not (tmp_path / "out.npz").exists() and not (tmp_path / "out.coli_kv").exists()


def test_a_missing_parent_folder_and_a_folder_as_output_are_named(tmp_path, vectors, capsys):
    source = str(vectors / "small.v2.coli_kv")
    cases = [
        (["export", source, tmp_path / "nowhere" / "rows.npz"], "its folder", "does not exist; expected"),
        (["migrate", source, tmp_path / "nowhere" / "x.coli_kv", "--tier", "f32"], "its folder", "does not exist"),
        (["migrate", source, tmp_path, "--tier", "f32"], "is a folder; expected the path", "to write"),
    ]
    (tmp_path / "a.npz").mkdir()
    for argv, *fragments in cases:
        code = main([str(arg) for arg in argv])
        lines = capsys.readouterr().err.splitlines()
        assert code == 2 and len(lines) == 1 and lines[0].startswith(f"kvstore: error: {argv[2]}: "), lines
        assert all(fragment in lines[0] for fragment in fragments), lines
    code = main(["export", source, str(tmp_path / "a.npz")])
    lines = capsys.readouterr().err.splitlines()
    assert code == 2 and lines == [
        f"kvstore: error: {tmp_path / 'a.npz'}: is a folder; expected the path of the export to write"
    ]


@pytest.mark.parametrize(
    "argv,line",
    [
        (
            ["sessions", "list", "--data", "{file}"],
            "--data {file}: is a file; expected the session store's data folder",
        ),
        (["new-model", "{file}"], "{file}: is a file; expected a new (or existing) folder to write the model into"),
        (
            ["generate", "{file}", "--ids", "1"],
            "{file} is not a model folder (it is a file); expected a folder with config.json",
        ),
        (["serve", "--model", "{missing}"], "{missing} is not a model folder (no such folder); expected a folder"),
        (
            ["sessions", "lookup", "--tokens-file", "{file}", "--geometry", "3,64,16,0,0,1000", "--data", "{data}"],
            "{file}: not whitespace-separated integers; expected token ids separated by spaces or newlines",
        ),
    ],
)
def test_folders_and_model_folders_are_named(tmp_path, capsys, argv, line):
    plain = tmp_path / "plain.txt"
    plain.write_text("not a folder")
    names = {"file": str(plain), "missing": str(tmp_path / "nowhere"), "data": str(tmp_path / "data")}
    code = main([arg.format(**names) for arg in argv])
    lines = capsys.readouterr().err.splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("kvstore: error: " + line.format(**names)), lines


def test_an_output_folder_in_the_way_and_a_file_above_a_folder_are_named(tmp_path, capsys):
    data = tmp_path / "data"
    argv = ["sessions", "create", "--id", "s1", "--geometry", "3,64,16,0,0,1000", "--model-name", "m"]
    assert main([*argv, "--model-revision", "r", "--data", str(data)]) == 0
    (tmp_path / "out.coli_kv").mkdir()
    code = main(["sessions", "resume", "s1", str(tmp_path / "out.coli_kv"), "--data", str(data)])
    lines = capsys.readouterr().err.splitlines()
    assert code == 2 and lines == [
        f"kvstore: error: {tmp_path / 'out.coli_kv'}: is a folder; expected the path of the resumed rows to write"
    ]
    plain = tmp_path / "plain.txt"
    plain.write_text("a file where a folder would go")
    for command, expected in (
        (["new-model", str(plain / "tiny")], f"{plain / 'tiny'}: {plain} is a file; expected a new (or existing)"),
        (["sessions", "list", "--data", str(plain / "d")], f"--data {plain / 'd'}: {plain} is a file; expected"),
    ):
        code = main(command)
        lines = capsys.readouterr().err.splitlines()
        assert code == 2 and len(lines) == 1 and lines[0].startswith(f"kvstore: error: {expected}"), lines


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux /proc: a folder nothing may create in")
def test_an_os_error_no_command_checked_is_still_one_line_naming_the_path(capsys):
    # The last resort of main(): an OSError a command let through is one line starting with its
    # path, never a traceback ("FileExistsError" used to escape) nor "<strerror>: None".
    code = main(["new-model", "/proc/kvstore-no-such-model"])
    lines = capsys.readouterr().err.splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("kvstore: error: /proc/kvstore-no-such-model: ")
