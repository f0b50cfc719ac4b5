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
    assert (
        done.stderr.strip().splitlines()[-1]
        == "kvstore: error: not a .coli_kv file: magic b'COLIKV9\\x00' (expected COLIKV1/2/3)"
    )


def test_inspect_json_reports_torn_tail(vectors, capsys):
    code, out, _ = run(capsys, "inspect", str(vectors / "glm.v2.torn.coli_kv"), "--json")
    assert code == 0
    report = json.loads(out)
    g, n = GEOMETRIES["glm"]
    assert report["version"] == 2 and report["magic"] == "COLIKV2"
    assert report["geometry"]["kv_lora"] == 512 and report["geometry"]["nic"] == 1
    assert report["nrec"] == n - 2 and report["records_safe"] == n - 2
    assert report["torn_tail_bytes"] == report["record_bytes"] // 2
    assert not report["clean"] and report["problems"]


def test_inspect_counts_damage(tmp_path, vectors, capsys):
    path = tmp_path / "d.coli_kv"
    blob = bytearray((vectors / "small.v2.coli_kv").read_bytes())
    blob[40 + 4] = 0x7F  # the first Lc code of record 0, layer 0
    struct.pack_into("<f", blob, 40 + 4 + 64, float("inf"))  # its scale
    path.write_bytes(bytes(blob))
    code, out, _ = run(capsys, "inspect", str(path), "--json")
    report = json.loads(out)
    assert report["nan_codes"] == 1 and report["bad_scales"] == 1


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
    assert code == 2 and "use one of" in err


@pytest.mark.parametrize(
    "args,variant",
    [(["--tier", "fp8"], "v2"), (["--tier", "int4"], "v3c1b4"), (["--tier", "f32"], "v1")],
)
def test_migrate_from_v1_reproduces_the_reference_files(tmp_path, vectors, capsys, args, variant):
    src = tmp_path / "src.coli_kv"
    shutil.copy(vectors / "small.v1.coli_kv", src)
    before = src.read_bytes()
    dst = tmp_path / "dst.coli_kv"
    code, out, err = run(capsys, "migrate", str(src), str(dst), *args, "--json")
    assert code == 0, err
    report = json.loads(out)
    assert report["records"] == 7 and report["lossy"] == (variant != "v1")
    assert src.read_bytes() == before
    assert dst.read_bytes() == (vectors / f"small.{variant}.coli_kv").read_bytes()


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
