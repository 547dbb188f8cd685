"""Chaos under load: while streams flow through two apis, schedulers and
detokenizers are SIGKILLed and replaced, an api is stalled past its TTL and
every Redis client connection is killed, one after another. Afterwards every
request has its undisturbed greedy text, exactly once, and the tier is clean:
nothing pending, no dead consumer left in a group, nothing dead-lettered.
`PIPELINE_TEST_CHAOS_S=600 pytest -s tests/faults/test_chaos.py` runs it longer."""

from __future__ import annotations

import asyncio
import itertools
import math
import os
import signal
import threading
import time

import pytest

from pipeline.status import live_workers
from pipeline.streams import DETOKENIZERS, SCHEDULERS, Keys
from tests.faults.clients import prompts, report, stream_many

CHAOS_S = float(os.environ.get("PIPELINE_TEST_CHAOS_S", "20"))
STREAMS = 12  # each wave's, half through each api
TOKENS = 40
EVERY_S = 4.0  # between two acts of chaos
# between two scheduler deaths, at least: over half the request timeout, so that no
# request lives through three, which make it poison (as a request that kills its
# schedulers is)
SCHEDULER_EVERY_S = 50.0
TIMEOUT_S = 90


class Chaos:
    """The acts, in turn, on their own thread: a scheduler killed and another
    started, a detokenizer the same, an api stopped for 3 s (its TTL is 2), every
    Redis client connection killed."""

    def __init__(self, tier, redis):
        self.tier, self.redis = tier, redis
        self.counts = {"scheduler": 0, "detokenizer": 0, "api stalled": 0, "connections": 0}
        self.stop = threading.Event()
        self.last_scheduler_death = -math.inf

    def run(self, until: float) -> None:
        acts = itertools.cycle([self.replace_scheduler, self.replace_detokenizer,
                                self.stall_api, self.kill_connections])
        while not self.stop.wait(EVERY_S) and time.monotonic() < until:
            next(acts)()

    def _replace(self, role: str) -> None:
        victim = next(p for p in self.tier.procs if p.args[5] == role and p.poll() is None)
        os.kill(victim.pid, signal.SIGKILL)
        victim.wait()
        self.tier.procs.remove(victim)
        self.tier.start(role)
        self.counts[role] += 1

    def replace_scheduler(self) -> None:
        """Only while two serve (a replacement still loading its model is no victim)
        and SCHEDULER_EVERY_S after the last."""
        serving = [w for w in live_workers(self.tier.redis_url, self.tier.prefix)
                   if w["role"] == "scheduler"]
        if len(serving) >= 2 and time.monotonic() - self.last_scheduler_death > SCHEDULER_EVERY_S:
            self._replace("scheduler")
            self.last_scheduler_death = time.monotonic()

    def replace_detokenizer(self) -> None:
        self._replace("detokenizer")

    def stall_api(self) -> None:
        api = next(p for p in self.tier.procs if p.args[5] == "api")
        api.send_signal(signal.SIGSTOP)
        time.sleep(3)
        api.send_signal(signal.SIGCONT)
        self.counts["api stalled"] += 1

    def kill_connections(self) -> None:
        self.redis.client_kill_filter(_type="normal", skipme=True)
        self.counts["connections"] += 1


def _leftovers(tier, redis) -> dict:
    """What a clean tier holds no more of: pending entries, consumers of no live
    worker, dead letters."""
    keys = Keys(tier.prefix)
    live = {w["id"] for w in live_workers(tier.redis_url, tier.prefix)}
    pending, strangers = 0, set()
    for stream, group in [*((lane, SCHEDULERS) for lane in keys.lanes),
                          (keys.tokens, DETOKENIZERS)]:
        if not redis.exists(stream):
            continue
        for consumer in redis.xinfo_consumers(stream, group):
            pending += consumer["pending"]
            name = consumer["name"]
            strangers |= {name.decode() if isinstance(name, bytes) else name} - live
    return {"pending": pending, "dead_consumers": sorted(strangers),
            "dead_letters": redis.xlen(keys.dead_letters)}


@pytest.mark.timeout(CHAOS_S + 240)  # set-up, the reference, the last wave, the settling
def test_chaos_under_load_loses_repeats_and_leaves_nothing(own_redis7, make_tier):
    tier = make_tier(own_redis7.url, **{"max-running-requests": "8",
                                        "request-timeout": str(TIMEOUT_S)})
    for role in ("scheduler", "scheduler", "detokenizer", "detokenizer"):
        tier.start(role)
    urls = [tier.start_api(), tier.start_api()]
    tier.wait_ready(schedulers=2, detokenizers=2)
    texts = prompts(STREAMS)
    reference = asyncio.run(stream_many(urls[0], texts, TOKENS))
    assert all(o.finish == "length" for o in reference)
    redis = own_redis7.client()
    chaos = Chaos(tier, redis)

    async def wave() -> list:
        half = STREAMS // 2
        front, back = await asyncio.gather(stream_many(urls[0], texts[:half], TOKENS),
                                           stream_many(urls[1], texts[half:], TOKENS))
        return front + back

    async def traffic() -> list[list]:
        waves = []
        deadline = time.monotonic() + CHAOS_S
        while time.monotonic() < deadline:
            waves.append(await wave())
        return waves

    acting = threading.Thread(target=chaos.run, args=(time.monotonic() + CHAOS_S,))
    acting.start()
    try:
        waves = asyncio.run(traffic())
    finally:
        chaos.stop.set()
        acting.join()
    figures = [report(f"chaos wave {i}", reference, got) for i, got in enumerate(waves)]
    print(f"\n[chaos] {len(waves)} waves of {STREAMS} streams in {CHAOS_S:g}s, acts: "
          f"{chaos.counts}")
    assert all(chaos.counts.values()), chaos.counts  # every act at least once
    errors = [(o.status, o.error, len(o.pieces)) for got in waves for o in got if o.finish is None]
    assert all(f["lost"] == 0 and f["differing"] == 0 for f in figures), (figures, errors)
    assert all(o.error is None and o.finish == "length" for got in waves for o in got)
    tier.wait_ready(schedulers=2, detokenizers=2)
    deadline = time.monotonic() + 30  # dead consumers are found a TTL on, then dropped
    while (left := _leftovers(tier, redis)) != {"pending": 0, "dead_consumers": [],
                                               "dead_letters": 0} and time.monotonic() < deadline:
        time.sleep(0.5)
    assert left == {"pending": 0, "dead_consumers": [], "dead_letters": 0}, left
