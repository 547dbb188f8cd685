"""Redis misbehaving under load: connections killed, the server restarted
empty. No worker exits; every request accepted by a live frontend completes."""

from __future__ import annotations

import asyncio
import time

from tests.faults.clients import prompts, report, stream_many


def _start(make_tier, server):
    tier = make_tier(server.url)
    return tier, tier.start_one_of_each()


def _during_streams(url, texts, max_tokens, fault):
    async def main():
        started = asyncio.Event()
        run = asyncio.create_task(stream_many(url, texts, max_tokens, started))
        await asyncio.wait_for(started.wait(), 120)
        t0 = time.monotonic()
        await asyncio.to_thread(fault)
        outcomes = await run
        return outcomes, time.monotonic() - t0

    return asyncio.run(main())


def test_killed_connections_are_reconnected_and_nothing_is_lost(own_redis7, make_tier):
    own_redis = own_redis7
    tier, url = _start(make_tier, own_redis)
    texts = prompts(16)
    reference = asyncio.run(stream_many(url, texts, 32))

    def kill_clients():
        for _ in range(3):
            own_redis.client().client_kill_filter(_type="normal", skipme=True)
            time.sleep(0.3)

    got, took_s = _during_streams(url, texts, 32, kill_clients)
    figures = report("CLIENT KILL x3", reference, got, took_s=round(took_s, 2))
    assert figures["lost"] == 0 and figures["differing"] == 0
    assert all(proc.poll() is None for proc in tier.procs)


def test_a_redis_restart_that_lost_everything_is_survived_by_resubmission(own_redis7, make_tier):
    tier, url = _start(make_tier, own_redis7)
    texts = prompts(16)
    reference = asyncio.run(stream_many(url, texts, 32))
    got, took_s = _during_streams(url, texts, 32, lambda: own_redis7.restart(down_s=1.0))
    figures = report("redis restart (data lost)", reference, got, took_s=round(took_s, 2))
    assert figures["lost"] == 0 and figures["differing"] == 0
    assert all(proc.poll() is None for proc in tier.procs)
    # and the tier still serves new work afterwards
    again = asyncio.run(stream_many(url, texts[:4], 8))
    assert all(o.finish == "length" for o in again)
