"""Hostile stream entries: garbage is dead-lettered with its reason, a
well-formed but impossible request fails back to its frontend, and the
workers go on serving."""

from __future__ import annotations

import time
import uuid

import httpx
import msgspec
import pytest
import redis
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.messages import (
    FIELD,
    Cancel,
    Sampling,
    Structure,
    Submit,
    control_decoder,
    encode,
    replies_decoder,
    requests_decoder,
    tokens_decoder,
)
from pipeline.streams import Keys

DECODERS = [requests_decoder, control_decoder, tokens_decoder, replies_decoder]


@settings(max_examples=300, deadline=None)
@given(raw=st.binary(max_size=512))
def test_decoders_reject_arbitrary_bytes_with_a_decode_error_only(raw):
    for decoder in DECODERS:
        try:
            decoder.decode(raw)
        except msgspec.DecodeError:
            pass


@settings(max_examples=200, deadline=None)
@given(value=st.recursive(
    st.none() | st.booleans() | st.integers(-2**63, 2**63 - 1) | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner,
                                                                 max_size=5), max_leaves=20))
def test_decoders_reject_wrongly_shaped_msgpack_with_a_decode_error_only(value):
    raw = msgspec.msgpack.encode(value)
    for decoder in DECODERS:
        try:
            decoder.decode(raw)
        except msgspec.DecodeError:
            pass


def _wait(condition, timeout_s=60.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if (value := condition()):
            return value
        time.sleep(0.1)
    raise TimeoutError


def test_garbage_entries_are_dead_lettered_and_the_tier_keeps_serving(tier):
    keys = Keys(tier.prefix)
    client = redis.Redis.from_url(tier.redis_url)
    before = client.xlen(keys.dead_letters) if client.exists(keys.dead_letters) else 0
    client.xadd(keys.requests, {FIELD: b"\xc1 not msgpack"})
    client.xadd(keys.tokens, {FIELD: encode({"type": "tokens", "outputs": "nope"})})
    client.xadd(keys.requests, {"unexpected": b"field"})
    _wait(lambda: client.xlen(keys.dead_letters) >= before + 3)
    reasons = [fields[b"reason"].decode() for _, fields in client.xrange(keys.dead_letters)]
    assert all(reasons)
    print(f"\n[poison] dead-lettered {len(reasons) - before}: {reasons[-3:]}")
    body = {"prompt": "Hello", "max_tokens": 4, "temperature": 0}
    assert httpx.post(f"{tier.base_url}/v1/completions", json=body, timeout=60).status_code == 200


def _stand_in_frontend(tier, name: str) -> tuple[redis.Redis, Keys, str]:
    """A reply stream and a liveness key, as a live api worker has: schedulers
    drop the requests of frontends without one."""
    keys = Keys(tier.prefix)
    client = redis.Redis.from_url(tier.redis_url)
    reply_to = keys.replies(name)
    client.xadd(reply_to, {"hello": "x"})
    client.set(keys.alive("api", name), f'{{"role": "api", "id": "{name}"}}', ex=60)
    return client, keys, reply_to


@pytest.mark.parametrize(("prompt_ids", "sampling"), [
    ([10**9, -5], Sampling(max_tokens=4)),
    ([1, 2], Sampling(max_tokens=4, min_tokens=2, stop_token_ids=[10**9])),
    ([1, 2], Sampling(max_tokens=4, logit_bias={10**9: 5.0})),
    ([1, 2], Sampling(max_tokens=4, logit_bias={7: float("nan")})),
    ([1, 2], Sampling(max_tokens=4, prompt_logprobs=10**6)),
    ([1, 2], Sampling(max_tokens=4, structure=Structure(kind="regex", schema="a+"))),
    ([1, 2], Sampling(max_tokens=4, structure=Structure(kind="json_schema", schema="{no"))),
    ([1, 2], Sampling(max_tokens=4, structure=Structure(kind="structural_tag",
                                                         schema='{"format": 5}'))),
    ([1, 2], Sampling(max_tokens=4, structure=Structure(kind="structural_tag", schema="[1]"))),
], ids=["prompt", "stop_token_ids", "logit_bias", "nan_bias", "prompt_logprobs",
        "structure_kind", "schema", "tag", "tag_shape"])
def test_an_impossible_request_written_straight_to_redis_fails_back_to_its_sender(
        tier, prompt_ids, sampling):
    """Token ids a step would index the logits with, checked before it runs; a
    structure its grammar cannot be made from."""
    name = f"test-sender-{uuid.uuid4().hex[:8]}"  # a reply stream and request id a case
    client, keys, reply_to = _stand_in_frontend(tier, name)
    bad = Submit(request_id=name, reply_to=reply_to, prompt_ids=prompt_ids, sampling=sampling)
    client.xadd(keys.requests, {FIELD: encode(bad)})

    def failure():
        for _, fields in client.xrange(reply_to):
            if FIELD in fields:
                batch = replies_decoder.decode(fields[FIELD])
                if batch.failures:
                    return batch.failures[0]
        return None

    failed = _wait(failure)
    assert failed.request_id == name and failed.code == "invalid_request"
    body = {"prompt": "Hello", "max_tokens": 4, "temperature": 0}
    assert httpx.post(f"{tier.base_url}/v1/completions", json=body, timeout=60).status_code == 200


def test_a_submit_delivered_twice_by_a_retried_xadd_runs_once(tier):
    client, keys, reply_to = _stand_in_frontend(tier, "test-twice")
    submit = Submit(request_id="twice-1", reply_to=reply_to, prompt_ids=[1, 4093, 198],
                    sampling=Sampling(max_tokens=6, temperature=0.0, ignore_eos=True))
    for _ in range(2):  # what redis-py's retry does when an XADD reply is lost
        client.xadd(keys.requests, {FIELD: encode(submit)})

    def deltas():
        found = [d for _, fields in client.xrange(reply_to) if FIELD in fields
                 for d in replies_decoder.decode(fields[FIELD]).deltas]
        return found if any(d.finish for d in found) else None

    found = _wait(deltas)
    time.sleep(1.0)  # a second run, if any, would have produced output by now
    found = deltas()
    offsets = [d.offset for d in found]
    assert sorted(offsets) == sorted(set(offsets)) and sum(len(d.token_ids) for d in found) == 6


def test_a_late_copy_of_an_earlier_attempt_leaves_the_later_one_running(tier):
    """A frontend's first submit retried through a failover can land after the
    resubmission that superseded it: the scheduler runs the later attempt only, and
    a cancel of the attempts before it leaves it be."""
    client, keys, reply_to = _stand_in_frontend(tier, "test-late-copy")
    first = Submit(request_id="late-1", reply_to=reply_to, prompt_ids=[1, 4093, 198],
                   sampling=Sampling(max_tokens=24, temperature=0.0, ignore_eos=True))
    later = msgspec.structs.replace(first, attempt=1)
    for submit in (later, first):
        client.xadd(keys.requests, {FIELD: encode(submit)})
    # as its frontend cancels what came before the resubmission: not the later one
    client.xadd(keys.control, {FIELD: encode(Cancel(["late-1"], [1]))})

    def deltas():
        found = [d for _, fields in client.xrange(reply_to) if FIELD in fields
                 for d in replies_decoder.decode(fields[FIELD]).deltas]
        return found if any(d.finish for d in found) else None

    found = _wait(deltas)
    time.sleep(1.0)  # the earlier attempt, had it run, would have produced output by now
    found = deltas()
    assert {d.attempt for d in found} == {1}
    assert sum(len(d.token_ids) for d in found) == 24


def test_a_cancel_of_earlier_attempts_stops_the_one_a_scheduler_still_runs(tier):
    """After a failover its frontend resubmits a request, which may reach another
    scheduler: the one still running the earlier attempt stops it."""
    client, keys, reply_to = _stand_in_frontend(tier, "test-superseded")
    submit = Submit(request_id="superseded-1", reply_to=reply_to, prompt_ids=[1, 4093, 198],
                    sampling=Sampling(max_tokens=4000, temperature=0.0, ignore_eos=True))
    client.xadd(keys.requests, {FIELD: encode(submit)})

    def made():
        count = sum(len(d.token_ids) for _, fields in client.xrange(reply_to) if FIELD in fields
                    for d in replies_decoder.decode(fields[FIELD]).deltas)
        return count or None

    _wait(made)
    client.xadd(keys.control, {FIELD: encode(Cancel(["superseded-1"], [1]))})
    time.sleep(1.0)  # the cancel read, the last step's tokens out
    stopped_at = made()
    time.sleep(1.0)
    assert made() == stopped_at < 4000
