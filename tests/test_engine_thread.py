"""EngineThread: the real engine stepping on its own thread while an event loop
queues admissions and aborts and reads each step's results."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import pytest

from pipeline.config import SchedulerConfig
from pipeline.errors import ContextLengthExceeded
from pipeline.messages import Sampling
from workers.scheduler.engine import Engine, EngineRequest
from workers.scheduler.engine_thread import EngineThread, Stepped


@pytest.fixture(scope="module")
def engine(model_files) -> Engine:
    return Engine(model_files.path, SchedulerConfig(dtype="float32", max_running_requests=4))


def request(request_id: str, max_tokens: int) -> EngineRequest:
    return EngineRequest(request_id, [1, 2, 3, 4 + len(request_id)], [],
                         Sampling(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))


async def drain(stepping: EngineThread) -> list[Stepped]:
    """Every step's results until the engine has nothing left to do."""
    steps = []
    while stepping.is_busy():
        steps.append(await asyncio.wait_for(stepping.next_results(), 30))
    return steps


def run(engine: Engine, scenario) -> object:
    async def main():
        with ThreadPoolExecutor(1) as thread:
            stepping = EngineThread(engine, thread)
            stepping.start()
            try:
                return await scenario(stepping)
            finally:
                stepping.stop()

    return asyncio.run(main())


def test_requests_run_to_their_end_with_tokens_in_step_order(engine):
    """What Engine.step gives when called in turn: the same tokens, each step's once."""
    expected = {}
    for request_id in ("a", "bb"):
        engine.add(request(request_id, 6))
    while engine.has_work():
        for result in engine.step():
            expected.setdefault(result.request_id, []).extend(result.new_ids)

    async def scenario(stepping):
        assert stepping.can_admit() == 4
        for request_id in ("a", "bb"):
            stepping.add(request(request_id, 6))
        got, finished = {}, set()
        for stepped in await drain(stepping):
            for result in stepped.results:
                got.setdefault(result.request_id, []).extend(result.new_ids)
                if result.finish is not None:
                    finished.add(result.request_id)
        return got, finished, stepping.can_admit()

    got, finished, room = run(engine, scenario)
    assert got == expected and all(len(ids) == 6 for ids in got.values())
    assert finished == {"a", "bb"} and room == 4


def test_an_abort_with_nothing_else_to_do_still_answers(engine):
    """A change that leaves the engine idle posts empty results: a loop that waits
    for results after queueing it is not left waiting forever."""
    async def scenario(stepping):
        stepping.add(request("long", 200))
        first = await asyncio.wait_for(stepping.next_results(), 30)
        stepping.abort("long")
        rest = await drain(stepping)
        return first, rest, stepping.is_busy(), stepping.can_admit()

    first, rest, busy, room = run(engine, scenario)
    assert [r.request_id for r in first.results] == ["long"]
    assert rest and rest[-1].results == [] and not busy and room == 4
    assert sum(len(s.results) for s in rest) < 199  # stopped long before its end


def test_results_of_steps_before_an_add_are_told_apart(engine):
    """A request re-added under the same id (a newer attempt) while the old one
    runs: steps that ran before the add carry fewer changes than its number."""
    async def scenario(stepping):
        stepping.add(request("r", 50))
        await asyncio.wait_for(stepping.next_results(), 30)
        stepping.abort("r")
        since = stepping.add(request("r", 3))
        return since, await drain(stepping)

    since, steps = run(engine, scenario)
    newer = [s for s in steps if s.num_changes >= since]
    assert [len(r.new_ids) for s in newer for r in s.results] == [1, 1, 1]
    assert newer[-1].results[-1].finish == "length"


def test_a_request_too_long_is_refused_at_once_in_the_callers_thread(engine):
    async def scenario(stepping):
        with pytest.raises(ContextLengthExceeded):
            stepping.add(request("huge", engine.max_context))
        return stepping.is_busy()

    assert run(engine, scenario) is False
