"""Any role killed with SIGKILL under load: nothing lost, nothing repeated."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx

from pipeline.status import live_workers, server_now_s
from tests.faults.clients import prompts, report, stream_many

NUM_STREAMS = 16


def _kill_after_start(url: str, victim, prompts_: list[str], max_tokens: int,
                      after=None, tiers: tuple[str, ...] = ()):
    """Stream every prompt; SIGKILL `victim` once the streams are flowing."""

    async def main():
        started = asyncio.Event()
        run = asyncio.create_task(stream_many(url, prompts_, max_tokens, started, tiers))
        await asyncio.wait_for(started.wait(), 120)
        os.kill(victim.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        if after is not None:
            await asyncio.to_thread(after)
        outcomes = await run
        return outcomes, time.monotonic() - killed_at

    return asyncio.run(main())


def test_a_killed_scheduler_s_requests_finish_on_another_exactly_as_undisturbed(
        own_redis, make_tier):
    """In every service tier's lane: each continuation goes back down its own."""
    tier = make_tier(own_redis.url, **{"max-running-requests": "8"})
    victim = tier.start("scheduler")
    tier.start("scheduler")
    tier.start("detokenizer")
    url = tier.start_api()
    tier.wait_ready(schedulers=2)
    texts = prompts(NUM_STREAMS)
    reference = asyncio.run(stream_many(url, texts, 32))
    assert all(o.finish == "length" for o in reference)
    got, recovery_s = _kill_after_start(url, victim, texts, 32,
                                        tiers=("priority", "default", "flex"))
    figures = report("scheduler -9", reference, got, recovery_s=round(recovery_s, 2))
    assert figures["lost"] == 0 and figures["differing"] == 0
    assert all(o.error is None for o in got)


def test_tokens_a_killed_scheduler_held_back_are_made_again_by_another(own_redis7, make_tier):
    """--stream-interval 4: the dead scheduler held up to 3 tokens of each stream
    that no client had; the continuation starts after the delivered ones."""
    tier = make_tier(own_redis7.url, **{"max-running-requests": "8"})
    victim = tier.start("scheduler")
    tier.start("scheduler")
    tier.start("detokenizer")
    url = tier.start_api(**{"stream-interval": "4"})
    tier.wait_ready(schedulers=2)
    texts = prompts(NUM_STREAMS)
    reference = asyncio.run(stream_many(url, texts, 30))  # 1 + 7 chunks of 4 + 1
    got, recovery_s = _kill_after_start(url, victim, texts, 30)
    figures = report("scheduler -9, interval 4", reference, got,
                     recovery_s=round(recovery_s, 2))
    assert figures["lost"] == 0 and figures["differing"] == 0
    assert all(o.error is None and o.finish == "length" for o in got)


def test_a_killed_and_restarted_detokenizer_loses_and_duplicates_nothing(embedded_redis,
                                                                         make_tier):
    tier = make_tier(embedded_redis.url)
    tier.start("scheduler")
    victim = tier.start("detokenizer")
    url = tier.start_api()
    tier.wait_ready()
    texts = prompts(NUM_STREAMS)
    reference = asyncio.run(stream_many(url, texts, 32))
    got, recovery_s = _kill_after_start(url, victim, texts, 32,
                                        after=lambda: tier.start("detokenizer"))
    figures = report("detokenizer -9 + restart", reference, got, recovery_s=round(recovery_s, 2))
    assert figures["lost"] == 0 and figures["differing"] == 0


def _scheduler_load(tier) -> dict:
    [info] = [w for w in live_workers(tier.redis_url, tier.prefix) if w["role"] == "scheduler"]
    return info


def _wait_for(condition, timeout_s: float = 30.0) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if condition():
            return time.monotonic() - start
        time.sleep(0.1)
    raise TimeoutError("condition never held")


def test_a_killed_api_worker_s_requests_are_freed_and_the_other_keeps_serving(
        own_redis7, make_tier):
    tier = make_tier(own_redis7.url)
    tier.start("scheduler")
    tier.start("detokenizer")
    victim_url = tier.start_api()
    victim = tier.procs[-1]
    survivor_url = tier.start_api()
    tier.wait_ready()
    frontends = [w["id"] for w in live_workers(tier.redis_url, tier.prefix) if w["role"] == "api"]

    async def flood():
        # long generations on the victim, then kill it mid-flight
        task = asyncio.create_task(stream_many(victim_url, prompts(8), 400))
        await asyncio.sleep(0)
        return task

    async def main():
        task = await flood()
        for _ in range(600):
            if _scheduler_load(tier)["num_running"] >= 8:
                break
            await asyncio.sleep(0.05)
        os.kill(victim.pid, signal.SIGKILL)
        task.cancel()
        survivor = await stream_many(survivor_url, prompts(4), 16)
        return survivor

    survivor = asyncio.run(main())
    assert all(o.finish == "length" for o in survivor)
    freed_s = _wait_for(lambda: _scheduler_load(tier)["num_running"] == 0)
    load = _scheduler_load(tier)
    assert load["num_free_blocks"] == load["num_blocks"] - load.get("num_cached_blocks", 0) or \
        load["num_running"] == 0
    client = own_redis7.client()
    dead = [f for f in frontends if not client.exists(f"{tier.prefix}:alive:api:{f}")]
    assert len(dead) == 1
    expired_s = _wait_for(lambda: not client.exists(f"{tier.prefix}:replies:{dead[0]}"), 60)
    print(f"\n[api -9] freed_after_s={freed_s:.2f} reply_stream_expired_after_s={expired_s:.2f}")


def test_an_api_stalled_past_its_ttl_gets_its_requests_back_whole(own_redis7, make_tier):
    """SIGSTOP an api for 3 TTLs (a VM paused, a long GC, a network cut): the
    schedulers take it for dead and drop its requests. Its next heartbeat finds
    its liveness key gone and resubmits each as a continuation; before, they
    waited for --request-timeout."""
    tier = make_tier(own_redis7.url)  # alive-ttl-s 2 (FAST_DEATH)
    tier.start("scheduler")
    tier.start("detokenizer")
    url = tier.start_api(**{"request-timeout": "40"})
    victim = tier.procs[-1]
    tier.wait_ready()
    texts = prompts(8)
    # long enough to outlast the stall: the schedulers go on for a TTL before they drop them
    reference = asyncio.run(stream_many(url, texts, 400))

    async def main():
        started = asyncio.Event()
        run = asyncio.create_task(stream_many(url, texts, 400, started))
        await asyncio.wait_for(started.wait(), 120)
        victim.send_signal(signal.SIGSTOP)
        await asyncio.sleep(6)  # its key expires after 2 s; its reply stream lasts 12
        dropped = _scheduler_load(tier)["num_running"]
        victim.send_signal(signal.SIGCONT)
        resumed_at = time.monotonic()
        outcomes = await run
        return outcomes, dropped, time.monotonic() - resumed_at

    got, dropped, finish_s = asyncio.run(main())
    figures = report("api stalled", reference, got, finished_after_resume_s=round(finish_s, 2))
    assert dropped == 0  # the schedulers had dropped them
    assert figures["lost"] == 0 and figures["differing"] == 0
    assert all(o.error is None for o in got)


def test_a_worker_id_is_one_worker_s_a_restart_under_it_waits_out_the_old_record(
        own_redis7, make_tier):
    """--id: a second live detokenizer under one id exits 2 at start (two consumers of
    one name take each other's entries for their own); one SIGKILLed and started
    again under its id waits for its old record to expire, then joins."""
    tier = make_tier(own_redis7.url)  # alive-ttl-s 2 (FAST_DEATH)
    first = tier.start("detokenizer", id="detok-a")
    tier.wait_ready(schedulers=0)
    log = tier.log_dir / f"detokenizer-{len(tier.procs)}.log"
    second = tier.start("detokenizer", id="detok-a")
    assert second.wait(timeout=60) == 2
    tier.procs.remove(second)
    assert "a live detokenizer already has the id 'detok-a'" in log.read_text()
    os.kill(first.pid, signal.SIGKILL)
    first.wait()
    tier.procs.remove(first)
    killed_at = server_now_s(own_redis7.client())  # the tier's clock (records' "at")
    again = tier.start("detokenizer", id="detok-a")
    joined_s = _wait_for(lambda: any(
        w["id"] == "detok-a" and w["at"] > killed_at
        for w in live_workers(tier.redis_url, tier.prefix)), 60)
    assert again.poll() is None  # it joined: its own old record was not taken for another
    print(f"\n[id claim] started again under its id, joined after {joined_s:.2f}s")


def test_a_client_that_disconnects_frees_its_kv_within_a_few_steps(tier):
    async def main(stream: bool):
        body = {"prompt": "Tell me everything about the ocean.", "max_tokens": 2000,
                "temperature": 0, "ignore_eos": True, "stream": stream}
        async with httpx.AsyncClient() as client:
            request = asyncio.create_task(
                client.post(f"{tier.base_url}/v1/completions", json=body, timeout=300))
            for _ in range(600):
                if _scheduler_load(tier)["num_running"] >= 1:
                    break
                await asyncio.sleep(0.05)
            request.cancel()  # closes the connection: the client is gone
        return time.monotonic()

    for stream in (True, False):
        gone_at = asyncio.run(main(stream))
        freed_s = _wait_for(lambda: _scheduler_load(tier)["num_running"] == 0)
        print(f"\n[disconnect stream={stream}] freed_after_s={time.monotonic() - gone_at:.2f}")
        assert freed_s < 10
