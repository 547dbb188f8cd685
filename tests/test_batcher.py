"""Continuous batching policy, without torch or a model: FCFS admission,
per-step token budget with chunked prefill, slot limits, preemption."""

from __future__ import annotations

from pipeline.messages import Sampling
from workers.scheduler.batcher import Batcher, StepPlan
from workers.scheduler.blocks import BlockAllocator
from workers.scheduler.sequence import Sequence, Status

SIZE = 4


def make(num_blocks: int = 64, max_running: int = 8, max_tokens: int = 32) -> Batcher:
    return Batcher(BlockAllocator(num_blocks, SIZE), max_running, max_tokens)


def seq(request_id: str, num_prompt: int, arrival: int = 0) -> Sequence:
    """Prompts of different arrivals share no tokens, so no prefix reuse between them."""
    first = 1000 * arrival
    return Sequence(request_id, list(range(first, first + num_prompt)), num_prompt, Sampling(), 0,
                    arrival)


def finish_step(batcher: Batcher, plan: StepPlan, new_token: int = 7) -> None:
    """What the engine does after the model ran: count computed tokens, append samples."""
    for chunk in plan.chunks:
        chunk.seq.num_computed += chunk.num_tokens
        batcher.allocator.cache_full_blocks(chunk.seq.request_id, chunk.seq.token_ids,
                                            chunk.seq.num_computed)
        if chunk.samples:
            chunk.seq.token_ids.append(new_token)


def test_a_new_request_is_prefilled_whole_when_it_fits_the_budget():
    batcher = make()
    batcher.add(seq("a", 10))
    plan = batcher.schedule()
    assert [(c.seq.request_id, c.start, c.num_tokens, c.samples) for c in plan.chunks] == [
        ("a", 0, 10, True)]
    assert plan.positions() == list(range(10))


def test_a_long_prompt_is_prefilled_in_chunks_within_the_token_budget():
    batcher = make(max_tokens=8)
    batcher.add(seq("a", 20))
    sizes = []
    for _ in range(3):
        plan = batcher.schedule()
        sizes.append([(c.start, c.num_tokens, c.samples) for c in plan.chunks])
        finish_step(batcher, plan)
    assert sizes == [[(0, 8, False)], [(8, 8, False)], [(16, 4, True)]]
    assert batcher.schedule().chunks[0].num_tokens == 1  # now decoding


def test_requests_join_and_leave_every_step_with_decodes_first():
    batcher = make(max_tokens=16)
    batcher.add(seq("a", 6))
    finish_step(batcher, plan := batcher.schedule())
    batcher.add(seq("b", 30, arrival=1))
    plan = batcher.schedule()
    assert [(c.seq.request_id, c.num_tokens) for c in plan.chunks] == [("a", 1), ("b", 15)]
    assert plan.num_tokens == 16
    finish_step(batcher, plan)
    batcher.finish(batcher.running[0])
    plan = batcher.schedule()
    assert [(c.seq.request_id, c.start, c.num_tokens) for c in plan.chunks] == [("b", 15, 15)]


def test_admission_is_first_come_first_served_and_capped_by_max_running():
    batcher = make(max_running=2, max_tokens=100)
    for i in range(3):
        batcher.add(seq(f"r{i}", 5, arrival=i))
    plan = batcher.schedule()
    assert [c.seq.request_id for c in plan.chunks] == ["r0", "r1"]
    assert [s.request_id for s in batcher.waiting] == ["r2"]


def test_the_head_of_the_queue_is_not_overtaken_when_its_blocks_are_short():
    batcher = make(num_blocks=4, max_tokens=100)
    batcher.add(seq("big", 20))
    batcher.add(seq("small", 2, arrival=1))
    assert batcher.schedule().chunks == []
    assert len(batcher.waiting) == 2


def test_running_out_of_blocks_preempts_the_newest_and_requeues_it_first():
    batcher = make(num_blocks=2, max_tokens=100)
    batcher.add(seq("old", 4))
    batcher.add(seq("new", 4, arrival=1))
    finish_step(batcher, batcher.schedule())  # each holds one full block, then samples a 5th
    plan = batcher.schedule()
    assert [c.seq.request_id for c in plan.chunks] == ["old"]
    assert batcher.num_preemptions == 1
    victim = batcher.waiting[0]
    assert (victim.request_id, victim.status, victim.num_computed) == ("new", Status.WAITING, 0)
    assert victim.token_ids == [1000, 1001, 1002, 1003, 7]  # kept for the recompute


def test_a_preempted_request_resumes_once_blocks_come_back():
    batcher = make(num_blocks=2, max_tokens=100)
    batcher.add(seq("old", 4))
    batcher.add(seq("new", 4, arrival=1))
    finish_step(batcher, batcher.schedule())
    batcher.schedule()
    batcher.finish(batcher.running[0])
    plan = batcher.schedule()
    # its cached block was evicted to let "old" grow: prompt and sampled token are recomputed
    assert [(c.seq.request_id, c.start, c.num_tokens, c.samples) for c in plan.chunks] == [
        ("new", 0, 5, True)]


def test_abort_removes_a_request_wherever_it_is():
    batcher = make(max_running=1)
    batcher.add(seq("running", 5))
    batcher.add(seq("waiting", 5, arrival=1))
    batcher.schedule()
    free = batcher.allocator.num_free_blocks
    assert batcher.abort("waiting").request_id == "waiting"
    assert batcher.abort("running").request_id == "running"
    assert batcher.allocator.num_free_blocks == free + 2
    assert batcher.abort("unknown") is None
    assert not batcher.running and not batcher.waiting


def test_decodes_beyond_the_token_budget_wait_for_the_next_step():
    batcher = make(max_tokens=2)
    for i in range(3):
        batcher.add(seq(f"r{i}", 2, arrival=i))
    for _ in range(3):
        finish_step(batcher, batcher.schedule())
    assert all(s.is_decoding for s in batcher.running)
    plan = batcher.schedule()
    assert [c.seq.request_id for c in plan.chunks] == ["r0", "r1"]


def test_a_burst_sharing_a_prefix_computes_it_once():
    """Prompts whose first blocks another admitted prompt is computing wait a
    step for them; a prompt sharing nothing goes ahead meanwhile."""
    shared = list(range(500, 509))  # 2 full blocks and a token
    batcher = make(max_tokens=64)
    batcher.add(Sequence("first", shared + [1, 2], 11, Sampling(), 0, 0))
    batcher.add(Sequence("second", shared + [3, 4, 5], 12, Sampling(), 0, 1))
    batcher.add(Sequence("third", shared + [6], 10, Sampling(), 0, 2))
    batcher.add(seq("other", 6, arrival=3))
    plan = batcher.schedule()
    assert [(c.seq.request_id, c.start, c.num_tokens) for c in plan.chunks] == [
        ("first", 0, 11), ("other", 0, 6)]
    assert [s.request_id for s in batcher.waiting] == ["second", "third"]  # in order
    finish_step(batcher, plan)
    plan = batcher.schedule()
    # both reuse its 2 blocks ("first"'s third is not full yet, so not cached)
    assert [(c.seq.request_id, c.start, c.num_tokens) for c in plan.chunks][2:] == [
        ("second", 8, 4), ("third", 8, 2)]
    assert batcher.num_prefix_hit_tokens == 16
    # what each prompt found, for its usage's cached_tokens
    assert [c.seq.num_cached_tokens for c in plan.chunks] == [0, 0, 8, 8]


def test_a_prompt_awaiting_a_prefix_goes_ahead_when_its_computer_leaves():
    shared = list(range(500, 512))
    batcher = make()
    batcher.add(Sequence("first", shared + [1], 13, Sampling(), 0, 0))
    batcher.add(Sequence("second", shared + [2], 13, Sampling(), 0, 1))
    batcher.schedule()
    assert [s.request_id for s in batcher.waiting] == ["second"]
    batcher.abort("first")  # its prefill never ran: nothing is cached, nothing promised
    plan = batcher.schedule()
    assert [(c.seq.request_id, c.start) for c in plan.chunks] == [("second", 0)]


def test_a_more_urgent_tier_is_admitted_first_and_preempted_last():
    """Waiting requests go most urgent tier first, each tier first come first
    served; when blocks run out, the least urgent tier's newest is preempted, even
    where a more urgent one was admitted after it."""
    waiting = make()
    for request_id, rank in (("flex", 2), ("default", 1), ("priority", 0), ("flex 2", 2),
                             ("priority 2", 0)):
        waiting.add(Sequence(request_id, [1, 2], 2, Sampling(), 0, len(waiting.waiting),
                             rank=rank))
    assert [s.request_id for s in waiting.waiting] == [
        "priority", "priority 2", "default", "flex", "flex 2"]

    batcher = make(num_blocks=5)
    batcher.add(Sequence("flex", list(range(8)), 8, Sampling(), 0, 0, rank=2))
    finish_step(batcher, batcher.schedule())  # 2 blocks, then its first token
    batcher.add(Sequence("urgent", list(range(100, 108)), 8, Sampling(), 0, 1, rank=0))
    finish_step(batcher, batcher.schedule())  # flex's 3rd block, urgent's 2: all 5
    plan = batcher.schedule()  # urgent's 9th token needs a block: flex gives its 3
    assert [c.seq.request_id for c in plan.chunks] == ["urgent"]
    assert [s.request_id for s in batcher.waiting] == ["flex"]
    assert batcher.num_preemptions == 1


def test_a_more_urgent_arrival_short_of_blocks_preempts_a_less_urgent_running_one():
    """Blocks run short: a waiting request of a more urgent tier takes them from the
    least urgent running request (preempted, recomputed later); one of the same tier
    as every less urgent running one waits its turn."""
    batcher = make(num_blocks=6)
    batcher.add(Sequence("flex", list(range(10)), 10, Sampling(), 0, 0, rank=2))
    batcher.add(Sequence("default", list(range(100, 106)), 6, Sampling(), 0, 1, rank=1))
    finish_step(batcher, batcher.schedule())  # 3 + 2 blocks of 6, room left in each
    batcher.add(Sequence("late flex", list(range(200, 208)), 8, Sampling(), 0, 2, rank=2))
    finish_step(batcher, batcher.schedule())
    assert [s.request_id for s in batcher.waiting] == ["late flex"]  # 2 blocks: 1 free
    assert batcher.num_preemptions == 0
    batcher.add(Sequence("urgent", list(range(300, 308)), 8, Sampling(), 0, 3, rank=0))
    plan = batcher.schedule()
    assert "urgent" in [c.seq.request_id for c in plan.chunks]
    assert [s.request_id for s in batcher.waiting] == ["flex", "late flex"]
    assert batcher.num_preemptions == 1


def test_more_urgent_arrivals_take_the_slots_of_less_urgent_running_ones():
    """Every slot is taken by a default request: two priority arrivals each take one
    in the same step, from the newest defaults; a flex arrival takes none."""
    batcher = make(max_running=3)
    for i in range(3):
        batcher.add(Sequence(f"default {i}", list(range(10 * i, 10 * i + 4)), 4, Sampling(), 0,
                             i, rank=1))
    finish_step(batcher, batcher.schedule())
    batcher.add(Sequence("flex", list(range(100, 104)), 4, Sampling(), 0, 3, rank=2))
    finish_step(batcher, batcher.schedule())
    assert batcher.num_preemptions == 0
    for i in range(2):
        batcher.add(Sequence(f"priority {i}", list(range(200 + 10 * i, 204 + 10 * i)), 4,
                             Sampling(), 0, 4 + i, rank=0))
    plan = batcher.schedule()
    assert sorted(c.seq.request_id for c in plan.chunks) == ["default 0", "priority 0",
                                                             "priority 1"]
    assert [s.request_id for s in batcher.waiting] == ["default 1", "default 2", "flex"]
    assert batcher.num_preemptions == 2


def test_room_by_tier_counts_what_less_urgent_requests_hold():
    """A tier's room is the free slots and blocks less what waits in it and the more
    urgent tiers, plus what the less urgent tiers hold: with the least urgent tier's
    room, the plain count of free slots and blocks."""
    batcher = make(num_blocks=8, max_running=4)
    assert batcher.room(3) == [4, 4, 4]
    batcher.add(Sequence("default", list(range(20)), 20, Sampling(), 0, 0, rank=1))
    finish_step(batcher, batcher.schedule())  # running: 5 blocks of 4 tokens held, 3 free
    # priority: 4 slots and 3 + 5 blocks (without default's, 3)
    assert batcher.room(3) == [4, 3, 3]
    batcher.add(Sequence("flex", list(range(100, 108)), 8, Sampling(), 0, 1, rank=2))
    assert batcher.room(3) == [4, 3, 1]  # flex waits for 2 of the 3 free blocks
    batcher.add(Sequence("big", list(range(200, 212)), 12, Sampling(), 0, 2, rank=1))
    assert batcher.room(3) == [4, 0, 0]  # big waits for all 3


def test_nobody_is_preempted_for_a_request_that_would_not_fit_anyway():
    """The urgent arrival needs more blocks than the free ones and the less urgent
    request's together (an equally urgent one holds the rest): the less urgent one
    keeps running, and the arrival waits for blocks to free."""
    batcher = make(num_blocks=10)
    batcher.add(Sequence("priority", list(range(24)), 24, Sampling(), 0, 0, rank=0))
    batcher.add(Sequence("flex", list(range(100, 108)), 8, Sampling(), 0, 1, rank=2))
    finish_step(batcher, batcher.schedule())  # 6 + 2 blocks of 10
    batcher.add(Sequence("urgent", list(range(200, 220)), 20, Sampling(), 0, 2, rank=0))
    plan = batcher.schedule()  # urgent needs 5: 2 free and flex's 3 would not do
    assert sorted(c.seq.request_id for c in plan.chunks) == ["flex", "priority"]
    assert [s.request_id for s in batcher.waiting] == ["urgent"]
    assert batcher.num_preemptions == 0
