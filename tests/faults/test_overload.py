"""Overload and time: past the queue limit the api answers 503 at once;
requests past their deadline are not started and say so."""

from __future__ import annotations

import asyncio
import time

import httpx

from tests.faults.clients import expired_requests, hog_then_hasty


def test_past_the_queue_limit_the_api_answers_503_with_retry_after_at_once(redis_url, make_tier):
    """A queue counts toward a request's limit only in its lane and the more urgent
    ones: behind a default backlog, a priority request is taken."""
    tier = make_tier(redis_url, **{"max-running-requests": "2", "max-queued-requests": "4"})
    tier.start("scheduler")
    tier.start("detokenizer")
    url = tier.start_api()
    tier.wait_ready()
    # 12 requests 2 at a time must outlast the 1.5 s below: 6 rounds of 64 steps
    body = {"prompt": "Once upon a time", "max_tokens": 64, "temperature": 0, "ignore_eos": True}

    async def one(client, service_tier: str = "default"):
        t0 = time.monotonic()
        response = await client.post(f"{url}/v1/completions", timeout=300,
                                     json=body | {"service_tier": service_tier})
        return response, time.monotonic() - t0

    async def main():
        async with httpx.AsyncClient(limits=httpx.Limits(max_connections=64)) as client:
            first = [asyncio.create_task(one(client)) for _ in range(12)]
            await asyncio.sleep(1.5)  # the frontend has seen the queue build up
            late = asyncio.gather(*(one(client) for _ in range(8)))
            urgent = await asyncio.gather(*(one(client, "priority") for _ in range(2)))
            return await asyncio.gather(*first), await late, urgent

    first, late, urgent = asyncio.run(main())
    assert [r.status_code for r, _ in urgent] == [200, 200]
    refused = [(r, s) for r, s in late if r.status_code == 503]
    assert refused, [r.status_code for r, _ in late]
    for response, seconds in refused:
        assert response.headers["retry-after"]
        assert response.json()["error"]["code"] == "overloaded"
        assert seconds < 1.0
    assert all(r.status_code in (200, 503) for r, _ in first + late)
    print(f"\n[overload] refused={len(refused)}/{len(late)} late requests, "
          f"slowest refusal {max(s for _, s in refused):.3f}s")


def test_a_request_past_its_deadline_is_not_started_and_gets_a_clear_error(redis_url, make_tier):
    tier = make_tier(redis_url, **{"max-running-requests": "1"})
    tier.start("scheduler")
    tier.start("detokenizer")
    patient = tier.start_api()
    hasty = tier.start_api(**{"request-timeout": "1"})
    tier.wait_ready()
    hog, waiting = hog_then_hasty(patient, hasty)
    assert hog.status_code == 200
    assert waiting.status_code == 408, waiting.text
    assert waiting.json()["error"]["code"] == "timeout"
    # pulled only after its deadline: refused, never started
    assert expired_requests(redis_url, tier.prefix, at_least=1) == 1


def test_the_queue_depth_decides_overload_exactly_on_either_redis(own_redis):
    """7 entries never delivered, 2 delivered and pending, 1 acked but not trimmed:
    Redis 7 counts the 7 itself; on Redis 6 the depth is read as length less
    pending (8) without reading an entry while that is under the limit, and
    counted from there. Either way `depth >= limit` is true exactly when 7 >= limit."""
    import redis as sync_redis

    from pipeline.recovery import queue_depth
    from pipeline.streams import StreamClient

    plain = sync_redis.Redis(port=own_redis.port)
    plain.xgroup_create("q", "g", id="0", mkstream=True)
    ids = [plain.xadd("q", {"m": b"x" * 100}) for _ in range(10)]
    plain.xreadgroup("g", "c", {"q": ">"}, count=3)
    plain.xack("q", "g", ids[0])

    def ranges_read() -> int:
        return plain.info("commandstats").get("cmdstat_xrange", {}).get("calls", 0)

    async def depth(limit: int, exact: bool = False) -> int:
        client = StreamClient(own_redis.url)
        try:
            return await queue_depth(client, "q", "g", limit, exact)
        finally:
            await client.close()

    for limit in (1, 5, 7, 8, 9, 100):
        before = ranges_read()
        found = asyncio.run(depth(limit))
        assert (found >= limit) == (7 >= limit) and found <= 8, (limit, found)
        if limit > 8:  # under the limit by length less pending: no entry is read
            assert ranges_read() == before
    # exact (`pipeline status`): the 7 on either Redis up to the limit; past it, more
    assert [asyncio.run(depth(limit, exact=True)) for limit in (100, 7)] == [7, 7]
    assert asyncio.run(depth(5, exact=True)) > 5
