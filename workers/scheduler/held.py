# A request a scheduler runs, with the output ids it holds back between
# deltas (Submit.stream_interval): what goes out to the client, and when.

from __future__ import annotations

from dataclasses import dataclass, field

from pipeline.messages import StepOutput, Submit, TokenLogprob
from workers.text import stop_window


@dataclass
class Running:
    submit: Submit
    entry: tuple[str, str]  # its Submit's lane and entry id (lanes.Ref)
    output_ids: list[int]  # everything the client will have: delivered before + generated here
    sent: int  # of output_ids, those on their way to the client; the rest are held
    held_logprobs: list[TokenLogprob] = field(default_factory=list)  # the held ids'
    held_prompt_logprobs: list[TokenLogprob] | None = None  # until the first delta goes
    cached_tokens: int | None = None  # as its first step result here found them

    def due(self, finish: str | None) -> bool:
        """Whether the held ids go out now (Submit.stream_interval): a streamed
        run's first token at once (its time to first token waits for no chunk),
        then every `interval`. Until min_tokens the ids go out step by step when
        there are stop strings: a stop string completed before min_tokens does
        not count, and the detokenizer cuts the text at the first one it is sent."""
        interval, sampling = self.submit.stream_interval, self.submit.sampling
        if finish is not None or interval == 1:
            return True
        if sampling.stop and len(self.output_ids) < sampling.min_tokens:
            return True
        if interval == 0:
            return False
        first = self.sent == len(self.submit.output_ids)
        return first or len(self.output_ids) - self.sent >= interval

    def release(self, finish: str | None, matched: str | None,
                with_logprobs: bool) -> StepOutput:
        """The held ids as a StepOutput, now on their way (`due` said so)."""
        sampling = self.submit.sampling
        offset, self.sent = self.sent, len(self.output_ids)
        cached = self.cached_tokens if offset == len(self.submit.output_ids) else None  # once
        prefix = self.output_ids[max(0, offset - stop_window(sampling.stop)):offset]
        logprobs = self.held_logprobs if with_logprobs else None
        prompt_logprobs, self.held_logprobs, self.held_prompt_logprobs = (
            self.held_prompt_logprobs, [], None)
        return StepOutput(self.submit.request_id, self.submit.reply_to, offset,
                          self.output_ids[offset:], prefix, finish, sampling.stop, matched,
                          logprobs, self.submit.attempt, sampling.skip_special_tokens,
                          prompt_logprobs, cached)
