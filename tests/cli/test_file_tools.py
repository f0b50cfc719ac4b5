"""The CLI end to end on real files: run as a subprocess once, through main() for the rest."""

import json
import os
import shutil
import struct
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from golden import GEOMETRIES, read_expect, read_src
from kvstore.cli import main
from kvstore.formats import coli_kv


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_console_script_runs_and_reports_bad_input_with_exit_2(tmp_path):
    exe = shutil.which("kvstore", path=os.path.dirname(sys.executable))
    assert exe, "the kvstore console script is installed with the package"
    bogus = tmp_path / "bogus.coli_kv"
    bogus.write_bytes(b"COLIKV9\0" + bytes(32))
    done = subprocess.run([exe, "inspect", str(bogus)], capture_output=True, text=True)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"kvstore: error: {bogus}: not a .coli_kv file: magic (header bytes 0..7) is b'COLIKV9\\x00', "
        "expected b'COLIKV1\\x00', b'COLIKV2\\x00', b'COLIKV3\\x00', b'COLIKV4\\x00'"
    ]


def test_inspect_json_reports_torn_tail(vectors, capsys):
    code, out, _ = run(capsys, "inspect", str(vectors / "glm.v2.torn.coli_kv"), "--json")
    assert code == 1  # damaged
    report = json.loads(out)
    g, n = GEOMETRIES["glm"]
    assert report["version"] == 2 and report["magic"] == "COLIKV2"
    assert report["geometry"]["kv_lora"] == 512 and report["geometry"]["nic"] == 1
    assert report["nrec"] == n - 2 and report["records_safe"] == n - 2
    assert report["torn_tail_bytes"] == report["record_bytes"] // 2
    assert not report["clean"] and report["damaged"] and report["problems"]
    start = 40 + report["complete_records"] * report["record_bytes"]
    assert report["damage"] == [
        f"bytes {start}..{start + report['torn_tail_bytes'] - 1}: {report['torn_tail_bytes']} bytes of a partial "
        f"{report['record_bytes']}-byte record after the last whole one (torn tail: a write cut mid-record, or a "
        "file cut short)"
    ]


def test_inspect_counts_damage(tmp_path, vectors, capsys):
    path = tmp_path / "d.coli_kv"
    blob = bytearray((vectors / "small.v2.coli_kv").read_bytes())
    blob[40 + 4] = 0x7F  # the first Lc code of record 0, layer 0
    struct.pack_into("<f", blob, 40 + 4 + 64, float("inf"))  # its scale
    path.write_bytes(bytes(blob))
    code, out, _ = run(capsys, "inspect", str(path), "--json")
    report = json.loads(out)
    assert code == 1 and report["nan_codes"] == 1 and report["bad_scales"] == 1
    assert report["damage"] == [
        "record 0 (first at byte 40): rows with an fp8 scale out of range (read as zeros): 1",
        "record 0 (first at byte 40): fp8 NaN codes 0x7F/0xFF (read as 0): 1",
    ]


@pytest.mark.parametrize("suffix", [".npz", ".arrow", ".parquet"])
def test_export_formats(tmp_path, vectors, capsys, suffix):
    out = tmp_path / f"glm{suffix}"
    code, _, _ = run(capsys, "export", str(vectors / "glm.v2.coli_kv"), str(out))
    assert code == 0
    tokens, _, _, I = read_src(vectors, "glm")
    L, R = read_expect(vectors, "glm", "v2")
    g, n = GEOMETRIES["glm"]
    if suffix == ".npz":
        with np.load(out) as z:
            assert sorted(z.files) == ["I", "L", "R", "tokens"]
            assert (z["tokens"] == tokens).all() and z["L"].tobytes() == L.tobytes()
            assert z["R"].tobytes() == R.tobytes() and z["I"].tobytes() == I.tobytes()
        return
    table = pa.ipc.open_file(out).read_all() if suffix == ".arrow" else pq.read_table(out)
    assert table.num_rows == n * g.n_layers
    assert table.column_names == ["position", "token", "layer", "L", "R", "I"]
    row = 3 * g.n_layers + 1  # position 3, layer 1
    assert table["position"][row].as_py() == 3 and table["layer"][row].as_py() == 1
    assert table["token"][row].as_py() == tokens[3]
    assert np.array_equal(np.array(table["L"][row].as_py(), np.float32), L[1, 3])
    assert table["I"][row].as_py() is None  # only layer row 0 carries the single indexer row
    assert np.array_equal(np.array(table["I"][3 * g.n_layers].as_py(), np.float32), I[0, 3])
    meta = json.loads(table.schema.metadata[b"coli_kv"])
    assert meta["version"] == 2 and meta["n_records"] == n


def test_export_rejects_unknown_suffix(tmp_path, vectors, capsys):
    code, _, err = run(capsys, "export", str(vectors / "glm.v2.coli_kv"), str(tmp_path / "x.csv"))
    assert code == 2 and err.splitlines() == [
        f"kvstore: error: {tmp_path / 'x.csv'}: cannot export to a .csv file; expected one of .npz, .arrow, .parquet"
    ]


@pytest.mark.parametrize(
    "args,variant",
    [(["--tier", "fp8"], "v2"), (["--tier", "int4"], "v3c1b4"), (["--tier", "f32"], "v1")],
)
def test_migrate_from_v1_reproduces_the_reference_files(tmp_path, vectors, capsys, args, variant):
    src = tmp_path / "src.coli_kv"
    shutil.copy(vectors / "small.v1.coli_kv", src)
    before = src.read_bytes()
    dst = tmp_path / "dst.coli_kv"
    # the reference source holds a NaN on purpose (tests/vectors/README.md): damage, so refused
    # unless allowed; the encoders zero it as docs/FORMAT.md says
    code, out, err = run(capsys, "migrate", str(src), str(dst), *args, "--json")
    assert code == 1 and "non-finite values (NaN/inf): 1" in err and not dst.exists()
    code, out, err = run(capsys, "migrate", str(src), str(dst), *args, "--json", "--allow-damaged")
    assert code == 0, err
    assert err.count("kvstore: warning: ") == 1 and "0 committed records dropped" in err
    report = json.loads(out)
    assert report["records"] == 7 and report["lossy"] == (variant != "v1")
    assert src.read_bytes() == before
    reference = vectors / f"small.{variant}.coli_kv"
    if variant != "v1":
        assert dst.read_bytes() == reference.read_bytes()  # the encoders zero the NaN themselves
    else:  # a same-tier copy of a damaged file is sanitized as repair would: the NaN reads 0
        got, want = coli_kv.load(dst).dequantize(), coli_kv.load(reference).dequantize()
        assert all(np.array_equal(g, np.nan_to_num(w, nan=0.0)) for g, w in zip(got[:2], want[:2]))
        assert not coli_kv.load(dst).problems.damaged


def test_migrate_v3_back_to_v1_stores_the_dequantized_rows(tmp_path, vectors, capsys):
    dst = tmp_path / "back.coli_kv"
    assert run(capsys, "migrate", str(vectors / "glm.v3c1b4.coli_kv"), str(dst), "--tier", "f32")[0] == 0
    L, R = read_expect(vectors, "glm", "v3c1b4")
    got = coli_kv.load(dst).dequantize()
    assert got[0].tobytes() == L.tobytes() and got[1].tobytes() == R.tobytes()


def test_migrate_never_overwrites(tmp_path, vectors, capsys):
    src = tmp_path / "src.coli_kv"
    shutil.copy(vectors / "small.v1.coli_kv", src)
    code, _, err = run(capsys, "migrate", str(src), str(src), "--tier", "fp8")
    assert code == 2 and "never overwrites its source" in err
    link = tmp_path / "link.coli_kv"
    link.symlink_to(src)
    code, _, err = run(capsys, "migrate", str(src), str(link), "--tier", "fp8", "--force")
    assert code == 2 and "never overwrites its source" in err
    other = tmp_path / "other.coli_kv"
    other.write_bytes(b"keep me")
    code, _, err = run(capsys, "migrate", str(src), str(other), "--tier", "fp8")
    assert code == 2 and "--force" in err and other.read_bytes() == b"keep me"
    code, _, err = run(capsys, "migrate", str(src), str(other), "--to", "v2", "--bits", "4")
    assert code == 2 and "only apply to v3" in err and other.read_bytes() == b"keep me"


def test_repair_clamps_drops_sanitizes_and_keeps_a_backup(tmp_path, vectors, capsys):
    path = tmp_path / "r.coli_kv"
    blob = bytearray((vectors / "small.v2.torn.coli_kv").read_bytes())
    struct.pack_into("<i", blob, 32, 9)  # overclaim on top of the torn tail
    blob[40 + 4 + 3] = 0xFF  # a NaN code in record 0
    original = bytes(blob)
    path.write_bytes(original)
    code, out, _ = run(capsys, "repair", str(path), "--dry-run", "--json")
    report = json.loads(out)
    assert code == 0 and report["dry_run"] and len(report["actions"]) == 3
    assert path.read_bytes() == original
    code, out, _ = run(capsys, "repair", str(path), "--json")
    report = json.loads(out)
    assert report["changed"] and (tmp_path / "r.coli_kv.bak").read_bytes() == original
    repaired = coli_kv.load(path)
    assert repaired.header.nrec == repaired.n == 5
    assert os.path.getsize(path) == 40 + 5 * repaired.header.rec_bytes
    assert repaired.problems.messages() == []
    torn = coli_kv.parse(original)
    L_fixed = repaired.dequantize()[0]
    assert np.array_equal(L_fixed, torn.dequantize()[0])  # sanitize-on-load already read 0 there
    code, out, _ = run(capsys, "repair", str(path))
    assert "clean, nothing to repair" in out


def test_repair_refuses_a_non_coli_kv_file(tmp_path, capsys):
    path = tmp_path / "x.coli_kv"
    path.write_bytes(b"short")
    code, _, err = run(capsys, "repair", str(path))
    assert code == 2 and "shorter than the 40-byte" in err
    assert path.read_bytes() == b"short"


# ---------------------------------------------------------------------------- issue 15: damaged files
def _records_of(blob: bytearray) -> np.ndarray:
    """The records of a file image as a writable structured array over ``blob`` (damage goes in place)."""
    header = coli_kv.parse_header(bytes(blob[:40]))
    dtype = coli_kv.record_dtype(header.geometry, header.tier)
    return np.frombuffer(blob, dtype=dtype, count=(len(blob) - 40) // dtype.itemsize, offset=40)


def _bad_scales(vectors):
    blob = bytearray((vectors / "small.v2.coli_kv").read_bytes())
    scales = _records_of(blob)["layers"]["Ls"]
    scales[2, 0] = np.inf
    scales[5, 1] = -1.0
    return blob


def _nan_code(vectors):
    blob = bytearray((vectors / "small.v2.coli_kv").read_bytes())
    _records_of(blob)["layers"]["Rc"][3, 2, 5] = 0xFF
    return blob


def _bad_radius(vectors):
    blob = bytearray((vectors / "small.v3c1b4.coli_kv").read_bytes())
    _records_of(blob)["layers"]["Ls"][1, 0] = -2.0
    return blob


def _overclaim(vectors):
    blob = bytearray((vectors / "small.v2.coli_kv").read_bytes())
    struct.pack_into("<i", blob, 32, 10)  # 7 records on disk
    return blob


#: damage -> (file image, the damage line, committed records a reader does not get)
DAMAGE = {
    "torn_tail": (
        lambda vectors: bytearray((vectors / "small.v2.torn.coli_kv").read_bytes()),
        "bytes 1380..1513: 134 bytes of a partial 268-byte record after the last whole one (torn tail: a write "
        "cut mid-record, or a file cut short)",
        0,
    ),
    "overclaim": (
        _overclaim,
        "records 7..9: the header claims nrec 10 but the file holds 7 whole records (3 committed records are "
        "missing: the file was cut short)",
        3,
    ),
    "bad_scales": (
        _bad_scales,
        "records 2, 5 (first at byte 576): rows with an fp8 scale out of range (read as zeros): 2",
        0,
    ),
    "nan_code": (_nan_code, "record 3 (first at byte 844): fp8 NaN codes 0x7F/0xFF (read as 0): 1", 0),
    "bad_radius": (
        _bad_radius,
        "record 1 (first at byte 188): rows with a TQ radius out of range (read as zeros): 1",
        0,
    ),
    "nan_value": (
        lambda vectors: bytearray((vectors / "small.v1.coli_kv").read_bytes()),
        "record 4 (first at byte 3896): non-finite values (NaN/inf): 1",
        0,
    ),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_inspect_exits_1_on_damage_and_says_what_and_where(tmp_path, vectors, capsys, damage):
    make, line, _ = DAMAGE[damage]
    path = tmp_path / "d.coli_kv"
    path.write_bytes(bytes(make(vectors)))
    code, out, err = run(capsys, "inspect", str(path), "--json")
    report = json.loads(out)
    assert code == 1 and err == "" and report["damaged"] and not report["clean"]
    assert report["damage"] == [line]
    code, out, _ = run(capsys, "inspect", str(path))
    assert code == 1 and f"damaged: {line}" in out.splitlines()
    assert out.splitlines()[-1].startswith(f"{path}: damaged; `kvstore repair {path}`")


def test_inspect_exits_0_on_a_clean_file_and_2_on_one_it_cannot_read(tmp_path, vectors, capsys):
    code, out, _ = run(capsys, "inspect", str(vectors / "small.v2.coli_kv"))
    assert code == 0 and out.splitlines()[-1] == f"{vectors / 'small.v2.coli_kv'}: clean"
    bogus = tmp_path / "bogus.coli_kv"
    bogus.write_bytes(b"COLIKV2\0")
    assert run(capsys, "inspect", str(bogus))[0] == 2


def test_whole_records_past_the_commit_point_are_a_note_not_damage(tmp_path, vectors, capsys):
    # What an append killed after its data fsync (or a truncate before its cut) leaves: every
    # committed record whole, two whole records past nrec. Reported, exit 0; the tools go on.
    path = tmp_path / "leftover.coli_kv"
    blob = bytearray((vectors / "small.v2.coli_kv").read_bytes())
    struct.pack_into("<i", blob, 32, 5)
    path.write_bytes(bytes(blob))
    code, out, _ = run(capsys, "inspect", str(path), "--json")
    report = json.loads(out)
    assert code == 0 and report["clean"] and not report["damaged"] and report["uncommitted_records"] == 2
    assert report["notes"] == [
        "records 5..6 (bytes 1380..1915): 2 whole records past the commit point (nrec 5) are not loaded — a crash "
        "leftover (an append killed before its commit, or a truncate before it cut them); the next append or "
        "`kvstore repair` removes them"
    ]
    code, _, err = run(capsys, "migrate", str(path), str(tmp_path / "out.coli_kv"), "--tier", "f32")
    assert code == 0 and "warning" not in err and coli_kv.load(tmp_path / "out.coli_kv").n == 5


@pytest.mark.parametrize("damage", DAMAGE)
@pytest.mark.parametrize("command", ["export", "migrate"])
def test_export_and_migrate_refuse_a_damaged_file_unless_allowed(tmp_path, vectors, capsys, damage, command):
    make, line, dropped = DAMAGE[damage]
    path = tmp_path / "d.coli_kv"
    original = bytes(make(vectors))
    path.write_bytes(original)
    out = tmp_path / ("out.npz" if command == "export" else "out.coli_kv")
    argv = [command, str(path), str(out)] + (["--tier", "int4"] if command == "migrate" else [])
    code, _, err = run(capsys, *argv)
    assert code == 1 and not out.exists() and path.read_bytes() == original
    assert err.splitlines() == [
        f"kvstore: error: {path}: damaged, {command} refused: {line}. Run `kvstore repair {path}` (keeps a .bak), "
        f"or pass --allow-damaged to go on with the {coli_kv.parse(original).n} whole records"
    ]
    code, stdout, err = run(capsys, *argv, "--allow-damaged", "--json")
    kept = coli_kv.parse(original).n
    assert code == 0 and path.read_bytes() == original, err
    assert err.splitlines() == [
        f"kvstore: warning: {path} is damaged ({line}); --allow-damaged: {command} goes on with {kept} records, "
        f"{dropped} committed records dropped"
    ]
    assert json.loads(stdout)["records_dropped"] == dropped
    if command == "migrate":
        assert coli_kv.load(out).n == kept and not coli_kv.load(out).problems.damaged
    else:
        with np.load(out) as z:
            assert z["tokens"].shape == (kept,)
    assert not list(tmp_path.glob("*.bak*")) and not list(tmp_path.glob("*.lock"))  # the source was never written


def test_repair_cleans_every_damage_keeps_every_backup_and_leaves_nothing_when_refused(tmp_path, vectors, capsys):
    path = tmp_path / "d.coli_kv"
    first = bytes(_overclaim(vectors))
    path.write_bytes(first)
    assert run(capsys, "repair", str(path))[0] == 0
    assert run(capsys, "inspect", str(path))[0] == 0
    second = bytes(_bad_scales(vectors))
    path.write_bytes(second)
    code, out, _ = run(capsys, "repair", str(path), "--json")
    assert code == 0 and json.loads(out)["backup"] == f"{path}.bak.1"
    # an older backup is never overwritten
    assert (tmp_path / "d.coli_kv.bak").read_bytes() == first and (tmp_path / "d.coli_kv.bak.1").read_bytes() == second
    v1 = tmp_path / "v1.coli_kv"
    shutil.copy(vectors / "small.v1.coli_kv", v1)
    code, out, _ = run(capsys, "repair", str(v1))
    assert code == 0 and "did: zeroed 1 non-finite f32 values in Rc rows" in out.splitlines()
    assert run(capsys, "inspect", str(v1))[0] == 0  # repaired means clean: the NaN is 0, as fp8 encodes it
    # a file repair cannot read is refused before the writer lock: no sidecar, no backup
    bogus = tmp_path / "bogus.coli_kv"
    bogus.write_bytes(b"x" * 50)
    assert run(capsys, "repair", str(bogus))[0] == 2
    assert run(capsys, "repair", str(tmp_path / "missing.coli_kv"))[0] == 2
    assert sorted(p.name for p in tmp_path.iterdir() if "bogus" in p.name or "missing" in p.name) == ["bogus.coli_kv"]


def test_export_refuses_an_existing_output_unless_forced(tmp_path, vectors, capsys):
    out = tmp_path / "rows.npz"
    out.write_bytes(b"keep me")
    code, _, err = run(capsys, "export", str(vectors / "small.v2.coli_kv"), str(out))
    assert code == 2 and out.read_bytes() == b"keep me"
    assert err.splitlines() == [f"kvstore: error: {out}: exists; pass --force to replace it (nothing was written)"]
    assert run(capsys, "export", str(vectors / "small.v2.coli_kv"), str(out), "--force")[0] == 0
    with np.load(out) as z:
        assert z["tokens"].shape == (7,)
    # the library call refuses too, and so does a file that appears while the rows are encoded
    from kvstore.errors import InvalidRequest
    from kvstore.export import export

    records = coli_kv.load(vectors / "small.v2.coli_kv")
    with pytest.raises(InvalidRequest, match="exists; pass --force"):
        export(records, out)
    late = tmp_path / "late.arrow"

    def another_writer_creates_the_output_while_rows_are_encoded(done, total):
        if done:
            late.write_bytes(b"theirs")

    with pytest.raises(InvalidRequest, match="exists; pass --force"):
        export(records, late, progress=another_writer_creates_the_output_while_rows_are_encoded)
    assert late.read_bytes() == b"theirs" and not list(tmp_path.glob(".late.arrow.tmp*"))


def test_migrate_describes_each_conversion_the_same_way(tmp_path, vectors, capsys):
    from kvstore import tiers
    from kvstore.migrations.formats import conversion

    code, out, err = run(
        capsys, "migrate", str(vectors / "small.v2.coli_kv"), str(tmp_path / "a.coli_kv"), "--tier", "f32"
    )
    assert code == 0 and f"note: {conversion(tiers.FP8, tiers.F32)}" in err.splitlines()
    assert "exact" in err and "lossy" not in err
    code, out, err = run(capsys, "migrate", str(tmp_path / "a.coli_kv"), str(tmp_path / "b.coli_kv"), "--tier", "int4")
    assert code == 0 and "note: f32 -> int4, lossy: the values are re-quantized" in err


def test_generate_refuses_a_damaged_journal_and_keeps_a_backup_when_allowed(model_dir, tmp_path, capsys):
    journal = tmp_path / "talk.coli_kv"
    base = ["generate", str(model_dir), "--journal", str(journal), "--max-new-tokens", "2", "--stop"]
    assert main([*base, "--ids", "5 6 7"]) == 0
    clean = coli_kv.load(journal)
    n, rec = clean.n, clean.header.rec_bytes
    blob = bytearray(journal.read_bytes()) + bytes(rec // 2)  # a torn tail ...
    struct.pack_into("<i", blob, 32, n + 3)  # ... under a count claiming 3 more records
    damaged = bytes(blob)
    journal.write_bytes(damaged)
    capsys.readouterr()

    assert main([*base, "--ids", "8"]) == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"kvstore: error: {journal}: damaged, generate refused: records {n}..")
    assert journal.read_bytes() == damaged and not list(tmp_path.glob("*.bak*"))

    assert main([*base, "--ids", "8", "--allow-damaged"]) == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("kvstore: warning: ")]
    assert len(warnings) == 1 and "3 committed records dropped" in warnings[0]
    assert warnings[0].endswith(f"the journal as it was is kept in {journal}.bak")
    assert (tmp_path / "talk.coli_kv.bak").read_bytes() == damaged
    resumed = coli_kv.load(journal)
    assert not resumed.problems.damaged and resumed.tokens[:n].tolist() == clean.tokens.tolist()
    assert resumed.n == n + 1 + 2  # the new turn after the whole records


# ---------------------------------------------------------------------------- issue 39: what applies
def test_inspect_prints_codec_and_bits_only_for_files_that_have_them(vectors, capsys):
    for name, shown in (("small.v1.coli_kv", False), ("small.v2.coli_kv", False), ("small.v3c1b4.coli_kv", True)):
        code, out, _ = run(capsys, "inspect", str(vectors / name))
        assert code in (0, 1) and "None" not in out, out
        keys = [line.split()[0] for line in out.splitlines() if line.strip()]
        assert ("codec" in keys and "bits" in keys) is shown, out
        report = json.loads(run(capsys, "inspect", str(vectors / name), "--json")[1])
        assert (report["codec"], report["bits"]) == (("int4", 4) if shown else (None, None))


# ---------------------------------------------------------------------------- issue 42: a chunk at a time
@pytest.mark.parametrize("damage", DAMAGE)
def test_judging_a_file_a_chunk_at_a_time_finds_what_a_whole_load_finds(tmp_path, vectors, damage, monkeypatch):
    from kvstore import filetools

    path = tmp_path / "d.coli_kv"
    path.write_bytes(bytes(DAMAGE[damage][0](vectors)))
    loaded = coli_kv.load(path)
    whole = (loaded.problems, filetools.damage_lines(loaded), filetools.leftover_notes(loaded))
    for chunk in (1, 300, 1 << 20):  # chunks of one record, of a few, of the whole file
        monkeypatch.setattr(filetools, "CHUNK_BYTES", chunk)
        with filetools.SourceFile(path) as source:
            scan = source.scan()
        assert (scan.problems, filetools.damage_lines(scan), filetools.leftover_notes(scan)) == whole
        assert (scan.n, scan.complete_records, scan.file_size) == (loaded.n, loaded.complete_records, loaded.file_size)


@pytest.mark.parametrize("name", ["glm.v1.coli_kv", "glm.v2.coli_kv", "glm.v3c0b3.coli_kv", "glm.v3c1b4.coli_kv"])
@pytest.mark.parametrize("suffix", [".npz", ".arrow", ".parquet"])
def test_an_export_in_many_batches_holds_what_one_batch_holds(tmp_path, vectors, monkeypatch, name, suffix):
    from kvstore import export as exporting
    from kvstore.filetools import SourceFile

    source = vectors / name
    loaded = coli_kv.load(source)
    L, R, index = loaded.dequantize()
    monkeypatch.setattr(exporting, "BATCH_BYTES", 1)  # one record per batch
    out = exporting.export(SourceFile(source), tmp_path / f"x{suffix}")
    if suffix == ".npz":
        with np.load(out) as z:
            assert z["tokens"].tobytes() == loaded.tokens.tobytes()
            assert z["L"].tobytes() == L.tobytes() and z["R"].tobytes() == R.tobytes()
            assert z["I"].tobytes() == index.tobytes()
        return
    table = pa.ipc.open_file(out).read_all() if suffix == ".arrow" else pq.read_table(out)
    reference = exporting.to_arrow_table(loaded)
    assert table.column_names == reference.column_names and table.schema.metadata == reference.schema.metadata
    for name in reference.column_names:  # byte for byte (a v1 file's NaN included); Parquet names list items "element"
        got, want = table[name].combine_chunks(), reference[name].combine_chunks()
        if isinstance(want, pa.FixedSizeListArray):
            assert got.type.list_size == want.type.list_size and got.is_null().equals(want.is_null())
            got, want = got.filter(got.is_valid()).flatten(), want.filter(want.is_valid()).flatten()
        assert got.type == want.type and got.to_numpy(zero_copy_only=False).tobytes() == want.to_numpy().tobytes()


# ---------------------------------------------------------------------------- issue 42: symbolic links
def _link(tmp_path, name, target):
    link = tmp_path / name
    link.symlink_to(target)
    return link


def test_repair_through_a_link_repairs_the_file_it_leads_to(tmp_path, vectors, capsys):
    (tmp_path / "real").mkdir()
    real = tmp_path / "real" / "chat.coli_kv"
    real.write_bytes((vectors / "small.v2.torn.coli_kv").read_bytes())
    link = _link(tmp_path, "link.coli_kv", "real/chat.coli_kv")
    code, out, _ = run(capsys, "repair", str(link))
    assert code == 0 and "did: dropped 134 bytes past the last committed record" in out
    assert f"file: {real} (where {link} leads)" in out and f"backup: {real}.bak" in out
    assert link.is_symlink() and os.readlink(link) == "real/chat.coli_kv"  # still the link
    assert run(capsys, "inspect", str(real))[0] == 0  # the real file is clean
    assert (real.parent / "chat.coli_kv.bak").read_bytes() == (vectors / "small.v2.torn.coli_kv").read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.coli_kv", "real"]  # nothing beside the link


def test_migrate_and_export_write_where_a_link_leads_and_agree_on_existing_targets(tmp_path, vectors, capsys):
    (tmp_path / "real").mkdir()
    src = vectors / "small.v2.coli_kv"
    for command, name, extra in (("migrate", "m.coli_kv", ["--tier", "int4"]), ("export", "e.npz", [])):
        link = _link(tmp_path, f"link-{name}", f"real/{name}")  # leads to no file yet
        code, _, err = run(capsys, command, str(src), str(link), *extra)
        assert code == 0, err
        assert link.is_symlink() and (tmp_path / "real" / name).is_file()
        written = (tmp_path / "real" / name).read_bytes()
        # the file it leads to exists now: both refuse without --force, naming the link and the file
        code, _, err = run(capsys, command, str(src), str(link), *extra)
        assert code == 2 and f"{link} (a link to {tmp_path / 'real' / name}): exists; pass --force" in err, err
        assert (tmp_path / "real" / name).read_bytes() == written
        assert run(capsys, command, str(src), str(link), *extra, "--force")[0] == 0
        assert link.is_symlink() and os.readlink(link) == f"real/{name}"
    code, out, _ = run(capsys, "export", str(src), str(tmp_path / "link-e.npz"), "--force", "--json")
    assert json.loads(out)["written"] == str(tmp_path / "real" / "e.npz")
    # a source named through a link is read, never written
    source_link = _link(tmp_path, "src-link.coli_kv", src)
    assert run(capsys, "migrate", str(source_link), str(tmp_path / "out.coli_kv"), "--tier", "f32")[0] == 0
    assert source_link.is_symlink()
    # a loop of links leads nowhere: refused, nothing written
    loop = _link(tmp_path, "loop.npz", "loop.npz")
    code, _, err = run(capsys, "export", str(src), str(loop), "--force")
    assert code == 2 and "a loop" in err
    assert sorted(p.name for p in (tmp_path / "real").iterdir()) == ["e.npz", "m.coli_kv", "m.coli_kv.lock"]


def test_generate_continues_a_journal_named_through_a_link(model_dir, tmp_path, capsys):
    (tmp_path / "real").mkdir()
    link = _link(tmp_path, "talk.coli_kv", "real/chat.coli_kv")  # leads to no file yet
    base = ["generate", str(model_dir), "--journal", str(link), "--max-new-tokens", "2", "--stop"]
    assert main([*base, "--ids", "5 6 7"]) == 0
    first = coli_kv.load(tmp_path / "real" / "chat.coli_kv").n
    assert main([*base, "--ids", "8 9"]) == 0
    capsys.readouterr()
    resumed = coli_kv.load(tmp_path / "real" / "chat.coli_kv")
    assert link.is_symlink() and resumed.n == first + 2 + 2 and not resumed.problems.damaged
    assert sorted(p.name for p in tmp_path.iterdir()) == ["real", "talk.coli_kv"]
