"""SIGTERM (a rolling restart, a scale-down): a scheduler takes no new requests,
finishes its running ones, hands back what it cannot finish in its drain time, and
leaves the tier at once; nothing is lost or repeated, and no TTL is waited for."""

from __future__ import annotations

import asyncio
import json
import signal
import time

import httpx
import redis

from pipeline.status import live_workers
from pipeline.streams import DETOKENIZERS, SCHEDULERS, Keys
from tests.faults.clients import prompts, report, stream_many
from tests.test_scheduler_loop import slow_schema


def _sigterm_once_flowing(url: str, victim, texts: list[str], max_tokens: int,
                          then=lambda: None):
    """Stream every prompt; SIGTERM `victim` once they flow, then call `then`. The
    outcomes, the victim's exit code, and how long it took to exit."""

    async def main():
        started = asyncio.Event()
        run = asyncio.create_task(stream_many(url, texts, max_tokens, started))
        await asyncio.wait_for(started.wait(), 120)
        victim.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        await asyncio.to_thread(then)  # the streams read on meanwhile
        while victim.poll() is None:  # polled: a thread's wait() waited on busy threads
            await asyncio.sleep(0.05)
        exit_code, exit_s = victim.returncode, time.monotonic() - t0
        return await run, exit_code, exit_s

    return asyncio.run(main())


def _ids(tier, role: str) -> set[str]:
    return {w["id"] for w in live_workers(tier.redis_url, tier.prefix) if w["role"] == role}


def _consumers(tier, stream: str = "requests", group: str = SCHEDULERS) -> set[str]:
    client = redis.Redis.from_url(tier.redis_url)
    try:
        found = client.xinfo_consumers(getattr(Keys(tier.prefix), stream), group)
        return {c["name"].decode() for c in found}
    finally:
        client.close()


def _victim_scheduler(make_tier, redis_url: str, **options):
    """A tier of one scheduler (the victim), a detokenizer and an api, ready: the
    tier, the victim's process and id, and the api's URL."""
    tier = make_tier(redis_url, **options)
    victim = tier.start("scheduler")
    tier.start("detokenizer")
    url = tier.start_api()
    tier.wait_ready()
    [victim_id] = _ids(tier, "scheduler")
    return tier, victim, victim_id, url


def _assert_whole(name: str, reference, got, exit_s: float) -> None:
    """Nothing lost, cut or different from an undisturbed run."""
    figures = report(name, reference, got, exit_s=round(exit_s, 2))
    assert figures["lost"] == 0 and figures["differing"] == 0
    assert all(o.error is None and o.finish == "length" for o in got)


def test_a_draining_scheduler_finishes_its_requests_then_leaves(own_redis7, make_tier):
    tier, victim, victim_id, url = _victim_scheduler(make_tier, own_redis7.url,
                                                     **{"drain-timeout-s": "60"})
    texts = prompts(4)
    reference = asyncio.run(stream_many(url, texts, 160))

    def shows_draining() -> None:  # its heartbeat says so (pipeline status)
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            if any(w.get("draining") for w in live_workers(tier.redis_url, tier.prefix)
                   if w["id"] == victim_id):
                return
            time.sleep(0.1)
        raise AssertionError("the draining scheduler's record never said so")

    got, exit_code, exit_s = _sigterm_once_flowing(url, victim, texts, 160, then=shows_draining)
    _assert_whole("scheduler SIGTERM, drained", reference, got, exit_s)
    assert exit_code == 0
    assert victim_id not in _ids(tier, "scheduler") | _consumers(tier)  # gone, not expiring


def test_what_a_drain_cannot_finish_goes_to_another_scheduler(own_redis7, make_tier):
    """A 1 s drain, streams of 320 tokens (several seconds): the victim, which holds
    them all, hands them back as continuations, and a scheduler started as it
    drains (a rolling restart's replacement) ends them as an undisturbed run would."""
    tier, victim, victim_id, url = _victim_scheduler(
        make_tier, own_redis7.url, **{"drain-timeout-s": "1", "max-running-requests": "8"})
    texts = prompts(4)
    reference = asyncio.run(stream_many(url, texts, 320))
    got, exit_code, exit_s = _sigterm_once_flowing(url, victim, texts, 320,
                                                   then=lambda: tier.start("scheduler"))
    _assert_whole("scheduler SIGTERM, drain 1 s", reference, got, exit_s)
    assert exit_code == 0 and exit_s < 5  # its drain time and a step, not a TTL
    assert victim_id not in _ids(tier, "scheduler") | _consumers(tier)
    log = (tier.log_dir / "scheduler-0.log").read_text()
    assert "drain time up: 4 requests go to other schedulers" in log


def test_a_draining_api_finishes_its_streams_and_takes_no_new_ones(own_redis7, make_tier):
    tier = make_tier(own_redis7.url, **{"drain-timeout-s": "60"})
    tier.start("scheduler")
    tier.start("detokenizer")
    url = tier.start_api()
    tier.wait_ready()
    [api] = [proc for proc in tier.procs if "api" in proc.args]
    texts = prompts(4)
    reference = asyncio.run(stream_many(url, texts, 64))

    def refused() -> None:  # the listening socket closes at once
        time.sleep(0.5)
        try:
            httpx.get(f"{url}/health", timeout=2)
        except httpx.ConnectError:
            return
        raise AssertionError("a draining api took a new connection")

    got, exit_code, exit_s = _sigterm_once_flowing(url, api, texts, 64, then=refused)
    _assert_whole("api SIGTERM, drained", reference, got, exit_s)
    assert exit_code == 0


def test_a_draining_detokenizer_sends_its_last_replies_and_leaves(own_redis7, make_tier):
    """Its batches are not left pending for a TTL: the other detokenizer goes on."""
    tier = make_tier(own_redis7.url, **{"drain-timeout-s": "20"})
    tier.start("scheduler")
    victim = tier.start("detokenizer")
    url = tier.start_api()
    tier.wait_ready()
    [victim_id] = _ids(tier, "detokenizer")
    tier.start("detokenizer")
    tier.wait_ready(detokenizers=2)
    texts = prompts(8)
    reference = asyncio.run(stream_many(url, texts, 64))
    got, exit_code, exit_s = _sigterm_once_flowing(url, victim, texts, 64)
    _assert_whole("detokenizer SIGTERM, drained", reference, got, exit_s)
    assert exit_code == 0
    assert victim_id not in _ids(tier, "detokenizer") | _consumers(tier, "tokens", DETOKENIZERS)



def _successor(tier, old) -> tuple[object, str]:
    """A new scheduler, and its id once it is live and `old` has exited."""
    before = _ids(tier, "scheduler")
    new = tier.start("scheduler")
    deadline = time.monotonic() + 120
    while old.poll() is None or not (_ids(tier, "scheduler") - before):
        assert time.monotonic() < deadline and new.poll() is None, "no successor"
        time.sleep(0.05)
    return new, (_ids(tier, "scheduler") - before).pop()


def _took(tier, scheduler_id: str, count: int) -> None:
    """Wait until `scheduler_id` holds `count` requests (pending on it)."""
    client = redis.Redis.from_url(tier.redis_url)
    deadline = time.monotonic() + 60
    try:
        while time.monotonic() < deadline:
            found = client.xpending(Keys(tier.prefix).requests, SCHEDULERS)["consumers"]
            if any(c["name"].decode() == scheduler_id and c["pending"] >= count for c in found):
                return
            time.sleep(0.05)
    finally:
        client.close()
    raise TimeoutError(f"scheduler {scheduler_id} never took {count} requests")


def test_hand_backs_by_drains_are_not_deaths_toward_the_poison_limit(own_redis7, make_tier):
    """Two rolling restarts, then a crash, under the same streams: each drain's
    hand-back is a new attempt, but only the crash counts toward the 3 deaths
    that make a request poison, so the last scheduler's rescue runs them on
    (counted as deaths, their third attempt's crash failed them as poison)."""
    tier, first, _, url = _victim_scheduler(make_tier, own_redis7.url,
                                            **{"drain-timeout-s": "0.3"})
    texts = prompts(2)
    reference = asyncio.run(stream_many(url, texts, 600))
    rescuer_log = []

    def restarts() -> None:  # the first scheduler was sent SIGTERM
        second, second_id = _successor(tier, first)
        _took(tier, second_id, len(texts))
        second.send_signal(signal.SIGTERM)
        third, third_id = _successor(tier, second)
        _took(tier, third_id, len(texts))
        third.kill()
        rescuer_log.append(tier.log_dir / f"scheduler-{len(tier.procs)}.log")
        tier.start("scheduler")

    got, exit_code, _ = _sigterm_once_flowing(url, first, texts, 600, then=restarts)
    _assert_whole("two drains, then a crash", reference, got, 0.0)
    assert exit_code == 0
    assert f"took over {len(texts)} requests of dead scheduler" in rescuer_log[0].read_text()


def test_a_scheduler_exits_without_waiting_for_an_abandoned_grammar_compile(own_redis7,
                                                                            make_tier):
    """A schema that takes seconds to compile, past --grammar-timeout: its request is a
    400 at the limit while the compile runs on (xgrammar cannot be stopped). SIGTERM
    then sees the scheduler exit 0 at once, not once that compile ends."""
    tier = make_tier(own_redis7.url)
    victim = tier.start("scheduler", **{"grammar-timeout": 0.3})
    tier.start("detokenizer")
    url = tier.start_api()
    tier.wait_ready()
    schema = {"name": "slow", "schema": json.loads(slow_schema(400))}
    response = httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
        "response_format": {"type": "json_schema", "json_schema": schema}})
    assert response.status_code == 400, response.text
    assert "did not compile within 0.3 s" in response.json()["error"]["message"]
    victim.send_signal(signal.SIGTERM)
    t0 = time.monotonic()
    assert victim.wait(timeout=120) == 0
    exit_s = time.monotonic() - t0
    logged = (tier.log_dir / "scheduler-0.log").read_text()
    assert "exiting without waiting: a grammar compile" in logged, logged
    print(f"\nscheduler exit with an abandoned compile: {exit_s:.2f} s")
    assert exit_s < 3.0
