"""Incremental detokenization as a pure function of token ids, so any
detokenizer can take any step: the text a step shows is what the full output
shows after it, minus an unfinished UTF-8 character and minus a tail that
could still become a stop string."""

from __future__ import annotations

from pipeline.messages import StepOutput
from pipeline.tokenizer import Tokenizer

REPLACEMENT = "\ufffd"


def stop_window(stop: list[str]) -> int:
    """How many earlier output ids a step must carry: enough for a partial
    multi-byte character (≤ 4 byte tokens) and the longest stop string."""
    return min(64, 6 + 2 * max((len(s) for s in stop), default=0))


def held_back(text: str, stop: list[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
    longest = 0
    for s in stop:
        for n in range(min(len(s) - 1, len(text)), longest, -1):
            if text.endswith(s[:n]):
                longest = n
                break
    return longest


def visible(text: str, stop: list[str]) -> str:
    text = text.rstrip(REPLACEMENT)
    return text[: len(text) - held_back(text, stop)]


def final(text: str, shown: int, matched_stop: str | None) -> str:
    """The whole text once the request finished: cut at the stop string that ended it."""
    if matched_stop:
        at = text.find(matched_stop, shown)
        if at < 0:
            at = text.find(matched_stop)
        if at >= 0:
            return text[:at]
    return text.rstrip(REPLACEMENT)


def step_text(tokenizer: Tokenizer, output: StepOutput) -> str:
    skip = output.skip_special_tokens
    before = visible(tokenizer.decode(output.prefix_ids, skip), output.stop)
    after_raw = tokenizer.decode(output.prefix_ids + output.new_ids, skip)
    if output.finish is not None:
        after = final(after_raw, len(before), output.matched_stop)
    else:
        after = visible(after_raw, output.stop)
    if len(after) <= len(before):
        return ""
    return after[len(before):]


def find_stop(tokenizer: Tokenizer, output_ids: list[int], num_new: int, stop: list[str],
              skip_special_tokens: bool = True) -> str | None:
    """The stop string the newest ids completed, if any (scheduler side)."""
    window = output_ids[-(stop_window(stop) + num_new):]
    text = tokenizer.decode(window, skip_special_tokens)
    hits = [(text.find(s), s) for s in stop if s in text]
    return min(hits)[1] if hits else None
