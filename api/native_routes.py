# The native routes: GET /health (is Redis reachable), GET /health_generate (does the tier
# make a token), GET /metrics and SGLang-style POST /generate.
# /generate streams cumulative text and ids in every event, as SGLang does by default.

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Annotated

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from api.keys import service_tier
from api.protocol import GenerateRequest, NativeSampling
from api.sampling import check_prompt, to_sampling
from api.served import Served, served
from api.streaming import Choice, Event, EventStream, choice_events, collect, started
from pipeline.errors import InvalidRequest, PipelineError
from pipeline.messages import Sampling, Structure
from pipeline.status import read_live_workers
from pipeline.streams import TIERS
from pipeline.tokenizer import Tokenizer

router = APIRouter()
ServedDep = Annotated[Served, Depends(served)]
HEALTH_TIMEOUT_S = 2.0
HEALTH_GENERATE_TIMEOUT_S = 20.0  # SGLang's; the api's --request-timeout where shorter


@router.get("/health")
async def health(s: ServedDep):
    try:
        async with asyncio.timeout(HEALTH_TIMEOUT_S):
            await s.frontend.client.redis.ping()
    except Exception as error:  # any failure to ping is "unreachable" to a load balancer
        detail = f"redis unreachable: {type(error).__name__}: {error}"
        return JSONResponse({"status": "unavailable", "detail": detail}, status_code=503)
    return {"status": "ok", "model": s.model_name, "frontend_id": s.frontend.frontend_id,
            "in_flight": len(s.frontend.states)}


@router.get("/health_generate")
async def health_generate(s: ServedDep):
    """One token made by the whole tier (SGLang's probe): a scheduler took the request
    and a detokenizer sent its token back. A one-token prompt in the `priority` lane, so
    it waits behind no default queue (a full scheduler makes way for it); kept out of
    the generation metrics. 503 with what went wrong when no token came in time."""
    timeout_s = min(HEALTH_GENERATE_TIMEOUT_S, s.config.request_timeout_s)
    started = time.perf_counter()
    try:
        deltas = s.frontend.generate(s.tokenizer.encode("ping")[:1], Sampling(max_tokens=1),
                                     timeout_s=timeout_s, stream_interval=0,
                                     service_tier="priority", counted=False)
        async with aclosing(deltas):
            async for _delta in deltas:
                pass
    except PipelineError as error:
        return JSONResponse({"status": "unavailable", "detail": f"{error.code}: {error.detail}"},
                            status_code=503)
    return {"status": "ok", "model": s.model_name, "frontend_id": s.frontend.frontend_id,
            "seconds": round(time.perf_counter() - started, 3)}


@router.get("/metrics")
async def metrics(s: ServedDep):
    """Prometheus' text format: this api's own metrics, then the tier's, read from
    the workers' liveness records; without Redis, the api's own alone."""
    frontend = s.frontend
    try:
        async with asyncio.timeout(HEALTH_TIMEOUT_S):
            workers = await read_live_workers(frontend.client, frontend.keys.prefix)
    except Exception:  # pipeline_redis_up 0; the api's own figures still say something
        workers = None
    queued = dict(zip(TIERS, frontend.queue_depths, strict=True))
    return Response(frontend.metrics.render(workers, queued),
                    media_type=CONTENT_TYPE_LATEST)


@router.post("/generate")
async def generate(body: GenerateRequest, request: Request, s: ServedDep):
    if body.input_ids is not None:
        prompt_ids = check_prompt(body.input_ids, s.limits, "input_ids")
    else:
        prompt_ids = check_prompt(s.tokenizer.encode(body.text or ""), s.limits, "text")
    if body.return_logprob and body.logprob_start_len >= len(prompt_ids):
        raise InvalidRequest(f"logprob_start_len must be below the prompt's "
                             f"{len(prompt_ids)} tokens", param="logprob_start_len")
    sampling = _sampling(body, len(prompt_ids), s)
    request_id = uuid.uuid4().hex
    response_id = body.rid or request_id
    events = choice_events(s.frontend, [(prompt_ids, sampling)], request_id,
                           s.config.request_timeout_s, s.delta_interval(body.stream),
                           service_tier(None))  # the default tier, or its key's
    logprobs = Logprobs(s.tokenizer, body.logprob_start_len) if body.return_logprob else None
    if body.stream:
        return EventStream(_cumulative(response_id, prompt_ids, logprobs, await started(events)))
    choice = (await collect(request, events, 1))[0]
    return _result(response_id, prompt_ids, choice, logprobs)


def _sampling(body: GenerateRequest, num_prompt_tokens: int, s: Served) -> Sampling:
    num_logprobs = body.top_logprobs_num if body.return_logprob else None
    schema = body.sampling_params.json_schema
    try:
        structure = None if schema is None else Structure(
            kind="json_schema", schema=json.dumps(_json_object(schema)),
            field="sampling_params.json_schema")
        return to_sampling(body.sampling_params, num_prompt_tokens=num_prompt_tokens,
                           limits=s.limits, num_logprobs=num_logprobs,
                           logprobs_param="top_logprobs_num", structure=structure,
                           prompt_logprobs=body.logprob_start_len >= 0)
    except PipelineError as error:
        error.param = _native_name(error.param)
        raise


def _json_object(text: str) -> dict:
    """sampling_params.json_schema's text as the object a schema is."""
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise InvalidRequest("json_schema must be a JSON object's text", param="json_schema")
    return value


def _native_name(param: str | None) -> str | None:
    """The name a native client wrote: sampling_params.max_new_tokens, not max_tokens."""
    field = NativeSampling.model_fields.get(param or "")
    return f"sampling_params.{field.alias or param}" if field else param


@dataclass(frozen=True)
class Logprobs:
    """What return_logprob asks: the tokenizer for the triples' texts, and where in
    the prompt its logprobs begin (-1: none)."""

    tokenizer: Tokenizer
    start: int

    def triple(self, token_id: int, logprob: float | None) -> list:
        """SGLang's (logprob, token_id, text)."""
        return [logprob, token_id, self.tokenizer.token_bytes_text(token_id)]

    def add(self, meta: dict, prompt_ids: list[int], choice: Choice) -> None:
        meta["output_token_logprobs"] = [self.triple(i.token_id, i.logprob)
                                         for i in choice.logprobs]
        meta["output_top_logprobs"] = [[self.triple(t.token_id, t.logprob) for t in i.top]
                                       for i in choice.logprobs]
        if self.start < 0 or choice.prompt_logprobs is None:
            return
        prompt = choice.prompt_entries(prompt_ids)[self.start:]  # the first has none
        meta["input_token_logprobs"] = [
            self.triple(token_id, None if i is None else i.logprob)
            for token_id, i in zip(prompt_ids[self.start:], prompt, strict=True)]
        meta["input_top_logprobs"] = [
            None if i is None else [self.triple(t.token_id, t.logprob) for t in i.top]
            for i in prompt]


async def _cumulative(response_id: str, prompt_ids: list[int], logprobs: Logprobs | None,
                      events: AsyncIterator[Event]) -> AsyncIterator[dict]:
    choice = Choice()
    async with aclosing(events):
        async for _index, delta in events:
            choice.add(delta)
            if delta.text or delta.finish is not None or delta.logprobs:
                yield _result(response_id, prompt_ids, choice, logprobs)


def _result(response_id: str, prompt_ids: list[int], choice: Choice,
            logprobs: Logprobs | None) -> dict:
    finish = {"type": choice.finish} if choice.finish is not None else None
    meta = {"id": response_id, "prompt_tokens": len(prompt_ids),
            "completion_tokens": len(choice.token_ids), "finish_reason": finish,
            "cached_tokens": choice.cached_tokens or 0}
    if logprobs is not None:
        logprobs.add(meta, prompt_ids, choice)
    return {"text": choice.text, "output_ids": choice.token_ids, "meta_info": meta}
