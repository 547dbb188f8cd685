# OpenAI response bodies for /v1/chat/completions and /v1/completions: whole responses,
# stream chunks, usage and both logprobs shapes, built from the choices' deltas.

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass

from api.reasoning import reasoning_tokens
from api.streaming import Choice, Event, Run
from api.tools import OutputReader, ToolCalls
from pipeline.messages import Delta, Sampling, TokenLogprob
from pipeline.tokenizer import Tokenizer


@dataclass(frozen=True)
class Job:
    """One OpenAI request, ready to run: n samplings over each of its prompts (a chat
    has one; a completion may send several). Choice i runs prompt i // n, as OpenAI
    numbers a batch's choices."""

    is_chat: bool
    response_id: str
    created: int
    model: str
    prompts: list[list[int]]
    samplings: list[Sampling]  # one a choice: n for each prompt, in its order
    include_usage: bool = False
    echo: bool = False  # a completion's text (and logprobs) begin with its prompt's
    tool_calls: ToolCalls | None = None  # a chat's output is a call (api/tools.py)
    reasoning: str | None = None  # a thinking model's start (api/reasoning.py)
    service_tier: str = "default"  # its lane (pipeline.streams.TIERS)

    @property
    def runs(self) -> list[Run]:
        return [(self.prompt_of(i), sampling) for i, sampling in enumerate(self.samplings)]

    @property
    def per_prompt(self) -> int:
        """Choices a prompt has (the request's n)."""
        return len(self.samplings) // len(self.prompts)

    def prompt_of(self, index: int) -> list[int]:
        return self.prompts[index // self.per_prompt]

    @property
    def wants_logprobs(self) -> bool:
        return self.samplings[0].logprobs is not None

    def envelope(self, *, is_chunk: bool) -> dict:
        kind = "chat.completion" if self.is_chat else "text_completion"
        suffix = ".chunk" if is_chunk and self.is_chat else ""
        return {"id": self.response_id, "object": kind + suffix, "created": self.created,
                "model": self.model, "service_tier": self.service_tier}

    def usage(self, choices: list[Choice], tokenizer: Tokenizer) -> dict:
        completion_tokens = sum(len(choice.token_ids) for choice in choices)
        thought = sum(reasoning_tokens(tokenizer, self.reasoning, choice.token_ids)
                      for choice in choices)
        # each prompt counted once, however many choices share it; of its tokens, those
        # its choices all found in a scheduler's prefix cache
        prompt_tokens = sum(len(prompt_ids) for prompt_ids in self.prompts)
        n = self.per_prompt
        cached = sum(min(choice.cached_tokens or 0 for choice in choices[i:i + n])
                     for i in range(0, len(choices), n))
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
                "prompt_tokens_details": {"cached_tokens": cached},
                "completion_tokens_details": {"reasoning_tokens": thought}}


def whole_response(job: Job, tokenizer: Tokenizer, choices: list[Choice]) -> dict:
    body = [_choice(job, tokenizer, index, choice) for index, choice in enumerate(choices)]
    return job.envelope(is_chunk=False) | {"choices": body,
                                           "usage": job.usage(choices, tokenizer)}


def _choice(job: Job, tokenizer: Tokenizer, index: int, choice: Choice) -> dict:
    if job.echo:
        return _echoed(job, tokenizer, index, choice, choice.text, choice.logprobs)
    logprobs = _logprobs(job, tokenizer, choice.logprobs, 0) if job.wants_logprobs else None
    finish = choice.finish
    if job.is_chat:
        reader = OutputReader(job.tool_calls, job.reasoning)
        reader.read(choice.text, last=True)
        content, finish = {"message": reader.message()}, reader.finish_reason(finish)
    else:
        content = {"text": choice.text}
    return {"index": index, **content, "logprobs": logprobs, "finish_reason": finish}


def _echoed(job: Job, tokenizer: Tokenizer, index: int, choice: Choice, text: str,
            logprobs: list[TokenLogprob]) -> dict:
    """A completion choice (or its first chunk) led by its prompt: the prompt's text,
    and with logprobs its tokens, the first with none (nothing comes before it)."""
    prompt_ids = job.prompt_of(index)
    prompt_text = tokenizer.decode(prompt_ids, skip_special_tokens=False)
    body = {"index": index, "text": prompt_text + text, "logprobs": None,
            "finish_reason": choice.finish}
    if job.wants_logprobs:
        prompt = _legacy_logprobs(tokenizer, prompt_ids, choice.prompt_entries(prompt_ids), 0)
        output = completion_logprobs(tokenizer, logprobs, len(prompt_text))
        body["logprobs"] = {key: prompt[key] + output[key] for key in output}
    return body


async def stream_chunks(job: Job, tokenizer: Tokenizer,
                        events: AsyncIterator[Event]) -> AsyncIterator[dict]:
    """A chunk per delta that says something; a chat stream opens each choice with its
    role, an echo leads each choice's first chunk with its prompt, and `include_usage`
    adds a last chunk with usage and no choices."""
    choices = [Choice() for _ in job.samplings]
    read = job.tool_calls is not None or job.reasoning is not None
    readers = [OutputReader(job.tool_calls, job.reasoning) for _ in choices] if read else []
    echoed = [0] * len(choices)  # the length of each choice's echoed prompt text
    async with aclosing(events):
        if job.is_chat:
            opening = [{"index": index, "delta": {"role": "assistant", "content": ""},
                        "logprobs": None, "finish_reason": None}
                       for index in range(len(choices))]
            yield job.envelope(is_chunk=True) | {"choices": opening}
        async for index, delta in events:
            text_offset = echoed[index] + len(choices[index].text)
            is_first = not choices[index].token_ids
            choices[index].add(delta)
            if job.echo and is_first:
                chunk_choice = _echoed(job, tokenizer, index, choices[index], delta.text,
                                       delta.logprobs or [])
                echoed[index] = len(chunk_choice["text"]) - len(delta.text)
                yield job.envelope(is_chunk=True) | {"choices": [chunk_choice]}
            elif readers:  # thought, content and calls, each once known
                chunk_choice = _read_choice(job, tokenizer, index, delta, readers[index])
                if chunk_choice is not None:
                    yield job.envelope(is_chunk=True) | {"choices": [chunk_choice]}
            elif delta.text or delta.logprobs or delta.finish is not None:
                chunk_choice = _chunk_choice(job, tokenizer, index, delta, text_offset)
                yield job.envelope(is_chunk=True) | {"choices": [chunk_choice]}
    if job.include_usage:
        yield job.envelope(is_chunk=True) | {"choices": [],
                                             "usage": job.usage(choices, tokenizer)}


def _read_choice(job: Job, tokenizer: Tokenizer, index: int, delta: Delta,
                 reader: OutputReader) -> dict | None:
    """A chat chunk's choice where the output is read for thought or calls; None where
    this delta tells nothing yet (a tag, maybe, held back)."""
    last = delta.finish is not None
    thought, said = reader.read(delta.text, last)
    told = ({"reasoning_content": thought} if thought else {}) | said.delta()
    logprobs = _logprobs(job, tokenizer, delta.logprobs, 0) if delta.logprobs else None
    if not told and not last and logprobs is None:
        return None
    return {"index": index, "delta": told, "logprobs": logprobs,
            "finish_reason": reader.finish_reason(delta.finish)}


def _chunk_choice(job: Job, tokenizer: Tokenizer, index: int, delta: Delta,
                  text_offset: int) -> dict:
    logprobs = None
    if job.wants_logprobs:
        logprobs = _logprobs(job, tokenizer, delta.logprobs or [], text_offset)
    content = {"delta": {"content": delta.text}} if job.is_chat else {"text": delta.text}
    return {"index": index, **content, "logprobs": logprobs, "finish_reason": delta.finish}


def _logprobs(job: Job, tokenizer: Tokenizer, logprobs: list[TokenLogprob],
              text_offset: int) -> dict:
    if job.is_chat:
        return chat_logprobs(tokenizer, logprobs)
    return completion_logprobs(tokenizer, logprobs, text_offset)


def chat_logprobs(tokenizer: Tokenizer, logprobs: list[TokenLogprob]) -> dict:
    def entry(token_id: int, logprob: float) -> dict:
        text = tokenizer.token_bytes_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {"content": [
        entry(item.token_id, item.logprob)
        | {"top_logprobs": [entry(top.token_id, top.logprob) for top in item.top]}
        for item in logprobs
    ]}


def completion_logprobs(tokenizer: Tokenizer, logprobs: list[TokenLogprob],
                        text_offset: int) -> dict:
    """The legacy shape. text_offset counts characters of the tokens' own texts from
    `text_offset`, the length of the completion text before these tokens."""
    return _legacy_logprobs(tokenizer, [item.token_id for item in logprobs], logprobs,
                            text_offset)


def _legacy_logprobs(tokenizer: Tokenizer, token_ids: list[int],
                     items: list[TokenLogprob | None], text_offset: int) -> dict:
    """The legacy shape of `token_ids`, from `text_offset`; a None item (an echoed
    prompt's first token) has no logprob and no alternatives."""
    tokens = [tokenizer.token_bytes_text(token_id) for token_id in token_ids]
    offsets = list(itertools.accumulate((len(token) for token in tokens[:-1]),
                                        initial=text_offset))[:len(tokens)]
    top = [None if item is None else
           {tokenizer.token_bytes_text(alt.token_id): alt.logprob for alt in item.top}
           for item in items]
    return {"tokens": tokens,
            "token_logprobs": [None if item is None else item.logprob for item in items],
            "top_logprobs": top, "text_offset": offsets}
