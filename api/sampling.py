# HTTP parameters -> the wire's `Sampling`: the one place generation parameters are
# range-checked. Workers trust what leaves here; a bad value is a 400 naming the field.

from __future__ import annotations

import json
from dataclasses import dataclass

from api.protocol import SamplingFields
from pipeline.errors import ContextLengthExceeded, InvalidRequest
from pipeline.messages import Sampling, Structure

DEFAULT_MAX_TOKENS = 1024
MAX_STOP_STRINGS = 16
MAX_LOGPROBS = 20
MAX_PROMPTS = 64  # a completion's batch; each runs its n choices
MAX_LOGIT_BIAS = 300  # tokens a request may bias, as OpenAI allows
_INT64 = 2**63


@dataclass(frozen=True)
class Limits:
    """What the served model and this api allow; found at start-up."""

    context_len: int
    vocab_size: int
    max_n: int


def to_sampling(
    fields: SamplingFields, *, num_prompt_tokens: int, limits: Limits,
    num_logprobs: int | None = None, logprobs_param: str = "logprobs",
    structure: Structure | None = None, prompt_logprobs: bool = False,
) -> Sampling:
    """Validate and translate. Without max_tokens a request may fill the context, but
    gets at most DEFAULT_MAX_TOKENS (1024) new tokens: a forgotten limit should not hold
    a batch slot for 8k tokens. temperature 0 means greedy; top_k -1 or None means off."""
    room = limits.context_len - num_prompt_tokens
    max_tokens = min(DEFAULT_MAX_TOKENS, room) if fields.max_tokens is None else fields.max_tokens
    _check_range("max_tokens", max_tokens, 1, limits.context_len)
    if max_tokens > room:
        raise ContextLengthExceeded(
            f"this model's context is {limits.context_len} tokens; the prompt has "
            f"{num_prompt_tokens} and max_tokens asks for {max_tokens} more",
            param="max_tokens",
        )
    _check_range("temperature", fields.temperature, 0.0, 2.0)
    _check_range("top_p", fields.top_p, 0.0, 1.0, low_open=True)
    _check_range("min_p", fields.min_p, 0.0, 1.0)
    _check_range("frequency_penalty", fields.frequency_penalty, -2.0, 2.0)
    _check_range("presence_penalty", fields.presence_penalty, -2.0, 2.0)
    _check_range("repetition_penalty", fields.repetition_penalty, 0.0, 2.0, low_open=True)
    _check_range("min_tokens", fields.min_tokens, 0, max_tokens)
    _check_range("n", fields.n, 1, limits.max_n)
    if num_logprobs is not None:
        _check_range(logprobs_param, num_logprobs, 0, MAX_LOGPROBS)
    if fields.seed is not None:
        _check_range("seed", fields.seed, -_INT64, _INT64 - fields.n)  # seed + i for choice i
    return Sampling(
        max_tokens=max_tokens, temperature=fields.temperature, top_p=fields.top_p,
        top_k=_top_k(fields.top_k), min_p=fields.min_p, seed=fields.seed,
        stop=_stop_strings(fields.stop),
        stop_token_ids=check_token_ids("stop_token_ids", fields.stop_token_ids or [], limits),
        ignore_eos=fields.ignore_eos, min_tokens=fields.min_tokens,
        repetition_penalty=fields.repetition_penalty,
        frequency_penalty=fields.frequency_penalty, presence_penalty=fields.presence_penalty,
        logprobs=num_logprobs, skip_special_tokens=fields.skip_special_tokens,
        # the prompt's tokens' too, with as many alternatives
        prompt_logprobs=num_logprobs if prompt_logprobs else None,
        logit_bias=_logit_bias(fields.logit_bias or {}, limits), structure=structure,
    )


def structure_of(response_format: dict | None) -> Structure | None:
    """OpenAI's response_format: text (None), json_object, or json_schema with its
    schema under json_schema.schema. Whether a scheduler can hold the output to the
    schema is its to say (a 400 from there names what it cannot)."""
    if response_format is None:
        return None
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return Structure(kind=kind, field="response_format")
    if kind != "json_schema":
        raise InvalidRequest("response_format.type must be text, json_object or json_schema",
                             param="response_format.type")
    spec = response_format.get("json_schema")
    schema = spec.get("schema") if isinstance(spec, dict) else None
    if not isinstance(schema, dict):
        raise InvalidRequest("a json_schema response_format needs its schema as an object "
                             "under json_schema.schema", param="response_format.json_schema")
    return Structure(kind=kind, schema=json.dumps(schema), field="response_format")


def check_prompt(prompt_ids: list[int], limits: Limits, param: str) -> list[int]:
    """A prompt that a scheduler can run: non-empty, known ids, room for one new token."""
    if not prompt_ids:
        raise InvalidRequest("the prompt is empty", param=param)
    check_token_ids(param, prompt_ids, limits)
    if len(prompt_ids) >= limits.context_len:
        raise ContextLengthExceeded(
            f"this model's context is {limits.context_len} tokens; the prompt has "
            f"{len(prompt_ids)}, leaving no room to generate",
            param=param,
        )
    return prompt_ids


def _check_range(param: str, value, low, high, *, low_open: bool = False) -> None:
    # written so that NaN fails (Python's json accepts NaN and Infinity)
    is_above_low = value > low if low_open else value >= low
    if not (is_above_low and value <= high):
        bracket = "(" if low_open else "["
        raise InvalidRequest(f"{param} must be in {bracket}{low}, {high}], got {value}",
                             param=param)


def _top_k(top_k: int | None) -> int | None:
    if top_k is None or top_k == -1:
        return None
    _check_range("top_k", top_k, 1, _INT64 - 1)
    return top_k


def _stop_strings(stop: str | list[str] | None) -> list[str]:
    strings = [stop] if isinstance(stop, str) else list(stop or [])
    if len(strings) > MAX_STOP_STRINGS:
        raise InvalidRequest(f"at most {MAX_STOP_STRINGS} stop strings", param="stop")
    if not all(strings):
        raise InvalidRequest("stop strings must be non-empty", param="stop")
    return strings


def _logit_bias(bias: dict[str, float], limits: Limits) -> dict[int, float]:
    """OpenAI's shape: token ids as strings, each bias in [-100, 100] (-100 bans the
    token, 100 all but forces it)."""
    if len(bias) > MAX_LOGIT_BIAS:
        raise InvalidRequest(f"logit_bias may name at most {MAX_LOGIT_BIAS} tokens",
                             param="logit_bias")
    # ASCII digits only: "" and "²" are not ids (int() fails on both; "" is falsy)
    bad = next((key for key in bias if not (key.isascii() and key.isdigit())), None)
    if bad is not None:
        raise InvalidRequest(f"logit_bias keys are token ids, got {bad!r}", param="logit_bias")
    ids = {int(key): value for key, value in bias.items()}
    check_token_ids("logit_bias", list(ids), limits)
    for value in ids.values():
        _check_range("logit_bias", value, -100.0, 100.0)
    return ids


def check_token_ids(param: str, ids: list[int], limits: Limits) -> list[int]:
    """Every id in the model's vocabulary, or a 400 naming the first that is not."""
    bad = next((i for i in ids if not 0 <= i < limits.vocab_size), None)
    if bad is not None:
        raise InvalidRequest(
            f"token id {bad} is outside this model's vocabulary (0..{limits.vocab_size - 1})",
            param=param,
        )
    return ids
