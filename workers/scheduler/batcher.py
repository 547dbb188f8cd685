# Continuous batching policy, torch-free: which sequences run this step and
# with how many tokens. FCFS admission, chunked prefill under a per-step token
# budget, and preemption by recompute when KV blocks run out. A prompt whose
# next uncached block another admitted prompt is computing waits for it (and
# lets those behind it go first), so a burst sharing a prefix computes it once.

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from workers.scheduler.blocks import BlockAllocator
from workers.scheduler.sequence import Sequence, Status


@dataclass
class Chunk:
    """`num_tokens` tokens of `seq` starting at position `start`."""

    seq: Sequence
    start: int
    num_tokens: int

    @property
    def samples(self) -> bool:
        # the chunk reaches the last token, so its logits pick the next one
        return self.start + self.num_tokens == self.seq.num_tokens


@dataclass
class StepPlan:
    """Decode chunks (one token each) come first, then prefill chunks."""

    chunks: list[Chunk] = field(default_factory=list)
    block_size: int = 16

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    def positions(self) -> list[int]:
        return [p for c in self.chunks for p in range(c.start, c.start + c.num_tokens)]

    def input_ids(self) -> list[int]:
        return [t for c in self.chunks for t in c.seq.token_ids[c.start:c.start + c.num_tokens]]


class Batcher:
    def __init__(self, allocator: BlockAllocator, max_running_requests: int,
                 max_batch_tokens: int):
        self.allocator = allocator
        self.max_running_requests = max_running_requests
        self.max_batch_tokens = max_batch_tokens
        self.waiting: deque[Sequence] = deque()  # in admission order (Sequence.order)
        self.running: list[Sequence] = []  # in admission order: the last is the newest
        self.num_preemptions = 0
        self.num_prefix_hit_tokens = 0

    def add(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        self._wait(seq)

    def _wait(self, seq: Sequence) -> None:
        """Into the queue behind every sequence that comes before it (Sequence.order):
        a more urgent tier's, or its own tier's that arrived earlier."""
        at = len(self.waiting)
        while at > 0 and self.waiting[at - 1].order > seq.order:
            at -= 1
        self.waiting.insert(at, seq)

    def schedule(self) -> StepPlan:
        plan = StepPlan(block_size=self.allocator.block_size)
        budget = self.max_batch_tokens
        self._yield_to_urgent()
        for seq in self._grow_decoding(budget):
            plan.chunks.append(Chunk(seq, seq.num_computed, 1))
            budget -= 1
        for seq in self.running:
            if not seq.is_decoding and budget > 0:
                plan.chunks.append(self._prefill_chunk(seq, budget))
                budget -= plan.chunks[-1].num_tokens
        awaiting: list[Sequence] = []  # their prefix is being computed: admitted after it
        while budget > 0 and self.waiting and len(self.running) < self.max_running_requests:
            seq = self.waiting[0]
            # hashed once for all three; none for a prompt whose logprobs are wanted
            found = [] if seq.collects_prompt else self.allocator.cached_prefix(seq.token_ids)
            if not seq.collects_prompt and self.allocator.awaits_prefix(seq.token_ids, found):
                awaiting.append(self.waiting.popleft())
                continue
            if not self.allocator.can_allocate(seq.token_ids, found):
                break  # FCFS: nobody overtakes the head of the queue for blocks
            self._admit(self.waiting.popleft(), found)
            plan.chunks.append(self._prefill_chunk(seq, budget))
            budget -= plan.chunks[-1].num_tokens
        self.waiting.extendleft(reversed(awaiting))
        return plan

    def room(self, num_ranks: int) -> list[int]:
        """How many more requests of each tier (rank 0, the most urgent, first) this
        batcher can take: its free slots and blocks, less those the waiting requests
        will need. A more urgent tier also counts the slots and blocks that less urgent
        requests hold, as it takes them (`_yield_to_urgent`). Blocks by the request,
        one at least each; a running request's as its table holds them."""
        slots = [self.max_running_requests] * num_ranks
        blocks = [self.allocator.num_free_blocks] * num_ranks
        for seq in self.waiting:
            needed = self.allocator.blocks_needed(seq.num_tokens)
            for rank in range(seq.rank, num_ranks):
                slots[rank] -= 1
                blocks[rank] -= needed
        for seq in self.running:
            held = len(self.allocator.block_table(seq.request_id))
            for rank in range(num_ranks):
                if rank >= seq.rank:
                    slots[rank] -= 1
                else:
                    blocks[rank] += held
        return [max(0, min(s, b)) for s, b in zip(slots, blocks, strict=True)]

    def _yield_to_urgent(self) -> None:
        """Waiting sequences of a more urgent tier than some running ones, the most
        urgent first: where a slot or its blocks are short, the least urgent running
        sequences make way (preempted, to be recomputed later) until it fits. Within
        a tier nobody is preempted for an arrival, nor for one that would not fit
        with every less urgent one gone. The blocks are checked for each sequence
        alone, the slots for them all."""
        reserved = 0  # slots made for earlier ones, taken by them this step or the next
        for seq in list(self.waiting):
            victims = [running for running in self.running if running.rank > seq.rank]
            if not victims:  # (one tier alone: every step ends here, its prompt unhashed)
                return
            found = [] if seq.collects_prompt else self.allocator.cached_prefix(seq.token_ids)
            if not self.allocator.can_allocate(seq.token_ids, found,
                                               [victim.request_id for victim in victims]):
                return  # the head of the queue waits, and so does everyone behind it
            while victims and (len(self.running) + reserved >= self.max_running_requests
                               or not self.allocator.can_allocate(seq.token_ids, found)):
                victim = max(victims, key=lambda s: s.order)
                victims.remove(victim)
                self._preempt(victim)
            reserved += 1

    def finish(self, seq: Sequence) -> None:
        seq.status = Status.FINISHED
        self.running.remove(seq)
        self.allocator.free(seq.request_id)

    def abort(self, request_id: str) -> Sequence | None:
        for seq in self.waiting:
            if seq.request_id == request_id:
                self.waiting.remove(seq)
                seq.status = Status.FINISHED
                return seq
        for seq in self.running:
            if seq.request_id == request_id:
                self.finish(seq)
                return seq
        return None

    def _grow_decoding(self, budget: int) -> list[Sequence]:
        """Decoding sequences that got a slot for their next token, the most urgent
        tier's first, oldest first; the least urgent newest are preempted until the
        rest fit."""
        granted: list[Sequence] = []
        for seq in sorted(self.running, key=lambda s: s.order):
            if len(granted) == budget:
                break
            if seq.status is not Status.RUNNING or not seq.is_decoding:
                continue
            while not self.allocator.may_append(seq.request_id, seq.num_tokens):
                victim = max(self.running, key=lambda s: s.order)  # the least urgent
                self._preempt(victim)
                if victim is seq:
                    break
            if seq.status is Status.RUNNING:
                self.allocator.append(seq.request_id, seq.num_tokens)
                granted.append(seq)
        return granted

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.allocator.free(seq.request_id)
        seq.num_computed = 0
        if seq.collects_prompt:  # computed again from its start
            seq.prompt_logprobs = []
        seq.status = Status.WAITING
        self._wait(seq)  # first of its tier again, as it arrived before the rest
        self.num_preemptions += 1

    def _admit(self, seq: Sequence, found: list[int]) -> None:
        seq.num_computed = self.allocator.allocate(seq.request_id, seq.token_ids, found,
                                                   reuse=not seq.collects_prompt)
        self.num_prefix_hit_tokens += seq.num_computed
        seq.num_cached_tokens = min(seq.num_computed, seq.num_prompt_tokens)
        seq.status = Status.RUNNING
        self.running.append(seq)

    def _prefill_chunk(self, seq: Sequence, budget: int) -> Chunk:
        return Chunk(seq, seq.num_computed, min(seq.num_uncomputed, budget))
