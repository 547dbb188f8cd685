# POST /v1/responses: OpenAI's Responses API. A request runs as the chat it amounts to
# (api/responses_input.py), after the stored conversation its previous_response_id names;
# its output comes back as Responses items: a reasoning item with a thinking model's
# thought, a message with the text, a function_call item each tool call
# (api/responses_output.py). Streamed, as Responses' typed events. Stored (unless `store`
# is false) for GET, DELETE and continuations (api/responses_store.py).

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Annotated

import msgspec
from fastapi import APIRouter, Depends, Request

from api.errors import as_pipeline_error
from api.openai_routes import chat_job, job_events
from api.protocol import ResponsesRequest
from api.responses import Job
from api.responses_background import UNFINISHED, cancel_asked, failed, stopped
from api.responses_events import EventLog, as_is, follow
from api.responses_input import input_items, responses_param, to_chat
from api.responses_output import Items, finished, shell, sse
from api.responses_store import Store, Stored, history, with_ids
from api.responses_stored import store_of
from api.served import Served, served
from api.streaming import Choice, Event, EventStream, collect, collect_until, started, until
from api.tools import OutputReader
from pipeline.errors import InvalidRequest, PipelineError
from pipeline.tokenizer import Tokenizer

router = APIRouter()
ServedDep = Annotated[Served, Depends(served)]


@router.post("/v1/responses")
async def create_response(body: ResponsesRequest, request: Request, s: ServedDep):
    store = store_of(s)
    try:
        context = history(await _previous(body, store))
        job = chat_job(to_chat(body, context), s)
        job = dataclasses.replace(job, response_id=f"resp_{uuid.uuid4().hex}")
        # what a continuation of it starts from, less its output; None: not stored
        keep = with_ids(context + input_items(body)) \
            if body.store is not False and store.ttl_s > 0 else None
        if body.background:
            return await _in_background(job, body, store, keep, s)
        events = job_events(job, body.stream, s)
        if body.stream:
            return EventStream(_events(job, body, await started(events), s.tokenizer,
                                       store, keep), encode=sse)
        [choice] = await collect(request, events, 1)
    except PipelineError as error:
        raise responses_param(error) from None
    return await _kept(store, keep, finished(job, body, choice, s.tokenizer,
                                              stored=keep is not None))


async def _previous(body: ResponsesRequest, store: Store) -> Stored | None:
    if body.previous_response_id is None:
        return None
    if store.ttl_s <= 0:
        raise InvalidRequest("this server stores no responses (--response-ttl-s 0): send "
                             "the whole conversation in input", param="previous_response_id")
    previous = await store.get(body.previous_response_id, param="previous_response_id")
    if previous.response["status"] in UNFINISHED:
        raise InvalidRequest(f"the response {body.previous_response_id!r} has not ended yet "
                             "(a background one: poll it)", param="previous_response_id")
    return previous


async def _in_background(job: Job, body: ResponsesRequest, store: Store,
                         keep: list[dict] | None, s: Served):
    """The response, queued, while it runs on (api/responses_background.py); streamed,
    its events as its log in Redis gives them, as a resumed stream's come
    (api/responses_events.py)."""
    if keep is None:
        raise InvalidRequest("a background response must be stored (store, and "
                             "--response-ttl-s above 0)", param="background")
    queued = shell(job, body, "queued", [], stored=True)
    stored = Stored(queued, keep, s.frontend.frontend_id, streamed=body.stream)
    await store.put(stored)
    s.background.start(_run_in_background(job, body, store, stored, s))
    if body.stream:
        return EventStream(follow(store, job.response_id), encode=as_is)
    return queued


async def _run_in_background(job: Job, body: ResponsesRequest, store: Store, stored: Stored,
                             s: Served) -> None:
    """Its generation, its record updated at its start and at its end: completed or
    incomplete, failed with its error, or cancelled. Streamed, each event also goes to
    its log, the last one included however it ends."""
    log, ended = EventLog(store, job.response_id) if stored.streamed else None, None
    try:
        running = stored.response | {"status": "in_progress"}
        await store.put(msgspec.structs.replace(stored, response=running))
        if log is None:
            [choice] = await collect_until(job_events(job, False, s), 1,
                                           cancel_asked(store, job.response_id), "cancelled")
            ended = finished(job, body, choice, s.tokenizer, stored=True)
        else:  # _events stores its end itself
            await until(_logged(log, _events(job, body, job_events(job, True, s), s.tokenizer,
                                             store, stored.items, streamed=True)),
                        cancel_asked(store, job.response_id), "cancelled")
    except asyncio.CancelledError:  # the api is stopping
        await _ended(store, stored, log, stopped(stored.response))
        raise
    except Exception as error:  # PipelineErrors as they are; anything else is a bug
        error = as_pipeline_error(error)
        ended = (stored.response | {"status": "cancelled"} if error.code == "cancelled"
                 else failed(stored.response, error.code, error.detail))
    if ended is not None:
        await _ended(store, stored, log, ended)
    await store.redis.delete(store.cancel_key(job.response_id))


async def _ended(store: Store, stored: Stored, log: EventLog | None, response: dict) -> None:
    await store.put(msgspec.structs.replace(stored, response=response, owner=None))
    if log is not None:
        await log.end(response)


async def _logged(log: EventLog, events: AsyncIterator[dict]) -> None:
    async with aclosing(events):
        async for event in events:
            await log.add(event)


async def _kept(store: Store | None, keep: list[dict] | None, response: dict,
                streamed: bool = False) -> dict:
    """`response`, stored first with the items it answered where `keep` has them."""
    if keep is not None:
        await store.put(Stored(response, keep, streamed=streamed))
    return response


async def _events(job: Job, body: ResponsesRequest, events: AsyncIterator[Event],
                  tokenizer: Tokenizer, store: Store | None = None,
                  keep: list[dict] | None = None, streamed: bool = False
                  ) -> AsyncIterator[dict]:
    """`streamed`: a background response's, queued first."""
    numbers = itertools.count()

    def event(kind: str, **fields) -> dict:
        return {"type": kind, "sequence_number": next(numbers), **fields}

    opening = shell(job, body, "in_progress", [], stored=keep is not None)
    if streamed:
        queued = opening | {"status": "queued"}
        yield event("response.created", response=queued)
        yield event("response.queued", response=queued)
    else:
        yield event("response.created", response=opening)
    yield event("response.in_progress", response=opening)
    reader, items, choice = OutputReader(job.tool_calls, job.reasoning), Items(event), Choice()
    async with aclosing(events):
        async for _index, delta in events:
            choice.add(delta)
            thought, told = reader.read(delta.text, last=delta.finish is not None)
            items.thought(thought)
            said = items.text(told.content) if told.content else []
            for piece in told.calls:
                said += items.call(piece)
            for each in said:
                yield each
    for each in items.close():
        yield each
    whole = await _kept(store, keep, finished(job, body, choice, tokenizer, items.done,
                                               stored=keep is not None), streamed)
    kind = "response.incomplete" if whole["status"] == "incomplete" else "response.completed"
    yield event(kind, response=whole)
