"""The scheduler's loop in this process: the real engine and a real Redis."""

from __future__ import annotations

import asyncio
import json
import logging
from concurrent.futures import ThreadPoolExecutor

import msgspec

from pipeline.config import Config, RedisConfig, SchedulerConfig
from pipeline.messages import FIELD, Sampling, Structure, Submit, tokens_decoder
from pipeline.streams import Keys, StreamClient
from pipeline.tokenizer import Tokenizer
from workers.scheduler.engine import Engine
from workers.scheduler.loop import PULL_EVERY_S, Scheduler


def submit(request_id: str, num_tokens: int) -> Submit:
    return Submit(request_id=request_id, reply_to="nobody", prompt_ids=[
        1000 + i % 700 for i in range(num_tokens)], sampling=Sampling(max_tokens=4))


def run_scenario(config: Config, engine: Engine, model_files, client: StreamClient, scenario):
    """`scenario(scheduler)` to its end, on a scheduler of `engine` in this process;
    then the test's client and the scheduler's are closed."""
    async def main():
        scheduler = Scheduler(config, engine, Tokenizer(model_files.path), thread)
        try:
            return await scenario(scheduler)
        finally:
            await client.close()
            await scheduler.client.close()

    with ThreadPoolExecutor(1) as thread:
        return asyncio.run(main())


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

    arrived_s, step_s, joined = run_scenario(config, engine, model_files, client, steps)
    # the check means something only if the step outlasted the arrival and a pull after it
    assert step_s > arrived_s + 2 * PULL_EVERY_S, (arrived_s, step_s)
    assert joined


def slow_schema(num_properties: int) -> str:
    """A schema whose grammar takes a while to compile: many patterned strings (50:
    ~1 s on a Zen 4 core)."""
    return json.dumps({"type": "object", "required": [f"p{i}" for i in range(num_properties)],
                       "properties": {f"p{i}": {"type": "string",
                                                "pattern": f"[a-z]{{{i % 7 + 1},{i % 13 + 20}}}x"}
                                      for i in range(num_properties)}})


def structured(request_id: str, schema: str) -> Submit:
    sampling = Sampling(max_tokens=3, structure=Structure(kind="json_schema", schema=schema))
    return msgspec.structs.replace(submit(request_id, 20), sampling=sampling)


async def steps_while(scheduler: Scheduler, going) -> None:
    for _ in range(3000):  # a hang fails here, not at the suite's timeout
        if not going():
            return
        await scheduler.step()
    raise AssertionError("the scheduler never got there")


def test_a_grammar_compiles_beside_the_steps_and_within_its_limit(redis_url, prefix, model_files):
    """A structured request whose grammar takes a while to compile waits for it on its
    own thread: a plain request that came after it runs to its end meanwhile. Once
    compiled it runs; a grammar that outlasts the limit is refused, naming its field."""
    config = Config(model=str(model_files.path), redis=RedisConfig(
        url=redis_url, prefix=prefix, heartbeat_s=600.0, alive_ttl_s=1800.0))
    engine = Engine(model_files.path, SchedulerConfig())
    keys, client = Keys(prefix), StreamClient(redis_url)
    engine.grammars.compiler()  # the tokenizer's load, out of the way

    async def scenario(scheduler: Scheduler) -> tuple[bool, list, list]:
        await scheduler.join()
        await client.add(keys.requests, structured("slow", slow_schema(50)))
        await client.add(keys.requests, submit("plain", 20))
        await steps_while(scheduler, lambda: "plain" in scheduler.running
                          or not scheduler.running)
        overtaken = "slow" in scheduler.compiling
        await steps_while(scheduler, lambda: scheduler.running)
        scheduler.compile_limit_s = 0.05
        await client.add(keys.requests, structured("slower", slow_schema(60)))
        await steps_while(scheduler, lambda: not scheduler.running)
        await steps_while(scheduler, lambda: scheduler.running)
        await scheduler.exchange()
        return overtaken, *await sent(keys, client)

    overtaken, failures, outputs = run_scenario(config, engine, model_files, client, scenario)
    assert overtaken
    assert {(o.request_id, o.finish) for o in outputs if o.finish} == {
        ("plain", "length"), ("slow", "length")}
    [failed] = failures
    assert (failed.request_id, failed.code, failed.param) == (
        "slower", "invalid_request", "response_format")
    assert "did not compile within 0.05 s" in failed.detail


def test_a_slow_grammar_holds_back_no_other_request(redis_url, prefix, model_files):
    """Requests whose schema came after a slow one's are not refused for its compile:
    the limit counts from each compile's own start, and a compile past it leaves its
    thread to a fresh one. Two requests with one schema share its compile; the slow
    schema asked again is refused at once."""
    config = Config(model=str(model_files.path), redis=RedisConfig(
        url=redis_url, prefix=prefix, heartbeat_s=600.0, alive_ttl_s=1800.0),
        scheduler=SchedulerConfig(grammar_timeout_s=1.0))
    engine = Engine(model_files.path, SchedulerConfig())
    keys, client = Keys(prefix), StreamClient(redis_url)
    engine.grammars.compiler()  # the tokenizer's load, out of the way
    quick = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}})

    async def scenario(scheduler: Scheduler) -> tuple[list, list, bool]:
        await scheduler.join()
        for request_id, schema in (("slow", slow_schema(200)), ("quick", quick),
                                   ("quick too", quick)):
            await client.add(keys.requests, structured(request_id, schema))
        await steps_while(scheduler, lambda: len(scheduler.running) < 3)
        await steps_while(scheduler, lambda: scheduler.running)
        await client.add(keys.requests, structured("slow again", slow_schema(200)))
        await scheduler.step()
        refused_at_once = not scheduler.running and not scheduler.compiling
        await scheduler.exchange()
        return *await sent(keys, client), refused_at_once

    failures, outputs, refused_at_once = run_scenario(config, engine, model_files, client,
                                                      scenario)
    assert sorted(o.request_id for o in outputs if o.finish in ("length", "stop")) == [
        "quick", "quick too"]  # ("stop": its JSON whole within 3 tokens)
    assert sorted(f.request_id for f in failures) == ["slow", "slow again"]
    assert all(f.param == "response_format" and "did not compile within 1 s" in f.detail
               for f in failures)
    assert refused_at_once


def test_requests_run_by_service_tier_then_by_arrival(redis_url, prefix, model_files):
    """With room for one request at a time, queued requests start most urgent tier
    first, each tier's in arrival order: a lane is pulled only once the lanes before
    it are empty."""
    config = Config(model=str(model_files.path), redis=RedisConfig(
        url=redis_url, prefix=prefix, heartbeat_s=600.0, alive_ttl_s=1800.0))
    engine = Engine(model_files.path, SchedulerConfig(max_running_requests=1))
    keys, client = Keys(prefix), StreamClient(redis_url)
    arrivals = [("flex 1", "flex"), ("default 1", "default"), ("priority 1", "priority"),
                ("flex 2", "flex"), ("priority 2", "priority"), ("default 2", "default")]

    async def scenario(scheduler: Scheduler) -> list[str]:
        await scheduler.join()
        for request_id, tier in arrivals:
            await client.add(keys.lane(tier), submit(request_id, 20))
        for _ in range(3000):  # a hang fails here, not at the suite's timeout
            await scheduler.step()
            if len(order := await finished(keys, client)) == len(arrivals):
                return order
        raise AssertionError("the scheduler never got there")

    order = run_scenario(config, engine, model_files, client, scenario)
    assert order == ["priority 1", "priority 2", "default 1", "default 2", "flex 1", "flex 2"]


async def sent(keys: Keys, client: StreamClient) -> tuple[list, list]:
    """What schedulers put on the tokens stream: its failures, its outputs."""
    entries = await client.redis.xrange(keys.tokens)
    batches = [tokens_decoder.decode(fields[FIELD]) for _, fields in entries]
    return [f for b in batches for f in b.failures], [o for b in batches for o in b.outputs]


async def finished(keys: Keys, client: StreamClient) -> list[str]:
    """The requests whose last tokens are on the tokens stream, in the order they ended."""
    _, outputs = await sent(keys, client)
    return [o.request_id for o in outputs if o.finish]


def test_a_refusal_is_logged_with_the_requests_own_id(redis_url, prefix, model_files, caplog):
    """A scheduler's log record about a request it refuses carries the id its api
    logged it under (Submit.trace_id: the client's x-request-id)."""
    config = Config(model=str(model_files.path), redis=RedisConfig(
        url=redis_url, prefix=prefix, heartbeat_s=600.0, alive_ttl_s=1800.0))
    engine = Engine(model_files.path, SchedulerConfig())
    keys, client = Keys(prefix), StreamClient(redis_url)
    impossible = msgspec.structs.replace(submit("r1", 4), prompt_ids=[10**9],
                                         trace_id="trace-7")

    async def scenario(scheduler: Scheduler) -> list:
        await scheduler.join()
        await client.add(keys.requests, impossible)
        await scheduler.step()
        await scheduler.exchange()
        failures, _ = await sent(keys, client)
        return failures

    with caplog.at_level(logging.INFO, logger="pipeline.scheduler"):
        [failed] = run_scenario(config, engine, model_files, client, scenario)
    assert failed.code == "invalid_request"
    [record] = [r for r in caplog.records if "refused r1" in r.getMessage()]
    assert record.request_id == "trace-7"


def test_a_priority_request_takes_a_running_default_ones_slot(redis_url, prefix, model_files):
    """Every slot is taken by a default request: a priority one is still pulled, runs
    at once in its place and finishes first; the default one is preempted and then
    finishes whole. A flex request finds no room and waits its turn."""
    config = Config(model=str(model_files.path), redis=RedisConfig(
        url=redis_url, prefix=prefix, heartbeat_s=600.0, alive_ttl_s=1800.0))
    engine = Engine(model_files.path, SchedulerConfig(max_running_requests=1))
    keys, client = Keys(prefix), StreamClient(redis_url)
    long = msgspec.structs.replace(submit("default", 20), sampling=Sampling(max_tokens=40))

    async def scenario(scheduler: Scheduler) -> tuple[list, list]:
        await scheduler.join()
        await client.add(keys.lane("default"), long)
        await steps_while(scheduler, lambda: len(engine.batcher.running) == 0)
        await scheduler.step()  # its first decodes
        await client.add(keys.lane("flex"), submit("flex", 20))
        await client.add(keys.lane("priority"), submit("priority", 20))
        await scheduler.step()
        await scheduler.step()
        ran = [seq.request_id for seq in engine.batcher.running]
        for _ in range(3000):  # a hang fails here, not at the suite's timeout
            await scheduler.step()
            if len(await finished(keys, client)) == 3:
                return ran, (await sent(keys, client))[1]
        raise AssertionError("the scheduler never got there")

    ran, outputs = run_scenario(config, engine, model_files, client, scenario)
    assert ran == ["priority"]
    assert [o.request_id for o in outputs if o.finish] == ["priority", "default", "flex"]
    default = [i for o in outputs if o.request_id == "default" for i in o.new_ids]
    assert len(default) == 40
    assert engine.batcher.num_preemptions == 1
