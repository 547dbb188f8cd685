# Running one HTTP request's n choices through the Frontend, merged into one ordered
# event stream, and serving it as SSE or collecting it whole. Route-shape agnostic.

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Coroutine
from contextlib import aclosing
from dataclasses import dataclass, field

import msgspec
from fastapi import Request
from fastapi.responses import StreamingResponse

from api.errors import sse_error
from api.frontend import Frontend
from pipeline.errors import error_from_code
from pipeline.messages import Delta, Sampling, TokenLogprob

Event = tuple[int, Delta]  # (choice index, its next delta)
Run = tuple[list[int], Sampling]  # one choice: its prompt's ids and its sampling
DONE = b"data: [DONE]\n\n"


@dataclass
class Choice:
    """One choice's output so far."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish: str | None = None
    prompt_logprobs: list[TokenLogprob] | None = None  # Sampling.prompt_logprobs'
    cached_tokens: int | None = None  # its prompt's, in the prefix cache of its first run

    def add(self, delta: Delta) -> None:
        self.text += delta.text
        self.token_ids.extend(delta.token_ids)
        self.logprobs.extend(delta.logprobs or [])
        self.finish = delta.finish
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        if self.cached_tokens is None:  # a continuation's scheduler found its own
            self.cached_tokens = delta.cached_tokens

    def prompt_entries(self, prompt_ids: list[int]) -> list[TokenLogprob | None]:
        """One a prompt token: None for the first (nothing comes before it) and for
        any whose logprob did not come."""
        known = [None, *(self.prompt_logprobs or [])][:len(prompt_ids)]
        return known + [None] * (len(prompt_ids) - len(known))


def per_choice(sampling: Sampling, n: int) -> list[Sampling]:
    """n independent runs; with a seed, choice i gets seed + i so they differ reproducibly."""
    if sampling.seed is None:
        return [sampling] * n
    return [msgspec.structs.replace(sampling, seed=sampling.seed + i) for i in range(n)]


async def choice_events(
    frontend: Frontend, runs: list[Run], request_id: str, timeout_s: float,
    stream_interval: int, service_tier: str = "default",
) -> AsyncIterator[Event]:
    """Every choice's deltas as they come (`stream_interval`, `service_tier`:
    Frontend.generate's);
    each choice's own deltas stay in order.
    The first failure of any choice is raised and the other choices are cancelled.
    One choice (n = 1, nearly every request) is read in the caller's task: no
    task or queue between the frontend and the response, a hop less a token."""
    if len(runs) == 1:
        deltas = frontend.generate(*runs[0], f"{request_id}-0", timeout_s, stream_interval,
                                   service_tier)
        async with aclosing(deltas):
            async for delta in deltas:
                yield 0, delta
        return
    queue: asyncio.Queue[tuple[int, Delta | BaseException | None]] = asyncio.Queue()

    async def run(index: int, prompt_ids: list[int], sampling: Sampling) -> None:
        try:
            async for delta in frontend.generate(prompt_ids, sampling, f"{request_id}-{index}",
                                                 timeout_s, stream_interval, service_tier):
                queue.put_nowait((index, delta))
        except Exception as error:  # handed to the consumer, which raises it
            queue.put_nowait((index, error))
        queue.put_nowait((index, None))

    tasks = [asyncio.create_task(run(i, *r)) for i, r in enumerate(runs)]
    try:
        num_running = len(tasks)
        while num_running:
            index, item = await queue.get()
            if item is None:
                num_running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        await cancel_and_wait(tasks)


async def started(events: AsyncIterator[Event]) -> AsyncIterator[Event]:
    """Wait for the first event before the 200 goes out, so that a request refused at
    once (overload, a scheduler's rejection) still gets its real HTTP status."""
    first = await anext(events)

    async def rest() -> AsyncIterator[Event]:
        async with aclosing(events):
            yield first
            async for event in events:
                yield event

    return rest()


async def collect(request: Request, events: AsyncIterator[Event], n: int) -> list[Choice]:
    """All choices, whole; stops the work (and so cancels it) if the client goes away."""
    return await collect_until(events, n, _disconnected(request), "the client disconnected")


async def collect_until(events: AsyncIterator[Event], n: int, stop: Coroutine,
                        why: str) -> list[Choice]:
    """All choices, whole, unless `stop` ends first: then the work is stopped (and so
    cancelled) and a `cancelled` error says `why`."""
    choices = [Choice() for _ in range(n)]

    async def fill() -> list[Choice]:
        async with aclosing(events):
            async for index, delta in events:
                choices[index].add(delta)
        return choices

    return await until(fill(), stop, why)


async def until(work: Coroutine, stop: Coroutine, why: str):
    """`work`'s result, unless `stop` ends first: then `work` is cancelled and a
    `cancelled` error says `why`."""
    work = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(stop)
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        if not work.done():
            raise error_from_code("cancelled", why)
        return work.result()
    finally:
        await cancel_and_wait([work, watch])


async def cancel_and_wait(tasks: list[asyncio.Future]) -> None:
    """Cancel until done: redis-py 8 lets a cancelled command finish and swallows the
    CancelledError, so one cancel() may leave a generate() waiting for deltas forever."""
    while pending := [task for task in tasks if not task.done()]:
        for task in pending:
            task.cancel()
        await asyncio.wait(pending, timeout=0.1)
    for task in tasks:  # retrieved, so asyncio does not log them as lost
        if not task.cancelled():
            task.exception()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def sse(chunks: AsyncIterator[dict]) -> AsyncIterator[bytes]:
    """`data: {json}` per chunk, an error event if the stream fails, then [DONE]."""
    try:
        async with aclosing(chunks):
            async for chunk in chunks:
                yield b"data: " + msgspec.json.encode(chunk) + b"\n\n"
    except Exception as error:  # the 200 is already sent: report in-band
        yield sse_error(error)
    yield DONE


class EventStream(StreamingResponse):
    """SSE whose generator is always closed when the response ends, however it ends
    (Starlette leaves it to the garbage collector when the client disconnects)."""

    media_type = "text/event-stream"

    def __init__(self, chunks: AsyncIterator[dict], encode=sse):
        """`encode`: chunks to the stream's bytes (`sse`: chat and completion chunks)."""
        super().__init__(encode(chunks), headers={"Cache-Control": "no-cache",
                                                  "X-Accel-Buffering": "no"})

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with contextlib.suppress(Exception):
                await self.body_iterator.aclose()
