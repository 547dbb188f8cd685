"""The engine issue's memory target on real processes: over 1,000 requests of mixed
shapes each role's resident set stays flat, the KV cache holds its budget, and no
request leaves anything behind (bench/memory_bench.py measures the same on any tier)."""

from __future__ import annotations

import time
import uuid

import psutil
import pytest

from pipeline.bench import Endpoint
from pipeline.status import live_workers
from tests.harness import Tier, load_bench_script

# short outputs keep the run to seconds; prompts of 8-96 words, both endpoints
SHAPES = [(24, 8, Endpoint.completions, 0.7), (96, 2, Endpoint.chat, 0.0),
          (8, 16, Endpoint.completions, 0.0), (48, 4, Endpoint.chat, 0.0)]
# A leak sets a new high in nearly every chunk of 100 requests; an allocator's
# high-water mark now and then. The scheduler's (~1,100 MiB, most of it weights and
# the KV cache) rose by 16-105 MiB in one or two chunks of some fresh tiers' first
# 1,000 requests, and fell back by up to 58 (bench/memory_bench.py; flat over 2,000
# more); in one CI run it swung within 1,105-1,188 MiB, rising in 4 chunks and
# falling in the others, with one new high. RSS hides a leak until it outgrows the
# free memory the allocators hold: one of 30 KB a request passed here, one of 150 KB
# failed; the records checked after the run catch a request's state left behind.
ALLOWED_MIB = {"scheduler": 128, "api": 8, "detokenizer": 8}  # over the 1,000
MAX_NEW_HIGHS = 3  # of the 10 chunks, those that left a role over 2 MiB above its peak


def settled(tier: Tier, timeout_s: float = 15) -> dict[str, dict]:
    """Each role's liveness record once the scheduler reports nothing in flight."""
    deadline = time.monotonic() + timeout_s
    while True:
        workers = {w["role"]: w for w in live_workers(tier.redis_url, tier.prefix)}
        scheduler, api = workers.get("scheduler", {}), workers.get("api", {})
        idle = scheduler.get("num_running") == 0 and scheduler.get("num_waiting") == 0
        if (idle and api.get("in_flight") == 0) or time.monotonic() > deadline:
            return workers
        time.sleep(0.5)


@pytest.mark.timeout(600)
def test_rss_stays_flat_over_1000_requests_and_nothing_is_left_behind(redis_url, tmp_path):
    bench = load_bench_script("memory_bench")
    tier = Tier(redis_url, f"test-{uuid.uuid4().hex[:10]}", tmp_path, dtype="auto",
                **{"kv-cache-mb": 128})
    try:
        url = tier.start_one_of_each()
        found = {proc.args[proc.args.index("--role") + 1]: [psutil.Process(proc.pid)]
                 for proc in tier.procs}
        warm = bench.run(url, found, 200, 50, 32, SHAPES, seed=1000)
        samples = bench.run(url, found, 1000, 100, 32, SHAPES)
        workers = settled(tier)
    finally:
        tier.stop()
    assert warm[-1].failed == samples[-1].failed == 0, warm[-1].errors + samples[-1].errors
    for role, allowed in ALLOWED_MIB.items():
        growth = bench.growth_mib(samples, role, 0)
        assert growth <= allowed, f"{role} RSS grew {growth:.1f} MiB: {samples}"
        highs = bench.new_highs(samples, role, 0)
        assert highs <= MAX_NEW_HIGHS, f"{role} RSS kept setting new highs: {samples}"
    scheduler = workers["scheduler"]
    assert scheduler["num_running"] == scheduler["num_waiting"] == 0
    assert scheduler["num_free_blocks"] == scheduler["num_blocks"]  # cached prefixes count free
    assert scheduler["kv_cache_bytes"] <= scheduler["kv_budget_bytes"] == 128 * 2**20
    # the last seconds' steps reach the record (`pipeline status`) too
    assert scheduler["recent_steps"] > 0 and scheduler["step_ms_p50"] > 0
    assert scheduler["output_tokens_per_s"] > 0
    assert workers["api"]["in_flight"] == 0


def test_a_leak_sets_new_highs_where_a_swinging_allocator_does_not():
    bench = load_bench_script("memory_bench")

    def samples(mib: list[float]) -> list:
        return [bench.Sample(100 * i, {"scheduler": int(m * 2**20)}, 0, [])
                for i, m in enumerate(mib)]

    # the CI run that counted 4 rises: glibc handing memory back and taking it again
    swinging = [1161.9, 1104.6, 1111.3, 1104.6, 1142.1, 1136.7, 1128.7, 1142.2, 1188.0,
                1138.3, 1128.7]
    assert bench.new_highs(samples(swinging), "scheduler", 0) == 1
    leaking = [1100 + 3 * i for i in range(11)]  # 30 KB a request
    assert bench.new_highs(samples(leaking), "scheduler", 0) == 10
    # only what follows the settle point counts
    assert bench.new_highs(samples(leaking), "scheduler", 500) == 5
