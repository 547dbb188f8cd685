"""Bounded memory: after thousands of requests, streams are trimmed (never
below a pending entry), dead frontends' reply streams expire, and neither
Redis nor the workers grow with the number of requests served."""

from __future__ import annotations

import asyncio
import os
import time

import httpx
import psutil

from pipeline.streams import Keys

NUM_REQUESTS = int(os.environ.get("PIPELINE_TEST_BOUNDED_REQUESTS", "1200"))
CONCURRENCY = 32


def _figures(tier, server) -> dict:
    client = server.client()
    keys = Keys(tier.prefix)
    streams = [keys.requests, keys.tokens, keys.control,
               *[k.decode() for k in client.scan_iter(match=f"{tier.prefix}:replies:*")]]
    rss = {f"rss_mb_{p.args[5]}": round(psutil.Process(p.pid).memory_info().rss / 2**20)
           for p in tier.procs}
    return {"max_stream_len": max(client.xlen(s) for s in streams if client.exists(s)),
            "redis_used_mb": round(client.info("memory")["used_memory"] / 2**20, 2),
            "num_keys": client.dbsize()} | rss


def test_thousands_of_requests_leave_streams_memory_and_rss_bounded(own_redis7, make_tier):
    tier = make_tier(own_redis7.url)
    url = tier.start_one_of_each()
    body = {"prompt": "Say hi", "max_tokens": 2, "temperature": 0, "ignore_eos": True}
    samples = {}

    async def main():
        queue: asyncio.Queue = asyncio.Queue()
        for i in range(NUM_REQUESTS):
            queue.put_nowait(i)
        done = 0

        async def worker(client):
            nonlocal done
            while not queue.empty():
                queue.get_nowait()
                response = await client.post(f"{url}/v1/completions", json=body, timeout=120)
                assert response.status_code == 200, response.text
                done += 1
                if (n := done) in (NUM_REQUESTS // 4, NUM_REQUESTS):
                    samples[n] = await asyncio.to_thread(_figures, tier, own_redis7)

        async with httpx.AsyncClient(limits=httpx.Limits(max_connections=CONCURRENCY)) as c:
            await asyncio.gather(*(worker(c) for _ in range(CONCURRENCY)))

    t0 = time.monotonic()
    asyncio.run(main())
    took_s = time.monotonic() - t0
    time.sleep(2.5)  # one more upkeep round trims what the last requests left
    samples["after"] = _figures(tier, own_redis7)
    print(f"\n[bounded] {NUM_REQUESTS} requests in {took_s:.1f}s: {samples}")
    quarter, end, after = samples[NUM_REQUESTS // 4], samples[NUM_REQUESTS], samples["after"]
    assert after["max_stream_len"] <= 1000  # trimmed: not one entry per request served
    assert end["redis_used_mb"] - quarter["redis_used_mb"] < 5
    for name in (k for k in end if k.startswith("rss_mb_")):
        assert end[name] - quarter[name] < 80, name
