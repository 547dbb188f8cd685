"""A Redis that may evict keys drops the tier's without an error: every role warns
at start and `pipeline status` says so in red (pipeline/eviction.py)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time

from tests.harness import worker_env


def status(url: str, *args: str) -> str:
    shown = subprocess.run([sys.executable, "-m", "pipeline.cli", "status", "--redis-url", url,
                            "--prefix", "evict", *args], capture_output=True, text=True,
                           timeout=60)
    assert shown.returncode == 0, shown.stderr
    return " ".join(shown.stdout.split())  # as one line, however rich wrapped it


def first_warning(url: str, role: str, timeout_s: float = 60) -> str | None:
    """The first WARNING line a worker of `role` logs within `timeout_s` (it is
    then stopped)."""
    proc = subprocess.Popen([sys.executable, "-m", "pipeline.cli", "worker", "--role", role,
                             "--redis-url", url, "--prefix", "evict"], text=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=worker_env())
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline and (line := proc.stderr.readline()):
            if "WARNING" in line:
                return line
        return None
    finally:
        proc.kill()
        proc.wait()


def test_a_redis_that_may_evict_the_tiers_keys_is_named_at_start_and_in_status(own_redis7):
    admin = own_redis7.client()
    url = own_redis7.url
    assert "Redis evict" not in status(url)  # no memory limit: nothing is ever evicted
    admin.config_set("maxmemory", "64mb")
    admin.config_set("maxmemory-policy", "volatile-lru")  # a managed Redis's usual default
    said = status(url)
    assert "Redis evicts keys past its maxmemory (64.00M, maxmemory-policy volatile-lru)" in said
    assert "Set maxmemory-policy noeviction" in said
    [warning] = json.loads(subprocess.run(
        [sys.executable, "-m", "pipeline.cli", "status", "--redis-url", url, "--json"],
        capture_output=True, text=True, timeout=60).stdout)["redis_warnings"]
    assert "volatile-lru" in warning
    logged = first_warning(url, "detokenizer")
    assert logged and "maxmemory-policy volatile-lru" in logged, logged

    admin.config_set("maxmemory-policy", "noeviction")
    assert "Redis evict" not in status(url)

    admin.config_set("maxmemory", "2mb")  # a Redis that did evict: the count is shown
    admin.config_set("maxmemory-policy", "allkeys-lru")
    for i in range(200):
        admin.set(f"filler:{i}", b"x" * 20_000)
    evicted = admin.info("stats")["evicted_keys"]
    assert evicted > 0
    shown = re.search(r"Redis has evicted (\d+) keys since it started", status(url))
    assert shown and int(shown[1]) >= evicted  # each command over the limit evicts more
