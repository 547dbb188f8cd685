# A streamed background response's events (the Responses API's `background` with
# `stream`), kept in Redis as a stream of their own, {prefix}:response:{id}:events, the
# event of sequence number n at entry 0-(n+1), for as long as the response's record. The
# api running the response appends each event as it makes it; a reader, on any api,
# replays those after its cursor (GET /v1/responses/{id}?stream=true&starting_after=n),
# then follows the new ones until the last. The POST that created it reads it the same
# way, so a client whose stream drops loses nothing: it picks it up again, anywhere.

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import aclosing

import msgspec

from api.errors import as_pipeline_error
from api.responses_background import UNFINISHED, as_now
from api.responses_output import sse_event
from api.responses_store import Store

LAST = {"completed": "response.completed", "incomplete": "response.incomplete",
        "failed": "response.failed", "cancelled": "response.cancelled"}  # by status
ENDS = {kind.encode() for kind in LAST.values()}
# A follower reads without blocking (it holds no connection of the api's pool between
# reads): after a read that found nothing it waits POLL_S, doubling to POLL_MAX_S while
# nothing comes, back to POLL_S once something does.
POLL_S, POLL_MAX_S = 0.025, 0.2
LOOK_S = 1.0  # how long a follower waits for an event before it looks at the record


def entry_id(number: int) -> str:
    return f"0-{number + 1}"


class EventLog:
    """The writer's side: the events of one response, appended in order."""

    def __init__(self, store: Store, response_id: str):
        self.redis, self.key = store.redis, store.events_key(response_id)
        self.ttl_ms = max(1, int(store.ttl_s * 1000))
        self.next = 0  # the sequence number the next event gets

    async def add(self, event: dict) -> None:
        """One event (its own sequence number), and the log's expiry pushed on."""
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.xadd(self.key, {"type": event["type"], "data": msgspec.json.encode(event)},
                      id=entry_id(event["sequence_number"]))
            pipe.pexpire(self.key, self.ttl_ms)
            await pipe.execute()
        self.next = event["sequence_number"] + 1

    async def end(self, response: dict) -> None:
        """The last event of a response that ended outside its events (an error, a
        cancel, its api stopping): the one its status names, with it whole."""
        await self.add({"type": LAST[response["status"]], "sequence_number": self.next,
                        "response": response})


async def follow(store: Store, response_id: str, after: int = -1) -> AsyncIterator[bytes]:
    """The response's events after sequence number `after` as SSE, then each new one as it
    comes, until its last. One that ended with no last event in its log (its api died)
    ends with the one its record names; a failure (the record deleted) is an `error` event."""
    key, cursor, late = store.events_key(response_id), entry_id(after), False
    waited, pause = 0.0, POLL_S
    try:
        while True:
            found = await store.redis.xread({key: cursor}, count=256)
            for at, fields in found[0][1] if found else []:
                yield b"event: %s\ndata: %s\n\n" % (fields[b"type"], fields[b"data"])
                if fields[b"type"] in ENDS:
                    return
                cursor = at.decode()
                waited, pause = 0.0, POLL_S
            if found:
                continue
            await asyncio.sleep(pause)
            waited, pause = waited + pause, min(2 * pause, POLL_MAX_S)
            if waited < LOOK_S:
                continue
            record = await store.get(response_id)
            stored = await as_now(store, record)
            status = stored.response["status"]
            # a record ends just before its last event is written: that gets one more
            # look, unless its api is gone (as_now failed it): then none will come
            if status not in UNFINISHED and (stored is not record or late):
                yield sse_event({"type": LAST[status], "sequence_number": _next(cursor),
                                 "response": stored.response})
                return
            late, waited = status not in UNFINISHED, 0.0
    except Exception as error:  # the 200 is already sent: report in-band
        failure = as_pipeline_error(error)
        yield sse_event({"type": "error", "sequence_number": _next(cursor),
                         "code": failure.code, "message": failure.detail, "param": None})


def _next(cursor: str) -> int:
    """The sequence number after the event at entry `cursor` (that of n is 0-(n+1))."""
    return int(cursor.split("-")[1])


async def as_is(events: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """EventStream's encoding of events already SSE."""
    async with aclosing(events):
        async for event in events:
            yield event
