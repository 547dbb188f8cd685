# POST /v1/responses: OpenAI's Responses API. A request runs as the chat it amounts to
# (api/responses_input.py), after the stored conversation its previous_response_id names;
# its output comes back as Responses items: a reasoning item with a thinking model's
# thought, a message with the text, a function_call item each tool call. Streamed, as
# Responses' typed events. Stored (unless `store` is false) for GET, DELETE and
# continuations (api/responses_store.py).

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from typing import Annotated

import msgspec
from fastapi import APIRouter, Depends, Request

from api.errors import as_pipeline_error
from api.openai_routes import chat_job, job_events
from api.protocol import ResponsesRequest
from api.responses import Job
from api.responses_background import UNFINISHED, cancel_asked, failed, stopped
from api.responses_input import input_items, responses_param, to_chat
from api.responses_store import Store, Stored, history, with_ids
from api.responses_stored import store_of
from api.served import Served, served
from api.streaming import Choice, Event, EventStream, collect, collect_until, started
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
                                       store, keep), encode=_sse)
        [choice] = await collect(request, events, 1)
    except PipelineError as error:
        raise responses_param(error) from None
    return await _kept(store, keep, _finished(job, body, choice, s.tokenizer,
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
                         keep: list[dict] | None, s: Served) -> dict:
    """The response, queued; it runs on (api/responses_background.py)."""
    if body.stream:
        raise InvalidRequest("a background response is not streamed here: poll GET "
                             "/v1/responses/{id}", param="stream")
    if keep is None:
        raise InvalidRequest("a background response must be stored (store, and "
                             "--response-ttl-s above 0)", param="background")
    queued = _shell(job, body, "queued", [], stored=True)
    owner = s.frontend.frontend_id
    await store.put(Stored(queued, keep, owner))
    s.background.start(_run_in_background(job, body, store, Stored(queued, keep, owner), s))
    return queued


async def _run_in_background(job: Job, body: ResponsesRequest, store: Store, stored: Stored,
                             s: Served) -> None:
    """Its generation, its record updated at its start and at its end: completed or
    incomplete, failed with its error, or cancelled."""
    try:
        await store.put(Stored(stored.response | {"status": "in_progress"}, stored.items,
                               stored.owner))
        [choice] = await collect_until(job_events(job, False, s), 1,
                                       cancel_asked(store, job.response_id), "cancelled")
        ended = _finished(job, body, choice, s.tokenizer, stored=True)
    except asyncio.CancelledError:  # the api is stopping
        await store.put(Stored(stopped(stored.response), stored.items))
        raise
    except Exception as error:  # PipelineErrors as they are; anything else is a bug
        error = as_pipeline_error(error)
        ended = (stored.response | {"status": "cancelled"} if error.code == "cancelled"
                 else failed(stored.response, error.code, error.detail))
    await store.put(Stored(ended, stored.items))
    await store.redis.delete(store.cancel_key(job.response_id))


async def _kept(store: Store | None, keep: list[dict] | None, response: dict) -> dict:
    """`response`, stored first with the items it answered where `keep` has them."""
    if keep is not None:
        await store.put(Stored(response, keep))
    return response


def _shell(job: Job, body: ResponsesRequest, status: str, output: list, usage=None,
           finish: str | None = None, stored: bool = False) -> dict:
    return {"id": job.response_id, "object": "response", "created_at": job.created,
            "status": status, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if finish == "length" else None,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "model": job.model, "output": output, "parallel_tool_calls": body.parallel_tool_calls,
            "temperature": body.temperature, "top_p": body.top_p,
            "tool_choice": body.tool_choice or "auto", "tools": body.tools or [],
            "text": body.text or {"format": {"type": "text"}}, "usage": usage,
            "metadata": body.metadata or {}, "store": stored, "background": bool(body.background),
            "previous_response_id": body.previous_response_id,
            "service_tier": job.service_tier}


def _finished(job: Job, body: ResponsesRequest, choice: Choice, tokenizer: Tokenizer,
              output: list | None = None, stored: bool = False):
    """The whole response: `output` as streamed, or made from the choice's text."""
    if output is None:
        reader = OutputReader(job.tool_calls, job.reasoning)
        reader.read(choice.text, last=True)
        output = [_reasoning(_id("rs"), reader.thought)] if reader.thought else []
        if reader.content or not reader.calls:
            output.append(_message(_id("msg"), reader.content, "completed"))
        output += [_call(_id("fc"), call, "completed") for call in reader.calls]
    usage = job.usage([choice], tokenizer)
    usage = {"input_tokens": usage["prompt_tokens"],
             "input_tokens_details": usage["prompt_tokens_details"],
             "output_tokens": usage["completion_tokens"],
             "output_tokens_details": usage["completion_tokens_details"],
             "total_tokens": usage["total_tokens"]}
    status = "incomplete" if choice.finish == "length" else "completed"
    return _shell(job, body, status, output, usage, choice.finish, stored)


def _message(item_id: str, text: str, status: str) -> dict:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [] if status == "in_progress" else [_text_part(text)]}


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _call(item_id: str, call: dict, status: str) -> dict:
    return {"type": "function_call", "id": item_id, "call_id": call["id"],
            "name": call["function"]["name"], "arguments": call["function"]["arguments"],
            "status": status}


def _reasoning(item_id: str, thought: str) -> dict:
    return {"type": "reasoning", "id": item_id, "summary": [], "status": "completed",
            "content": [{"type": "reasoning_text", "text": thought}]}


def _id(kind: str) -> str:
    return f"{kind}_{uuid.uuid4().hex}"


class _Items:
    """The stream's output items as they open, grow and close, each change an event."""

    def __init__(self, event: Callable[..., dict]):
        self.event, self.done, self.open = event, [], None  # open: [kind, id, text, call]
        self.thinking = ""  # a thought not yet given out: it goes whole, as one item

    def thought(self, piece: str) -> None:
        self.thinking += piece

    def _thought_item(self) -> list[dict]:
        if not self.thinking:
            return []
        item, self.thinking = _reasoning(_id("rs"), self.thinking), ""
        self.done.append(item)
        return [self.event(kind, output_index=len(self.done) - 1, item=item)
                for kind in ("response.output_item.added", "response.output_item.done")]

    def text(self, piece: str) -> list[dict]:
        events = [] if self.open and self.open[0] == "message" else self._start("message")
        self.open[2] += piece
        return events + [self.event("response.output_text.delta", **self._at(),
                                    content_index=0, delta=piece, logprobs=[])]

    def call(self, piece: dict) -> list[dict]:
        events = []
        if "id" in piece:  # a call's first piece: its id and name
            call = {"id": piece["id"], "function": {"name": piece["function"]["name"],
                                                    "arguments": ""}}
            events = self._start("function_call", call)
        if arguments := piece["function"]["arguments"]:
            self.open[2] += arguments
            events.append(self.event("response.function_call_arguments.delta", **self._at(),
                                     delta=arguments))
        return events

    def close(self) -> list[dict]:
        if self.open is None:
            return self._thought_item()
        kind, item_id, text, call = self.open
        if kind == "message":
            item = _message(item_id, text, "completed")
            events = [self.event("response.output_text.done", **self._at(), content_index=0,
                                 text=text, logprobs=[]),
                      self.event("response.content_part.done", **self._at(), content_index=0,
                                 part=_text_part(text))]
        else:
            call["function"]["arguments"] = text
            item = _call(item_id, call, "completed")
            events = [self.event("response.function_call_arguments.done", **self._at(),
                                 arguments=text)]
        events.append(self.event("response.output_item.done", output_index=len(self.done),
                                 item=item))
        self.done.append(item)
        self.open = None
        return events

    def _start(self, kind: str, call: dict | None = None) -> list[dict]:
        events = self.close() + self._thought_item()
        item_id = _id("msg" if kind == "message" else "fc")
        self.open = [kind, item_id, "", call]
        item = _message(item_id, "", "in_progress") if call is None else \
            _call(item_id, call, "in_progress")
        events.append(self.event("response.output_item.added", output_index=len(self.done),
                                 item=item))
        if kind == "message":
            events.append(self.event("response.content_part.added", **self._at(),
                                     content_index=0, part=_text_part("")))
        return events

    def _at(self) -> dict:
        return {"item_id": self.open[1], "output_index": len(self.done)}


async def _events(job: Job, body: ResponsesRequest, events: AsyncIterator[Event],
                  tokenizer: Tokenizer, store: Store | None = None,
                  keep: list[dict] | None = None) -> AsyncIterator[dict]:
    numbers = itertools.count()

    def event(kind: str, **fields) -> dict:
        return {"type": kind, "sequence_number": next(numbers), **fields}

    opening = _shell(job, body, "in_progress", [], stored=keep is not None)
    yield event("response.created", response=opening)
    yield event("response.in_progress", response=opening)
    reader, items, choice = OutputReader(job.tool_calls, job.reasoning), _Items(event), Choice()
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
    whole = await _kept(store, keep, _finished(job, body, choice, tokenizer, items.done,
                                               stored=keep is not None))
    kind = "response.incomplete" if whole["status"] == "incomplete" else "response.completed"
    yield event(kind, response=whole)


async def _sse(chunks: AsyncIterator[dict]) -> AsyncIterator[bytes]:
    """Responses' SSE: each event named by its type; a failure after the 200 is an
    `error` event. No [DONE]: the completed (or incomplete) event ends the stream."""
    number = 0
    try:
        async with aclosing(chunks):
            async for chunk in chunks:
                number = chunk["sequence_number"] + 1
                yield _sse_event(chunk)
    except Exception as error:  # the 200 is already sent: report in-band
        failure = responses_param(as_pipeline_error(error))
        yield _sse_event({"type": "error", "sequence_number": number, "code": failure.code,
                          "message": failure.detail, "param": failure.param})


def _sse_event(chunk: dict) -> bytes:
    return b"event: %s\ndata: %s\n\n" % (chunk["type"].encode(), msgspec.json.encode(chunk))
