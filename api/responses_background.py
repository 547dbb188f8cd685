# Background responses (the Responses API's `background: true`): the api answers at once
# with the response "queued" and runs it on a task of its own, its stored record showing
# its progress ("in_progress", then completed, incomplete, failed or cancelled) to a client
# polling GET /v1/responses/{id} on any api. A cancel (POST .../cancel, on any api) is a
# flag in Redis that the running api reads twice a second. The record names the api that
# runs it, so a reader finds a response whose api died "failed", not in progress forever.
# At shutdown an api waits for its background responses as long as it drains
# (--drain-timeout-s), then stops the rest, each recorded as failed.

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Coroutine

from api.responses_store import Store, Stored
from api.streaming import cancel_and_wait

CANCEL_POLL_S = 0.5  # how often a running background response looks for its cancel
UNFINISHED = ("queued", "in_progress")
STOP_WAIT_S = 2.0  # for a cancelled background response to record its failure


class Background:
    """The background responses this api runs, as tasks."""

    def __init__(self):
        self.tasks: set[asyncio.Task] = set()

    def start(self, work: Coroutine) -> None:
        task = asyncio.create_task(work)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def stop(self, timeout_s: float) -> None:
        """Waits for them `timeout_s` at most, then cancels the rest: once, so that
        each records its failure (a second cancel could cut that write), then again
        until they are gone."""
        if self.tasks:
            await asyncio.wait(set(self.tasks), timeout=timeout_s)
        for task in self.tasks:
            task.cancel()
        if self.tasks:
            await asyncio.wait(set(self.tasks), timeout=STOP_WAIT_S)
        await cancel_and_wait(list(self.tasks))


async def cancel_asked(store: Store, response_id: str) -> None:
    """Returns once a cancel of `response_id` has been asked (POST .../cancel)."""
    while not await store.redis.exists(store.cancel_key(response_id)):
        await asyncio.sleep(CANCEL_POLL_S)


async def as_now(store: Store, stored: Stored) -> Stored:
    """`stored` as it stands: an unfinished response whose api is gone is failed."""
    if stored.response["status"] not in UNFINISHED or stored.owner is None:
        return stored
    if await store.redis.exists(store.keys.alive("api", stored.owner)):
        return stored
    return Stored(stopped(stored.response), stored.items)


def failed(response: dict, code: str, message: str) -> dict:
    return response | {"status": "failed", "error": {"code": code, "message": message}}


def stopped(response: dict) -> dict:
    """`response` failed because the api running it stopped (or died) first."""
    return failed(response, "server_error", "the api running this response stopped "
                  "before it ended")


async def cancel(store: Store, response_id: str, wait_s: float = 5.0) -> dict:
    """Asks the api running `response_id` to stop it; the response once it has ended
    (`wait_s` at most), or at once if it ended before or its api is gone."""
    stored = await as_now(store, await store.get(response_id))
    if stored.response["status"] not in UNFINISHED:
        return stored.response
    await store.redis.set(store.cancel_key(response_id), b"1", px=int(store.ttl_s * 1000))
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(wait_s):
            while stored.response["status"] in UNFINISHED:
                await asyncio.sleep(CANCEL_POLL_S / 2)
                stored = await as_now(store, await store.get(response_id))
    return stored.response
