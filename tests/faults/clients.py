"""Streaming clients for fault tests: many concurrent SSE requests, each
recording its pieces and how long it waited, so a test can count what was
lost, repeated or stalled."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import httpx


@dataclass
class Outcome:
    prompt: str
    pieces: list[str] = field(default_factory=list)
    finish: str | None = None
    error: dict | None = None
    status: int | None = None
    max_gap_s: float = 0.0

    @property
    def text(self) -> str:
        return "".join(self.pieces)


def completion_body(prompt: str, max_tokens: int = 32) -> dict:
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}


async def stream_one(client: httpx.AsyncClient, url: str, body: dict,
                     started: asyncio.Event | None = None) -> Outcome:
    outcome = Outcome(body["prompt"])
    last = time.monotonic()
    async with client.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as resp:
        outcome.status = resp.status_code
        if resp.status_code != 200:
            outcome.error = json.loads(await resp.aread()).get("error")
            return outcome
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            now = time.monotonic()
            outcome.max_gap_s, last = max(outcome.max_gap_s, now - last), now
            if "error" in event:
                outcome.error = event["error"]
                continue
            for choice in event["choices"]:
                outcome.pieces.append(choice["text"])
                outcome.finish = choice.get("finish_reason") or outcome.finish
            if started is not None and len(outcome.pieces) >= 3:
                started.set()
    return outcome


async def stream_many(url: str, prompts: list[str], max_tokens: int = 32,
                      started: asyncio.Event | None = None,
                      tiers: tuple[str, ...] = ()) -> list[Outcome]:
    """`tiers`: service tiers the prompts take in turn (none: the default)."""
    limits = httpx.Limits(max_connections=len(prompts) + 4)
    bodies = [completion_body(p, max_tokens) for p in prompts]
    for i, body in enumerate(bodies if tiers else []):
        body["service_tier"] = tiers[i % len(tiers)]
    async with httpx.AsyncClient(limits=limits) as client:
        return await asyncio.gather(*(stream_one(client, url, body, started)
                                      for body in bodies))


def prompts(n: int) -> list[str]:
    animals = ["cats", "dogs", "birds", "fish", "horses", "cows", "lions", "bears"]
    return [f"Here is a long story about {animals[i % 8]} number {i}:" for i in range(n)]


def report(name: str, reference: list[Outcome], got: list[Outcome], **extra) -> dict:
    lost = sum(1 for o in got if o.finish is None)
    wrong = sum(1 for r, o in zip(reference, got, strict=True) if o.finish and o.text != r.text)
    figures = {"requests": len(got), "lost": lost, "differing": wrong,
               "max_stall_s": round(max(o.max_gap_s for o in got), 2)} | extra
    print(f"\n[{name}] {json.dumps(figures)}")
    return figures


def hog_then_hasty(patient_url: str, hasty_url: str) -> tuple[httpx.Response, httpx.Response]:
    """A long request takes a scheduler's one slot (--max-running-requests 1) through
    `patient_url`; a second, a second later, waits behind it through `hasty_url`,
    whose --request-timeout is shorter: both responses. The hog outlasts the hasty
    request's deadline (2 s in) on the fastest host: 600 tokens take ~5 s at 8 ms a step."""
    long = {"prompt": "Count to a thousand:", "max_tokens": 600, "temperature": 0,
            "ignore_eos": True}
    short = {"prompt": "Hi", "max_tokens": 4, "temperature": 0}

    async def main():
        async with httpx.AsyncClient() as client:
            hog = asyncio.create_task(client.post(f"{patient_url}/v1/completions", json=long,
                                                  timeout=120))
            await asyncio.sleep(1.0)  # the one slot is taken
            waiting = await client.post(f"{hasty_url}/v1/completions", json=short, timeout=60)
            return await hog, waiting

    return asyncio.run(main())


def expired_requests(redis_url: str, prefix: str, at_least: int, timeout_s: float = 10) -> int:
    """The one scheduler's count of requests it pulled past their deadline, once it
    reaches `at_least` (its liveness record is a heartbeat late) or `timeout_s` passes."""
    from pipeline.status import live_workers

    deadline = time.monotonic() + timeout_s
    while True:
        [scheduler] = [w for w in live_workers(redis_url, prefix) if w["role"] == "scheduler"]
        if scheduler["num_expired"] >= at_least or time.monotonic() >= deadline:
            return scheduler["num_expired"]
        time.sleep(0.2)
