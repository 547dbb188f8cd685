"""The wire contract: every message round-trips, and an older writer's
messages still decode after fields were added."""

from __future__ import annotations

import msgspec
import pytest

from pipeline.messages import (
    Cancel,
    Delta,
    Failed,
    FrontendGone,
    ReplyBatch,
    Sampling,
    StepOutput,
    Submit,
    TokenBatch,
    TokenLogprob,
    TopLogprob,
    control_decoder,
    encode,
    replies_decoder,
    requests_decoder,
    tokens_decoder,
)

SUBMIT = Submit(request_id="r1", reply_to="p:replies:f1", prompt_ids=[1, 2, 3],
                sampling=Sampling(max_tokens=5, temperature=0.0, stop=["\n"]))


@pytest.mark.parametrize("decoder, message", [
    (requests_decoder, SUBMIT),
    (control_decoder, Cancel(["r1", "r2"])),
    (control_decoder, Cancel(["r1", "r2"], [2, 1])),
    (control_decoder, FrontendGone("p:replies:f1")),
    (tokens_decoder, TokenBatch("s1", [StepOutput("r1", "x", 0, [5], [], "stop", ["a"], "a", [
        TokenLogprob(5, -0.1, [TopLogprob(5, -0.1), TopLogprob(6, -2.5)])])],
        [Failed("r2", "x", "timeout", "too late")])),
    (replies_decoder, ReplyBatch([Delta("r1", 0, [5], "hi", None)], [])),
])
def test_every_message_round_trips_through_its_stream_decoder(decoder, message):
    assert decoder.decode(encode(message)) == message


def test_a_submit_from_an_older_writer_without_newer_fields_still_decodes():
    class OldSubmit(msgspec.Struct, tag="submit", kw_only=True):
        request_id: str
        reply_to: str
        prompt_ids: list[int]
        sampling: Sampling

    raw = encode(OldSubmit(request_id="r", reply_to="x", prompt_ids=[1], sampling=Sampling()))
    decoded = requests_decoder.decode(raw)
    assert decoded.output_ids == [] and decoded.attempt == 0 and decoded.deadline_ms is None
    assert decoded.stream_interval == 1  # every token as it is made, as before the field
    assert decoded.fingerprint is None  # any scheduler may run it, as before the field


def test_a_step_output_from_an_older_writer_with_fewer_array_fields_still_decodes():
    class OldStepOutput(msgspec.Struct, array_like=True):
        request_id: str
        reply_to: str
        offset: int
        new_ids: list[int]
        prefix_ids: list[int]

    class OldBatch(msgspec.Struct, tag="tokens"):
        scheduler_id: str
        outputs: list[OldStepOutput]

    raw = encode(OldBatch("s", [OldStepOutput("r", "x", 3, [9], [8])]))
    [out] = tokens_decoder.decode(raw).outputs
    assert (out.offset, out.new_ids, out.finish, out.stop, out.attempt) == (3, [9], None, [], 0)


@pytest.mark.parametrize("raw", [b"", b"\x00", b"\xc1garbage", encode({"type": "nope"}),
                                 encode(Cancel(["r"]))])
def test_malformed_or_misrouted_entries_fail_to_decode_loudly(raw):
    with pytest.raises(msgspec.DecodeError):
        requests_decoder.decode(raw)


def test_a_token_batch_from_an_older_writer_names_no_model():
    class OldTokenBatch(msgspec.Struct, tag="tokens"):
        scheduler_id: str
        outputs: list[StepOutput] = []
        failures: list[Failed] = []

    decoded = tokens_decoder.decode(encode(OldTokenBatch("s1")))
    assert decoded.fingerprint is None  # any detokenizer decodes it, as before the field
