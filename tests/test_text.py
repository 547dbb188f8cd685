"""Incremental detokenization: stateless, never half a character, stop strings held back."""

import pytest

from pipeline.messages import StepOutput
from pipeline.models import resolve_model
from pipeline.tokenizer import Tokenizer
from workers.text import find_stop, held_back, step_text, stop_window


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer(resolve_model("SmolLM2-135M-Instruct").path)


def stream_text(tokenizer, ids, stop=(), step=1):
    """Decode `ids` step by step the way the pipeline does: the scheduler ends
    the request at the step that completes a stop string."""
    stop = list(stop)
    window = stop_window(stop)
    pieces = []
    for offset in range(0, len(ids), step):
        new = ids[offset:offset + step]
        matched = find_stop(tokenizer, ids[:offset + len(new)], len(new), stop)
        last = matched is not None or offset + step >= len(ids)
        out = StepOutput("r", "x", offset, new, ids[max(0, offset - window):offset],
                         finish="stop" if last else None, stop=stop, matched_stop=matched)
        pieces.append(step_text(tokenizer, out))
        if last:
            break
    return pieces


@pytest.mark.parametrize(
    "text", ["Hello, world!", "안녕하세요 세계", "emoji 😀🎉 and 日本語", "tab\tnew\nline"])
@pytest.mark.parametrize("step", [1, 3])
def test_streamed_pieces_join_to_the_full_decode_without_replacement_chars(tokenizer, text, step):
    ids = tokenizer.encode(text)
    pieces = stream_text(tokenizer, ids, step=step)
    assert "".join(pieces) == tokenizer.decode(ids) == text
    assert all("\ufffd" not in piece for piece in pieces)


def test_a_stop_string_and_everything_after_it_never_reach_the_client(tokenizer):
    ids = tokenizer.encode("The answer is 42. END of story")
    pieces = stream_text(tokenizer, ids, stop=["END"])
    assert "".join(pieces) == "The answer is 42. "
    assert not any("E" in piece for piece in pieces)


def test_a_partial_stop_string_is_held_back_then_released_when_it_diverges(tokenizer):
    ids = tokenizer.encode("one two three")
    pieces = stream_text(tokenizer, ids, stop=["two thousand"])
    assert "".join(pieces) == "one two three"
    assert held_back("one two", ["two thousand"]) == 3


def test_the_scheduler_finds_a_stop_string_split_across_tokens(tokenizer):
    ids = tokenizer.encode("alpha beta gamma")
    assert find_stop(tokenizer, ids, 1, ["ta gam"]) == "ta gam"
    assert find_stop(tokenizer, ids, 1, ["delta"]) is None
