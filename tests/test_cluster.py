"""A tier on a Redis Cluster (redis+cluster:// URLs, a prefix with a hash tag): every
key in one slot, it serves through that slot's master, found from any node, and goes on
after that master dies and the cluster promotes its replica; a request in flight then
ends whole. A prefix without a hash tag is a usage error."""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from pipeline.redis_cluster import ClusterUrl, cluster_url, tier_slot
from pipeline.status import live_workers
from tests.harness import Cluster, Tier
from tests.test_sentinel import _completion


def test_a_cluster_url_names_its_nodes_and_a_tier_needs_a_hash_tag():
    assert cluster_url("redis+cluster://u:pw@10.0.0.1:7000,h:7001") == ClusterUrl(
        [("10.0.0.1", 7000), ("h", 7001)], "u", "pw")
    assert cluster_url("redis://h:6379/0") is None
    for wrong in ("redis+cluster://h", "redis+cluster://h:7000/1"):
        with pytest.raises(ValueError):
            cluster_url(wrong)
    assert tier_slot("{pipeline}") == tier_slot("{pipeline}-other")  # the tag alone counts
    with pytest.raises(ValueError):
        tier_slot("pipeline")
    refused = subprocess.run([sys.executable, "-m", "pipeline.cli", "status", "--redis-url",
                              "redis+cluster://127.0.0.1:1", "--prefix", "pipeline"],
                             capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "hash" in refused.stderr  # a usage error


@pytest.fixture
def cluster(tmp_path):
    found = Cluster(tmp_path)
    try:
        found.start()
        yield found
    finally:
        found.stop()


def test_a_tier_on_a_cluster_serves_on_after_its_slots_master_fails_over(cluster, model_files,
                                                                        tmp_path):
    prefix = f"{{test-{uuid.uuid4().hex[:10]}}}"
    tier = Tier(cluster.url, prefix, tmp_path)
    try:
        url = tier.start_one_of_each()
        before = _completion(url)
        assert before
        master = cluster.master_of(prefix)
        with ThreadPoolExecutor(1) as pool:  # one in flight through the failover
            long = pool.submit(httpx.post, f"{url}/v1/completions", timeout=120, json={
                "model": "SmolLM2-135M-Instruct", "prompt": "Once", "max_tokens": 200,
                "ignore_eos": True, "temperature": 0})
            time.sleep(0.5)
            assert not long.done()
            cluster.kill(master)
            deadline = time.monotonic() + 30
            while cluster.master_of(prefix) == master:
                assert time.monotonic() < deadline, "no failover"
                time.sleep(0.2)
            assert _completion(url) == before  # the same greedy text, through the new master
            ended = long.result()
        assert ended.status_code == 200, ended.text
        assert ended.json()["usage"]["completion_tokens"] == 200
        roles = sorted(w["role"] for w in live_workers(cluster.url, prefix))
        assert roles == ["api", "detokenizer", "scheduler"]
    finally:
        tier.stop()
