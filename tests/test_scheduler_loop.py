"""The scheduler's loop in this process: the real engine and a real Redis."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from pipeline.config import Config, RedisConfig, SchedulerConfig
from pipeline.messages import Sampling, Submit
from pipeline.streams import Keys, StreamClient
from pipeline.tokenizer import Tokenizer
from workers.scheduler.engine import Engine
from workers.scheduler.loop import PULL_EVERY_S, Scheduler


def submit(request_id: str, num_tokens: int) -> Submit:
    return Submit(request_id=request_id, reply_to="nobody", prompt_ids=[
        1000 + i % 700 for i in range(num_tokens)], sampling=Sampling(max_tokens=4))


def test_a_request_arriving_during_a_step_joins_right_after_it(redis_url, prefix, model_files):
    """The step's first read has passed when the second request arrives; a
    read while the engine still runs takes it, so it is running when the step
    ends, not a step later (as after long steps: prefill chunks here)."""
    # no upkeep between the steps: it would drop "long", whose frontend ("nobody")
    # is not alive, and its 1 s heartbeat passes within one 512-token chunk on a
    # slow host (2.5-3.4 s on an AMD Zen 1)
    config = Config(model=str(model_files.path), redis=RedisConfig(
        url=redis_url, prefix=prefix, heartbeat_s=600.0, alive_ttl_s=1800.0))
    engine = Engine(model_files.path, SchedulerConfig())
    keys, client = Keys(prefix), StreamClient(redis_url)

    async def scenario(scheduler: Scheduler) -> tuple[float, float, bool]:
        try:
            return await steps(scheduler)
        finally:
            await client.close()
            await scheduler.client.close()

    async def steps(scheduler: Scheduler) -> tuple[float, float, bool]:
        await scheduler.join()
        await client.add(keys.requests, submit("long", 3000))
        await scheduler.step()  # idle: takes it
        assert list(scheduler.running) == ["long"]
        await scheduler.step()  # its first 512-token chunk: the recent steps are long ones

        async def arrive_later() -> float:
            await asyncio.sleep(2 * PULL_EVERY_S)
            await client.add(keys.requests, submit("late", 20))
            return loop.time()

        loop = asyncio.get_running_loop()
        started = loop.time()
        arrived, _ = await asyncio.gather(arrive_later(), scheduler.step())  # a 512-token chunk
        ended = loop.time()
        return arrived - started, ended - started, "late" in scheduler.running

    with ThreadPoolExecutor(1) as thread:
        scheduler = Scheduler(config, engine, Tokenizer(model_files.path), thread)
        arrived_s, step_s, joined = asyncio.run(scenario(scheduler))
    # the check means something only if the step outlasted the arrival and a pull after it
    assert step_s > arrived_s + 2 * PULL_EVERY_S, (arrived_s, step_s)
    assert joined
