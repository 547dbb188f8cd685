# The OpenAI-compatible routes: /v1/models (and one model by id), /v1/chat/completions,
# /v1/completions.
# Each checks and tokenizes its request, then runs n choices of each prompt through the
# Frontend (a completion may send a batch of prompts).

from __future__ import annotations

import uuid
from typing import Annotated

from fastapi import APIRouter, Depends, Request

from api.chat_prompt import chat_prompt_ids
from api.keys import service_tier
from api.protocol import ChatRequest, CompletionRequest, OpenAIRequest
from api.reasoning import reasoning_start, think_first
from api.responses import Job, stream_chunks, whole_response
from api.sampling import MAX_PROMPTS, check_prompt, structure_of, to_sampling
from api.served import Served, served
from api.streaming import EventStream, choice_events, collect, per_choice, started
from api.tools import ToolCalls, tool_calls
from pipeline.errors import InvalidRequest
from pipeline.messages import Sampling

router = APIRouter()
ServedDep = Annotated[Served, Depends(served)]


@router.get("/v1/models")
async def list_models(s: ServedDep) -> dict:
    return {"object": "list", "data": [_model(s, name) for name in s.model_names]}


@router.get("/v1/models/{model:path}")  # :path, as a model id may hold a slash ("org/name")
async def retrieve_model(model: str, s: ServedDep) -> dict:
    s.check_model(model)
    return _model(s, model)


def _model(s: Served, name: str) -> dict:
    return {"id": name, "object": "model", "created": 0, "owned_by": "redis-pipeline",
            "max_model_len": s.limits.context_len}


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatRequest, request: Request, s: ServedDep):
    return await run_job(chat_job(body, s), body.stream, request, s)


def chat_job(body: ChatRequest, s: Served) -> Job:
    """A chat, checked and tokenized, ready to run (the Responses API's too)."""
    _check_common(body, s)
    if body.top_logprobs is not None and not body.logprobs:
        raise InvalidRequest("top_logprobs needs logprobs: true", param="top_logprobs")
    calls = tool_calls(body, s.tokenizer)
    offered = [tool.model_dump(exclude_none=True) for tool in body.tools or []] if calls else None
    prompt_ids = check_prompt(chat_prompt_ids(body.messages, s.tokenizer, tools=offered,
                                              template_kwargs=body.chat_template_kwargs),
                              s.limits, "messages")
    num_logprobs = (body.top_logprobs or 0) if body.logprobs else None
    reasoning = reasoning_start(s.tokenizer, prompt_ids)
    structure = think_first(calls.structure() if calls else structure_of(body.response_format),
                            reasoning)
    sampling = to_sampling(body, num_prompt_tokens=len(prompt_ids), limits=s.limits,
                           num_logprobs=num_logprobs, logprobs_param="top_logprobs",
                           structure=structure)
    return _job(body, s, True, [prompt_ids], per_choice(sampling, body.n), tool_calls=calls,
                reasoning=reasoning)


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request, s: ServedDep):
    _check_common(body, s)
    prompts = _prompts(body.prompt, s)
    if len(prompts) > MAX_PROMPTS:
        raise InvalidRequest(f"at most {MAX_PROMPTS} prompts a request, got {len(prompts)}",
                             param="prompt")
    named = len(prompts) > 1  # a batch's errors name the prompt: prompt[2]
    prompts = [check_prompt(ids, s.limits, f"prompt[{i}]" if named else "prompt")
               for i, ids in enumerate(prompts)]
    samplings = []
    for prompt_ids in prompts:  # each its own default max_tokens: the room its prompt leaves
        sampling = to_sampling(body, num_prompt_tokens=len(prompt_ids), limits=s.limits,
                               num_logprobs=body.logprobs, prompt_logprobs=body.echo)
        samplings += per_choice(sampling, body.n)
    job = _job(body, s, False, prompts, samplings, echo=body.echo)
    return await run_job(job, body.stream, request, s)


def _check_common(body: OpenAIRequest, s: Served) -> None:
    s.check_model(body.model)
    field = body.unsupported()
    if field is not None:
        raise InvalidRequest(f"{field} is not supported by this server", param=field)


def _prompts(prompt: str | list[str] | list[int] | list[list[int]], s: Served) -> list[list[int]]:
    """A string, token ids, or a batch of either; each prompt as token ids."""
    if isinstance(prompt, str):
        return [s.tokenizer.encode(prompt)]
    if not prompt or isinstance(prompt[0], int):
        return [list(prompt)]  # empty: refused by check_prompt
    return [s.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompt]


def _job(body: OpenAIRequest, s: Served, is_chat: bool, prompts: list[list[int]],
         samplings: list[Sampling], echo: bool = False,
         tool_calls: ToolCalls | None = None, reasoning: str | None = None) -> Job:
    prefix = "chatcmpl" if is_chat else "cmpl"
    include_usage = body.stream_options is not None and body.stream_options.include_usage
    return Job(is_chat=is_chat, response_id=f"{prefix}-{uuid.uuid4().hex}",
               created=int(s.frontend.client.clock.now_s()), model=s.model_name, prompts=prompts,
               samplings=samplings, include_usage=include_usage, echo=echo,
               tool_calls=tool_calls, reasoning=reasoning,
               service_tier=service_tier(body.service_tier))


def job_events(job: Job, stream: bool, s: Served):
    return choice_events(s.frontend, job.runs, job.response_id, s.config.request_timeout_s,
                         s.delta_interval(stream), job.service_tier)


async def run_job(job: Job, stream: bool, request: Request, s: Served):
    events = job_events(job, stream, s)
    if stream:
        return EventStream(stream_chunks(job, s.tokenizer, await started(events)))
    return whole_response(job, s.tokenizer, await collect(request, events, len(job.samplings)))
