# The Responses API's output (api/responses_api.py): the response object, its items (a
# reasoning item, a message, a function_call each tool call) whole or as they stream, and
# its typed SSE events.

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing

import msgspec

from api.errors import as_pipeline_error
from api.protocol import ResponsesRequest
from api.responses import Job
from api.responses_input import responses_param
from api.streaming import Choice
from api.tools import OutputReader
from pipeline.tokenizer import Tokenizer


def shell(job: Job, body: ResponsesRequest, status: str, output: list, usage=None,
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


def finished(job: Job, body: ResponsesRequest, choice: Choice, tokenizer: Tokenizer,
              output: list | None = None, stored: bool = False):
    """The whole response: `output` as streamed, or made from the choice's text."""
    if output is None:
        reader = OutputReader(job.tool_calls, job.reasoning)
        reader.read(choice.text, last=True)
        output = [reasoning_item(new_id("rs"), reader.thought)] if reader.thought else []
        if reader.content or not reader.calls:
            output.append(message(new_id("msg"), reader.content, "completed"))
        output += [call_item(new_id("fc"), call, "completed") for call in reader.calls]
    usage = job.usage([choice], tokenizer)
    usage = {"input_tokens": usage["prompt_tokens"],
             "input_tokens_details": usage["prompt_tokens_details"],
             "output_tokens": usage["completion_tokens"],
             "output_tokens_details": usage["completion_tokens_details"],
             "total_tokens": usage["total_tokens"]}
    status = "incomplete" if choice.finish == "length" else "completed"
    return shell(job, body, status, output, usage, choice.finish, stored)


def message(item_id: str, text: str, status: str) -> dict:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [] if status == "in_progress" else [text_part(text)]}


def text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def call_item(item_id: str, call: dict, status: str) -> dict:
    return {"type": "function_call", "id": item_id, "call_id": call["id"],
            "name": call["function"]["name"], "arguments": call["function"]["arguments"],
            "status": status}


def reasoning_item(item_id: str, thought: str) -> dict:
    return {"type": "reasoning", "id": item_id, "summary": [], "status": "completed",
            "content": [{"type": "reasoning_text", "text": thought}]}


def new_id(kind: str) -> str:
    return f"{kind}_{uuid.uuid4().hex}"


class Items:
    """The stream's output items as they open, grow and close, each change an event."""

    def __init__(self, event: Callable[..., dict]):
        self.event, self.done, self.open = event, [], None  # open: [kind, id, text, call]
        self.thinking = ""  # a thought not yet given out: it goes whole, as one item

    def thought(self, piece: str) -> None:
        self.thinking += piece

    def _thought_item(self) -> list[dict]:
        if not self.thinking:
            return []
        item, self.thinking = reasoning_item(new_id("rs"), self.thinking), ""
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
            item = message(item_id, text, "completed")
            events = [self.event("response.output_text.done", **self._at(), content_index=0,
                                 text=text, logprobs=[]),
                      self.event("response.content_part.done", **self._at(), content_index=0,
                                 part=text_part(text))]
        else:
            call["function"]["arguments"] = text
            item = call_item(item_id, call, "completed")
            events = [self.event("response.function_call_arguments.done", **self._at(),
                                 arguments=text)]
        events.append(self.event("response.output_item.done", output_index=len(self.done),
                                 item=item))
        self.done.append(item)
        self.open = None
        return events

    def _start(self, kind: str, call: dict | None = None) -> list[dict]:
        events = self.close() + self._thought_item()
        item_id = new_id("msg" if kind == "message" else "fc")
        self.open = [kind, item_id, "", call]
        item = message(item_id, "", "in_progress") if call is None else \
            call_item(item_id, call, "in_progress")
        events.append(self.event("response.output_item.added", output_index=len(self.done),
                                 item=item))
        if kind == "message":
            events.append(self.event("response.content_part.added", **self._at(),
                                     content_index=0, part=text_part("")))
        return events

    def _at(self) -> dict:
        return {"item_id": self.open[1], "output_index": len(self.done)}


async def sse(chunks: AsyncIterator[dict]) -> AsyncIterator[bytes]:
    """Responses' SSE: each event named by its type; a failure after the 200 is an
    `error` event. No [DONE]: the completed (or incomplete) event ends the stream."""
    number = 0
    try:
        async with aclosing(chunks):
            async for chunk in chunks:
                number = chunk["sequence_number"] + 1
                yield sse_event(chunk)
    except Exception as error:  # the 200 is already sent: report in-band
        failure = responses_param(as_pipeline_error(error))
        yield sse_event({"type": "error", "sequence_number": number, "code": failure.code,
                          "message": failure.detail, "param": failure.param})


def sse_event(chunk: dict) -> bytes:
    return b"event: %s\ndata: %s\n\n" % (chunk["type"].encode(), msgspec.json.encode(chunk))
