"""A tier over TLS: on a Redis that serves TLS alone, with a private CA its URL names
(rediss://...?ssl_ca_certs=), on a cluster whose nodes serve TLS alone
(rediss+cluster://), and through Sentinel's failover where the sentinels, the master
and its replica serve TLS alone (rediss+sentinel://); the TLS settings of our own
schemes read or refused."""

from __future__ import annotations

import shutil
import subprocess
import time

import pytest
import redis

from pipeline.redis_cluster import cluster_url
from pipeline.redis_tls import tls_options
from pipeline.redis_url import sentinel_url
from tests.harness import Tier, free_port
from tests.redis_ha import (
    Certs,
    Cluster,
    Sentinels,
    completion_text,
    serves_through_failover,
    story,
    tier_prefix,
    usage_error,
)

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="no openssl to make "
                                "certificates with")


def test_our_schemes_read_redis_py_s_tls_settings_and_refuse_the_rest():
    query = "ssl_ca_certs=/ca.crt&ssl_cert_reqs=required&ssl_check_hostname=false"
    assert tls_options(query, True, "u") == {"ssl": True, "ssl_ca_certs": "/ca.crt",
                                             "ssl_cert_reqs": "required",
                                             "ssl_check_hostname": False}
    assert tls_options("", False, "u") == {} and tls_options("", True, "u") == {"ssl": True}
    assert cluster_url(f"rediss+cluster://h:7000?{query}").login["ssl_ca_certs"] == "/ca.crt"
    assert cluster_url("redis+cluster://h:7000").login == {"username": None, "password": None}
    found = sentinel_url("rediss+sentinel://h/svc?ssl_certfile=/c.crt&ssl_keyfile=/c.key")
    assert found.ssl and found.master_options["ssl_keyfile"] == "/c.key"
    assert found.sentinel_options(socket_timeout=1)["ssl_certfile"] == "/c.crt"
    plain = sentinel_url("rediss+sentinel://h/svc?sentinel_tls=false&ssl_ca_certs=/ca")
    assert plain.master_options["ssl_ca_certs"] == "/ca"
    assert plain.sentinel_options(socket_timeout=1) == {"socket_timeout": 1}
    for wrong in ("rediss+cluster://h:1?ssl_ca_cert=/x",  # a misspelt name
                  "rediss+cluster://h:1?ssl_cert_reqs=maybe", "redis+cluster://h:1?ssl_ca_certs=/x",
                  "rediss+sentinel://h/svc?ssl_check_hostname=sometimes", "rediss+cluster://h:1?x",
                  "rediss+sentinel://h/svc?sentinel_tls=no"):
        with pytest.raises(ValueError):
            cluster_url(wrong) or sentinel_url(wrong)
    assert "TLS setting" in usage_error("worker", "--role", "api", "--redis-url",
                                        "rediss+cluster://h:1?ssl_ca_cert=/x")


@pytest.fixture
def certs(tmp_path):
    return Certs(tmp_path)


@pytest.fixture
def tls_redis(certs, tmp_path):
    """A redis-server serving TLS alone, with `certs`: its URL."""
    port = free_port()
    proc = subprocess.Popen([shutil.which("redis-server") or "redis-server",
                             *certs.server_args(port), "--save", "", "--dir", str(tmp_path)],
                            stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while True:
        try:
            redis.Redis(port=port, **certs.client_options).ping()
            break
        except redis.ConnectionError:
            assert time.monotonic() < deadline, "the TLS redis-server did not start"
            time.sleep(0.1)
    yield f"rediss://127.0.0.1:{port}/0?ssl_ca_certs={certs.ca}"
    proc.kill()
    proc.wait()


def _serves(url: str, prefix: str, log_dir) -> None:
    tier = Tier(url, prefix, log_dir)
    try:
        base = tier.start_one_of_each()
        assert completion_text(base) and len(story(base, 32)) > 0
    finally:
        tier.stop()


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="no redis-server")
def test_a_tier_serves_over_tls_with_a_private_ca(tls_redis, model_files, tmp_path):
    _serves(tls_redis, tier_prefix(), tmp_path)


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="no redis-server")
def test_a_tier_serves_on_a_cluster_over_tls(certs, model_files, tmp_path):
    with Cluster(tmp_path, replicas=0, certs=certs) as cluster:
        _serves(cluster.url, tier_prefix(tagged=True), tmp_path)


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="no redis-server")
def test_a_tier_serves_through_a_failover_of_sentinel_over_tls(certs, model_files, tmp_path):
    with Sentinels(tmp_path, certs) as sentinels:
        serves_through_failover(sentinels.url, tier_prefix(), tmp_path, sentinels.kill_master)
