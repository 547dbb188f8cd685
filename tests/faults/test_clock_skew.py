"""Hosts whose clocks disagree: each role runs on the Redis server's clock
(pipeline/clock.py), so a request's deadline, set by an api and checked by a
scheduler on another host, means the same on both. The skewed hosts are real
worker processes under libfaketime (Debian's `faketime`; .ci/run installs it)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import redis

from pipeline.status import live_workers, server_now_s
from tests.faults.clients import expired_requests, hog_then_hasty
from tests.harness import worker_env

LIBFAKETIME = next((p for p in Path("/usr/lib").glob("*/faketime/libfaketime.so.1")), None)
needs_faketime = pytest.mark.skipif(LIBFAKETIME is None,
                                    reason="libfaketime is not installed (apt install faketime)")


def skewed(offset_s: int) -> dict[str, str]:
    """The environment of a process whose wall clock is `offset_s` off (its
    monotonic clock untouched)."""
    return {"LD_PRELOAD": str(LIBFAKETIME), "FAKETIME": f"{offset_s:+d}s",
            "DONT_FAKE_MONOTONIC": "1"}


def redis_now_s(redis_url: str) -> float:
    return server_now_s(redis.Redis.from_url(redis_url))


SYNC = """
import asyncio, json, sys, time
from pipeline.streams import StreamClient
async def main():
    client = StreamClient(sys.argv[1])
    await client.clock.sync(client.redis)
    print(json.dumps({"host_s": time.time(), "tier_s": client.clock.now_s(),
                      "offset_s": client.clock.offset_s}))
    await client.close()
asyncio.run(main())
"""


@needs_faketime
@pytest.mark.parametrize("offset_s", [-7200, 300])
def test_a_host_clock_set_wrong_is_corrected_to_the_redis_clock(redis_url, offset_s):
    done = subprocess.run([sys.executable, "-c", SYNC, redis_url], capture_output=True,
                          text=True, timeout=60, env=worker_env() | skewed(offset_s))
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert abs(seen["host_s"] - time.time() - offset_s) < 5  # the skew took
    assert abs(seen["offset_s"] + offset_s) < 1
    assert abs(seen["tier_s"] - redis_now_s(redis_url)) < 1


async def test_a_redis_that_refuses_time_leaves_the_host_clock(redis_url, prefix):
    """An ACL (or a managed Redis) without TIME: the host's clock, and a warning."""
    from pipeline.streams import StreamClient

    admin = redis.Redis.from_url(redis_url)
    user, password = f"{prefix}-user", "pw-" + prefix
    admin.execute_command("ACL", "SETUSER", user, "on", f">{password}", "~*", "+@all", "-time")
    client = StreamClient(redis_url.replace("redis://", f"redis://{user}:{password}@"))
    try:
        await client.clock.sync(client.redis)
        assert client.clock.refused and client.clock.offset_s == 0.0
        assert abs(client.clock.now_s() - time.time()) < 0.01
    finally:
        await client.close()
        admin.execute_command("ACL", "DELUSER", user)


@needs_faketime
def test_deadlines_hold_across_hosts_whose_clocks_disagree(redis_url, make_tier):
    """A scheduler 2 minutes ahead; an api 2 minutes behind it serves (before, each
    of its requests had expired on arrival: a 408), and one 2 minutes further
    ahead still has its requests expire (before, they never did)."""
    tier = make_tier(redis_url, **{"max-running-requests": "1"})
    tier.start("scheduler", env=skewed(120))
    tier.start("detokenizer")
    behind = tier.start_api(env=skewed(-120), **{"request-timeout": "60"})
    ahead = tier.start_api(env=skewed(240), **{"request-timeout": "1"})
    tier.wait_ready()
    [scheduler] = [w for w in live_workers(redis_url, tier.prefix) if w["role"] == "scheduler"]
    assert abs(scheduler["at"] - redis_now_s(redis_url)) < 5  # heartbeats on the tier's clock
    shown = subprocess.run([sys.executable, "-m", "pipeline.cli", "status", "--redis-url",
                            redis_url, "--prefix", tier.prefix], capture_output=True, text=True,
                           timeout=60)
    said = " ".join(shown.stdout.split())  # as one line, however rich wrapped it
    assert "hosts' clocks off the Redis server's" in said, said
    assert re.search(rf"scheduler {scheduler['id']} \+1(19\.[89]|20\.[01]) s", said), said
    assert len(re.findall(r"api \S+ [-+]\d+\.\d s", said)) == 2, said  # -120 and +240
    metrics = httpx.get(f"{behind}/metrics", timeout=10).text
    [ahead_s] = re.findall(r'pipeline_worker_clock_offset_seconds\{role="scheduler",'
                           r'worker="[^"]+"\} (\S+)', metrics)
    assert 119 < float(ahead_s) < 121  # what an alert on hosts' clocks reads
    [detokenizer] = [w for w in live_workers(redis_url, tier.prefix)
                     if w["role"] == "detokenizer"]
    assert abs(detokenizer["clock_offset_s"]) < 1  # its host's clock is right: not listed
    hog, hasty = hog_then_hasty(behind, ahead)
    assert hog.status_code == 200, hog.text
    assert hog.json()["usage"]["completion_tokens"] == 600
    assert hasty.status_code == 408, hasty.text
    # pulled after its deadline by the tier's clock: not started
    assert expired_requests(redis_url, tier.prefix, at_least=1) == 1
