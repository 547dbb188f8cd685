"""Every struct that crosses Redis, grouped by the stream that carries it.

Wire contract: fields are only ever added at the end, with defaults, so a
worker running the previous version still decodes what a newer one writes.
"""

from __future__ import annotations

import msgspec
from msgspec import Struct


class Structure(Struct, frozen=True, kw_only=True):
    """What the output must be (response_format, tool calls): any JSON object, JSON
    that a schema admits, or a structural tag (`schema`: the schema or tag as JSON text)."""

    kind: str  # "json_object" | "json_schema" | "structural_tag" (xgrammar's, as JSON)
    schema: str = ""
    # the request field it comes from, which an error about it names ("": guessed from
    # its kind, as before the field: a structural tag's is tools, the rest response_format)
    field: str = ""


class Sampling(Struct, frozen=True, kw_only=True, omit_defaults=True):
    """How to pick tokens and when to stop; the api validates, workers trust."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    min_tokens: int = 0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logprobs: int | None = None  # None: none; k: chosen token's logprob and k alternatives
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] = {}  # added to those tokens' logits before any other step
    # k: each prompt token's logprob (from the second on) and k alternatives, sent
    # with the first output token; the prompt is then computed whole (no prefix reuse)
    prompt_logprobs: int | None = None
    structure: Structure | None = None  # None: any text


# ---- {prefix}:requests  (api -> scheduler group) ----


class Submit(Struct, frozen=True, tag="submit", kw_only=True):
    """One generation request. `output_ids` is non-empty on a continuation:
    tokens the client already holds, which the new run must not repeat."""

    request_id: str
    reply_to: str
    prompt_ids: list[int]
    sampling: Sampling
    deadline_ms: int | None = None  # unix epoch ms, the tier's clock; not started after this
    output_ids: list[int] = []
    attempt: int = 0  # runs before this one: each a new attempt, whatever ended it
    deaths: int = 0  # of those, the ones whose scheduler died (the poison limit counts these)
    # tokens the scheduler gathers before it sends them on, after a run's first token,
    # which goes at once (the finishing delta may carry fewer); 1: every token as it
    # is made; 0: all at once when finished
    stream_interval: int = 1
    # OpenAI's service tier (pipeline.streams.TIERS): which lane it is sent down, and
    # sent again down on a continuation
    service_tier: str = "default"
    # the HTTP request's id (its x-request-id), which a scheduler's log records about
    # this request carry, as the api's do
    trace_id: str | None = None
    # the model the prompt was tokenized for (pipeline.model_identity): a scheduler
    # of another refuses it
    fingerprint: str | None = None


ToScheduler = Submit


# ---- {prefix}:control  (api -> every scheduler, fan-out) ----


class Cancel(Struct, frozen=True, tag="cancel"):
    """Stop these requests. `below`, where given (one per request id): stop only an
    attempt older than that one (superseded, after a failover's resubmission)."""

    request_ids: list[str]
    below: list[int] | None = None


class FrontendGone(Struct, frozen=True, tag="frontend_gone"):
    """Every request whose replies go to `reply_to` is abandoned."""

    reply_to: str


Control = Cancel | FrontendGone


# ---- {prefix}:tokens  (scheduler -> detokenizer group), one per model step ----


class TopLogprob(Struct, frozen=True, array_like=True):
    token_id: int
    logprob: float


class TokenLogprob(Struct, frozen=True, array_like=True):
    token_id: int
    logprob: float
    top: list[TopLogprob] = []


class StepOutput(Struct, frozen=True, array_like=True):
    """One request's share of a step. `prefix_ids` are the output ids just
    before `offset`, enough for a stateless detokenizer to decode the new ids
    in context and to hold back a partial stop string."""

    request_id: str
    reply_to: str
    offset: int  # index in the output of new_ids[0]
    new_ids: list[int]
    prefix_ids: list[int]
    finish: str | None = None  # "stop" | "length" | None while running
    stop: list[str] = []  # the request's stop strings: hold back their prefixes
    matched_stop: str | None = None  # the stop string that ended it; cut the text there
    logprobs: list[TokenLogprob] | None = None
    attempt: int = 0
    skip_special_tokens: bool = True
    prompt_logprobs: list[TokenLogprob] | None = None  # Sampling.prompt_logprobs', once
    # with a run's first output: its prompt tokens found in the prefix cache (usage's
    # cached_tokens); None on later outputs
    cached_tokens: int | None = None


class Failed(Struct, frozen=True, tag="failed"):
    """A request that cannot go on. `code` maps to an HTTP status in the api."""

    request_id: str
    reply_to: str
    code: str  # one of pipeline.errors.CODES
    detail: str
    attempt: int = 0
    # why a RETRY: its scheduler died running it (True: a death toward the poison
    # limit), or a draining scheduler handed it back (False: nothing against it)
    died: bool = True
    param: str | None = None  # the request field at fault, where one is


class TokenBatch(Struct, frozen=True, tag="tokens"):
    scheduler_id: str
    outputs: list[StepOutput] = []
    failures: list[Failed] = []
    # the model whose token ids these are (pipeline.model_identity): a detokenizer of
    # another fails the requests rather than decode them with the wrong vocabulary
    fingerprint: str | None = None


ToDetokenizer = TokenBatch


# ---- {prefix}:replies:{frontend_id}  (detokenizer -> one api worker) ----


class Delta(Struct, frozen=True, array_like=True):
    """New text for one request. Frontends drop a delta whose token range they
    already have, so a redelivered batch never shows a client text twice."""

    request_id: str
    offset: int
    token_ids: list[int]
    text: str
    finish: str | None = None
    logprobs: list[TokenLogprob] | None = None
    attempt: int = 0
    prompt_logprobs: list[TokenLogprob] | None = None  # with a run's first delta, if asked
    cached_tokens: int | None = None  # with a run's first delta (StepOutput.cached_tokens)


class ReplyBatch(Struct, frozen=True, tag="replies"):
    deltas: list[Delta] = []
    failures: list[Failed] = []


ToFrontend = ReplyBatch


# ---- codecs: one encoder, one typed decoder per stream ----

FIELD = b"m"  # every stream entry is {FIELD: msgpack bytes}
_encoder = msgspec.msgpack.Encoder()
encode = _encoder.encode

requests_decoder = msgspec.msgpack.Decoder(ToScheduler)
control_decoder = msgspec.msgpack.Decoder(Control)
tokens_decoder = msgspec.msgpack.Decoder(ToDetokenizer)
replies_decoder = msgspec.msgpack.Decoder(ToFrontend)
