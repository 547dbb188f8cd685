"""A tier on a Redis that Sentinel manages (redis+sentinel:// URLs): it serves through
the master the sentinel names, and goes on serving after that master dies and the
sentinel promotes its replica, every worker finding the new one."""

from __future__ import annotations

import pytest

from pipeline.redis_url import SentinelUrl, sentinel_url
from tests.redis_ha import Sentinels, serves_through_failover, tier_prefix, usage_error


def test_a_sentinel_url_names_the_sentinels_the_service_and_the_masters_login_or_is_refused():
    assert sentinel_url("redis+sentinel://u:p%40ss@10.0.0.1:5000,[::1],h/svc/2") == SentinelUrl(
        [("10.0.0.1", 5000), ("::1", 26379), ("h", 26379)], "svc", 2, "u", "p@ss")
    assert sentinel_url("rediss+sentinel://h/svc").ssl
    assert sentinel_url("redis://h:6379/0") is None
    for wrong in ("redis+sentinel://h:1", "redis+sentinel:///svc", "redis+sentinel://h/a/1/2"):
        with pytest.raises(ValueError):
            sentinel_url(wrong)
    assert "Sentinel" in usage_error("worker", "--role", "api", "--redis-url",
                                     "redis+sentinel://h:1")


@pytest.fixture
def sentinels(tmp_path):
    with Sentinels(tmp_path) as found:
        yield found


def test_a_tier_on_sentinel_serves_on_after_its_master_fails_over(sentinels, model_files,
                                                                  tmp_path):
    def fail_over() -> None:
        old = sentinels.master_port()
        assert sentinels.kill_master() != old

    serves_through_failover(sentinels.url, tier_prefix(), tmp_path, fail_over)
