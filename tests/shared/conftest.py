"""Fixtures of the shared backend's tests: one PostgreSQL cluster and one moto S3 server per test
process, a fresh database and bucket per test.

Without PostgreSQL's Debian package the tests skip — except in CI (``KVSTORE_CI=1``, set by
``.ci/run``, which installs it), where a missing server fails them.
"""

from __future__ import annotations

import os
import uuid

import pytest

from kvstore import config
from shared.servers import FaultProxy, MotoServer, PostgresCluster, postgres_bin


def _missing(what: str) -> None:
    if config.CI.get():
        pytest.fail(f"{what} is missing; CI must have it (.ci/run installs it)")
    pytest.skip(f"{what} is missing (sudo apt-get install postgresql)")


@pytest.fixture(scope="session")
def pg_cluster():
    bindir = postgres_bin()
    if bindir is None:
        _missing("PostgreSQL (/usr/lib/postgresql/*/bin/initdb)")
    assert bindir is not None
    cluster = PostgresCluster(bindir)
    yield cluster
    cluster.close()


@pytest.fixture(scope="session")
def aws_env():
    """Credentials and region for boto3: a test server accepts any."""
    values = {"AWS_ACCESS_KEY_ID": "kvstore-test", "AWS_SECRET_ACCESS_KEY": "kvstore-test", "AWS_REGION": "us-east-1"}
    saved = {name: os.environ.get(name) for name in [*values, "AWS_ENDPOINT_URL"]}
    os.environ.update(values)
    yield values
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture(scope="session")
def s3_server(aws_env):
    server = MotoServer()
    yield server
    server.close()


@pytest.fixture
def index_url(pg_cluster) -> str:
    return pg_cluster.new_database()


@pytest.fixture
def bucket(s3_server, aws_env) -> str:
    import boto3

    name = f"kv-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=s3_server.endpoint, region_name="us-east-1").create_bucket(Bucket=name)
    return name


@pytest.fixture
def blobs_url(bucket) -> str:
    return f"s3://{bucket}/kv"


@pytest.fixture
def fault_proxy(s3_server):
    proxy = FaultProxy(s3_server.port, seed=18)
    yield proxy
    proxy.close()


@pytest.fixture
def child_env(index_url, blobs_url, s3_server, aws_env) -> dict[str, str]:
    """The environment of a writer process: the servers as an operator names them."""
    return {
        **os.environ,
        **aws_env,
        "AWS_ENDPOINT_URL": s3_server.endpoint,
        "KVSTORE_INDEX_URL": index_url,
        "KVSTORE_BLOBS_URL": blobs_url,
    }


@pytest.fixture(params=["plaintext", "encrypted"])
def at_rest(request, monkeypatch):
    """Runs a suite that builds ``SharedStore`` objects itself (the protocol and fault tests) twice:
    as written, and with every ``SharedStore`` encrypted at rest under the tests' KEK (its keyring
    attached to its own index, as ``SharedSessionStore`` does), so the same faults hit sealed objects.
    Use as ``pytestmark = pytest.mark.usefixtures("at_rest")``."""
    if request.param == "encrypted":
        from crypto.support import KEK
        from kvstore.store.shared.keys import SegmentSealer, attach
        from kvstore.store.shared.store import SharedStore

        plain_init = SharedStore.__init__

        def sealed_init(self, index, blobs, **options):
            plain_init(self, index, blobs, **options)
            keyring = attach(index, KEK)
            assert keyring is not None
            self.encrypt(SegmentSealer(keyring))

        monkeypatch.setattr(SharedStore, "__init__", sealed_init)
    return request.param
