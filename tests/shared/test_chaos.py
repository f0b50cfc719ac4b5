"""The chaos run of ``bench/scale_chaos.py`` for real, at a small round count: three ``kvstore serve``
replica processes over one PostgreSQL cluster and one S3 server behind a fault proxy, a fault in
every round (SIGKILL of a replica, PostgreSQL stopped, S3 errors, dropped connections, cut bodies,
requests left unanswered past the client's timeout), every read checked against the ledger of
acknowledged appends as it arrives, every session checked at the end.

``KVSTORE_LONG=1`` runs 300 rounds instead of 30; the ≥ 1,000-round figure is the benchmark's
(RELIABILITY.md).
"""

from __future__ import annotations

import sys
from pathlib import Path

from shared.rows import records
from shared.test_replicas import api_key, append, client, create, replicas, resume  # noqa: F401  (fixtures)

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import scale_chaos  # noqa: E402

from kvstore import config

ROUNDS = 300 if config.LONG.get() else 30


def test_chaos_rounds_lose_tear_and_stale_nothing(pg_cluster, s3_server, aws_env, tmp_path):
    report = scale_chaos.run(ROUNDS, seed=18, folder=tmp_path, cluster=pg_cluster, moto=s3_server)
    print(f"\nchaos run, {ROUNDS} rounds:\n{report.table()}")
    assert report.failures() == {}, "\n".join(report.problems)
    # the run did what it claims: every fault kind, in every S3 flavour, on real traffic
    assert report.rounds == ROUNDS
    assert all(count >= ROUNDS // len(scale_chaos.FAULTS) for count in report.faults.values()), report.faults
    injected = report.s3_requests_failed
    for kinds in (("500", "503"), ("drop", "drop-after"), ("truncate",), ("stall", "stall-after")):
        assert sum(injected.get(kind, 0) for kind in kinds) > 0, (kinds, injected)
    assert report.typed_503 > 0  # PostgreSQL was down under requests
    assert report.appends_acked > ROUNDS and report.acked_rows >= report.appends_acked
    assert report.reads > ROUNDS // 2 and report.metadata_reads > 0 and report.parks > 0
    assert report.orphans_after_gc == 0


def test_a_resume_whose_reads_fail_answers_503_not_a_cut_200(replicas, api_key, fault_proxy):  # noqa: F811
    # found by the chaos run: the answer's 200 and Content-Length went out before the first S3 read,
    # so reads failing past the retries cut the body (no status, no Retry-After)
    server = replicas("r1", endpoint=fault_proxy.endpoint)
    with client(server, api_key) as http:
        create(http, "chat")
        assert append(http, "chat", records(1, 0, 4)).status_code == 200
        fault_proxy.kinds, fault_proxy.rate = ("503",), 1.0  # every S3 request fails from here on
        for form in ("raw", "coli_kv", "arrow"):
            answer = http.get("/sessions/chat/resume", params={"format": form})
            assert answer.status_code == 503 and answer.json()["error"] == "BlobStoreUnavailable", (form, answer.text)
            assert int(answer.headers["Retry-After"]) >= 1
        fault_proxy.rate = 0.0
        assert resume(http, "chat") == records(1, 0, 4)  # served again once S3 answers
