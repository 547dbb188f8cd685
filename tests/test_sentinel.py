"""A tier on a Redis that Sentinel manages (redis+sentinel:// URLs): it serves through
the master the sentinel names, and goes on serving after that master dies and the
sentinel promotes its replica, every worker finding the new one; a request in flight
then ends whole."""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from pipeline.redis_url import SentinelUrl, sentinel_url
from pipeline.status import live_workers
from tests.harness import Sentinels, Tier


def test_a_sentinel_url_names_the_sentinels_the_service_and_the_masters_login_or_is_refused():
    assert sentinel_url("redis+sentinel://u:p%40ss@10.0.0.1:5000,[::1],h/svc/2") == SentinelUrl(
        [("10.0.0.1", 5000), ("::1", 26379), ("h", 26379)], "svc", 2, "u", "p@ss")
    assert sentinel_url("rediss+sentinel://h/svc").ssl
    assert sentinel_url("redis://h:6379/0") is None
    for wrong in ("redis+sentinel://h:1", "redis+sentinel:///svc", "redis+sentinel://h/a/1/2"):
        with pytest.raises(ValueError):
            sentinel_url(wrong)
    refused = subprocess.run([sys.executable, "-m", "pipeline.cli", "worker", "--role", "api",
                              "--redis-url", "redis+sentinel://h:1"], capture_output=True,
                             text=True, timeout=60)
    assert refused.returncode == 2 and "Sentinel" in refused.stderr  # a usage error


@pytest.fixture
def sentinels(tmp_path):
    found = Sentinels(tmp_path)
    try:
        found.start()
        yield found
    finally:
        found.stop()


def _completion(url: str, timeout_s: float = 60) -> str:
    """The text of a short greedy completion, asked until the tier answers."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            reply = httpx.post(f"{url}/v1/completions", timeout=30, json={
                "model": "SmolLM2-135M-Instruct", "prompt": "The sky is", "max_tokens": 8,
                "temperature": 0})
            if reply.status_code == 200:
                return reply.json()["choices"][0]["text"]
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "the tier did not answer"
        time.sleep(0.5)


def test_a_tier_on_sentinel_serves_on_after_its_master_fails_over(sentinels, model_files,
                                                                  tmp_path):
    tier = Tier(sentinels.url, f"test-{uuid.uuid4().hex[:10]}", tmp_path)
    try:
        url = tier.start_one_of_each()
        before = _completion(url)
        assert before
        with ThreadPoolExecutor(1) as pool:  # one in flight through the failover
            long = pool.submit(httpx.post, f"{url}/v1/completions", timeout=120, json={
                "model": "SmolLM2-135M-Instruct", "prompt": "Once", "max_tokens": 400,
                "ignore_eos": True, "temperature": 0})
            time.sleep(0.5)
            assert not long.done()
            old = sentinels.master_port()
            assert sentinels.kill_master() != old
            assert _completion(url) == before  # the same greedy text, through the new master
            ended = long.result()
        assert ended.status_code == 200, ended.text
        assert ended.json()["usage"]["completion_tokens"] == 400
        roles = sorted(w["role"] for w in live_workers(sentinels.url, tier.prefix))
        assert roles == ["api", "detokenizer", "scheduler"]
    finally:
        tier.stop()
