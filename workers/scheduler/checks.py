# What a scheduler checks of every Submit before its engine sees it: entries can be
# written by anyone with access to Redis, so nothing in them is trusted (the api checks
# the same and more, for its clients). Torch-free.

from __future__ import annotations

import math

from pipeline.errors import InvalidRequest, ModelMismatch
from pipeline.messages import Submit

MAX_ALTERNATIVES = 20  # logprobs' top tokens a request may ask for (the api's limit too)


def check_submit(submit: Submit, vocab_size: int, fingerprint: str | None = None) -> None:
    """InvalidRequest for anything a step would index, loop or divide with wrongly;
    ModelMismatch for a prompt tokenized for another model than `fingerprint`'s."""
    if None not in (submit.fingerprint, fingerprint) and submit.fingerprint != fingerprint:
        raise ModelMismatch(f"a scheduler of another model (fingerprint {fingerprint}) took "
                            f"this request, tokenized for {submit.fingerprint}: the tier "
                            f"mixes models (see `pipeline status`)")
    sampling = submit.sampling
    ids = [*submit.prompt_ids, *submit.output_ids, *sampling.stop_token_ids,
           *sampling.logit_bias]
    if not submit.prompt_ids or not all(0 <= i < vocab_size for i in ids):
        raise InvalidRequest(f"token ids must be in [0, {vocab_size})")
    if not all(math.isfinite(bias) for bias in sampling.logit_bias.values()):
        raise InvalidRequest("logit_bias values must be finite")
    for count in (sampling.logprobs, sampling.prompt_logprobs):
        if count is not None and not 0 <= count <= MAX_ALTERNATIVES:
            raise InvalidRequest(f"logprobs alternatives must be in [0, {MAX_ALTERNATIVES}]")
    if sampling.max_tokens < 1:
        raise InvalidRequest("max_tokens must be at least 1")
    if submit.stream_interval < 0:
        raise InvalidRequest("stream_interval must be 0 (when finished) or more")
