# Per-request state inside one scheduler: token ids, how many have KV in the
# cache, and where it is in its life. Torch-free.

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from pipeline.messages import Sampling, TokenLogprob
from pipeline.streams import TIERS

DEFAULT_RANK = TIERS.index("default")


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    """`token_ids` is prompt + output; output includes tokens delivered before
    this scheduler saw the request. Invariant: num_computed <= num_tokens, and
    a sequence that samples has num_computed == num_tokens - 1 before the step."""

    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    sampling: Sampling
    seed: int  # the request's seed, or a random one drawn at admission
    arrival: int  # admission order: FCFS and "newest" for preemption
    num_computed: int = 0
    status: Status = Status.WAITING
    stop_ids: frozenset[int] = field(default_factory=frozenset)
    # Sampling.prompt_logprobs: each prompt token's (from the second on) as its
    # logits are computed; None when not wanted or once sent with the first token
    prompt_logprobs: list[TokenLogprob] | None = None
    grammar: object = None  # an xgrammar matcher where Sampling.structure holds it
    num_cached_tokens: int = 0  # prompt tokens its latest admission found in the prefix cache
    rank: int = DEFAULT_RANK  # its service tier's: 0 the most urgent, first admitted

    @property
    def order(self) -> tuple[int, int]:
        """Admission order: the most urgent tier first, then first come first served."""
        return self.rank, self.arrival

    @property
    def collects_prompt(self) -> bool:
        """Whether prompt tokens' logprobs are still to be computed: the prompt is
        then computed whole, with no prefix reuse."""
        return (self.prompt_logprobs is not None
                and len(self.prompt_logprobs) < self.num_prompt_tokens - 1)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed

    @property
    def is_decoding(self) -> bool:
        return len(self.token_ids) - self.num_computed == 1

    @property
    def min_tokens_reached(self) -> bool:
        return self.num_output_tokens >= self.sampling.min_tokens

    def finish_reason(self, max_context: int) -> str | None:
        """Why it stops after its last token, or None to go on."""
        last = self.token_ids[-1]
        if self.num_output_tokens > 0 and last in self.stop_ids and self.min_tokens_reached:
            return "stop"
        if self.num_output_tokens >= self.sampling.max_tokens or self.num_tokens >= max_context:
            return "length"
        return None
