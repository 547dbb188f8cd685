"""Batched sampling on synthetic logits: greedy, filters, penalties,
min_tokens, seeded draws that depend only on (seed, position), logprobs, logit_bias."""

from __future__ import annotations

import math

import torch

from pipeline.messages import Sampling
from workers.scheduler.grammar import penalty_bitwise, penalty_shifted
from workers.scheduler.sampler import (
    Sampler,
    apply_filters,
    apply_penalties,
    greedy,
    gumbel_noise,
    plain_greedy,
)
from workers.scheduler.sequence import Sequence

VOCAB = 8


def seq(sampling: Sampling, output: list[int] = (), seed: int = 0,
        stop_ids: frozenset[int] = frozenset()) -> Sequence:
    prompt = [0, 1]
    return Sequence("r", prompt + list(output), len(prompt), sampling, seed, 0, stop_ids=stop_ids)


def logits_of(*rows: list[float]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


def test_temperature_zero_is_argmax():
    logits = logits_of([0, 3, 1, 0, 0, 0, 0, 0], [5, 0, 0, 0, 0, 0, 0, 9])
    greedy = Sampling(temperature=0.0)
    assert Sampler()(logits, [seq(greedy), seq(greedy)]).token_ids == [1, 7]


def test_greedy_takes_the_first_of_equal_maxima_as_argmax_does():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randint(0, 50, (64, 49152), generator=generator).float()  # many ties
    logits[3] = 0.0
    assert torch.equal(greedy(logits), logits.argmax(-1))
    assert greedy(logits)[3].item() == 0


def test_a_mixed_batch_keeps_greedy_rows_greedy():
    logits = logits_of([0, 3, 1, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0, 0, 0])
    picks = Sampler()(logits, [seq(Sampling(temperature=0.0)), seq(Sampling(), seed=3)])
    assert picks.token_ids[0] == 1


def test_the_same_seed_and_position_draw_the_same_token_and_others_vary():
    logits = torch.zeros(1, 1000)
    sampling = Sampling(temperature=1.0)
    draw = [Sampler()(logits, [seq(sampling, seed=5)]).token_ids[0] for _ in range(3)]
    assert len(set(draw)) == 1
    by_seed = {Sampler()(logits, [seq(sampling, seed=s)]).token_ids[0] for s in range(20)}
    by_position = {Sampler()(logits, [seq(sampling, [9] * n, seed=5)]).token_ids[0]
                   for n in range(20)}
    assert len(by_seed) > 15 and len(by_position) > 15


def test_seeded_draws_follow_the_softmax_distribution():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    num = 4000
    noise = gumbel_noise(torch.arange(num), torch.zeros(num, dtype=torch.long), 4)
    picks = (probs.log()[None, :] + noise).argmax(-1)
    freq = torch.bincount(picks, minlength=4).float() / num
    assert (freq - probs).abs().max().item() < 0.03


def test_top_k_top_p_and_min_p_drop_unlikely_tokens_but_keep_the_best():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]] * 4))
    cases = [Sampling(top_k=2), Sampling(top_p=0.7), Sampling(min_p=0.35), Sampling(top_p=0.01)]
    kept = apply_filters(logits, [seq(s) for s in cases]).isfinite()
    assert kept.tolist() == [[True, True, False, False], [True, True, False, False],
                             [True, True, False, False], [True, False, False, False]]


def test_penalties_lower_the_logits_of_tokens_already_seen():
    logits = logits_of([2.0] * VOCAB, [2.0] * VOCAB, [-2.0] * VOCAB)
    seqs = [seq(Sampling(frequency_penalty=0.5), [5, 5]),
            seq(Sampling(presence_penalty=0.5), [5, 5]),
            seq(Sampling(repetition_penalty=2.0), [5])]
    out = apply_penalties(logits, seqs)
    assert out[0, 5].item() == 1.0 and out[0, 4].item() == 2.0
    assert out[1, 5].item() == 1.5
    # repetition covers prompt tokens too, and makes negative logits more negative
    assert out[2, 5].item() == -4.0 and out[2, 0].item() == -4.0 and out[2, 3].item() == -2.0


def test_stop_ids_are_masked_until_min_tokens_are_out():
    logits = logits_of([0, 0, 9, 1, 0, 0, 0, 0])
    greedy = Sampling(temperature=0.0, min_tokens=2)
    sampler = Sampler()
    assert sampler(logits, [seq(greedy, [4], stop_ids=frozenset({2}))]).token_ids == [3]
    assert sampler(logits, [seq(greedy, [4, 4], stop_ids=frozenset({2}))]).token_ids == [2]


def test_logit_bias_bans_and_favours_tokens_of_its_own_row_only():
    logits = logits_of([0, 0, 9, 1, 0, 0, 0, 0], [0, 0, 9, 1, 0, 0, 0, 0])
    banned = Sampling(temperature=0.0, logit_bias={2: -100.0})
    favoured = Sampling(temperature=0.0, logit_bias={5: 9.5, 6: 3.0})
    plain = Sampling(temperature=0.0)
    assert Sampler()(logits, [seq(banned), seq(plain)]).token_ids == [3, 2]
    assert Sampler()(logits, [seq(plain), seq(favoured)]).token_ids == [2, 5]
    # a sampled row draws from the biased distribution: -100 leaves a token no chance
    draws = Sampler()(logits[:1].expand(64, -1).clone(),
                      [seq(Sampling(logit_bias={2: -100.0}), seed=i) for i in range(64)])
    assert 2 not in draws.token_ids
    # logprobs stay the model's own
    [chosen] = Sampler()(logits[:1], [seq(Sampling(temperature=0.0, logprobs=1,
                                                    logit_bias={2: -100.0}))]).logprobs[0]
    expected = torch.log_softmax(logits[0], -1)
    assert chosen.token_id == 3 and math.isclose(chosen.logprob, expected[3].item(), rel_tol=1e-5)
    assert [t.token_id for t in chosen.top] == [2]


def test_logprobs_report_the_chosen_token_and_the_top_alternatives():
    logits = logits_of([0, 2, 1, 0, 0, 0, 0, 0])
    [chosen] = Sampler()(logits, [seq(Sampling(temperature=0.0, logprobs=2))]).logprobs[0]
    expected = torch.log_softmax(logits[0], -1)
    assert chosen.token_id == 1 and math.isclose(chosen.logprob, expected[1].item(), rel_tol=1e-5)
    assert [t.token_id for t in chosen.top] == [1, 2]


def test_plain_greedy_says_when_the_raw_argmax_is_every_pick():
    """The engine's fused lm_head argmax serves only these steps."""
    greedy_ = Sampling(temperature=0.0)
    assert plain_greedy([seq(greedy_), seq(greedy_, stop_ids=frozenset({3}))])
    assert not plain_greedy([seq(greedy_), seq(Sampling(temperature=0.7))])
    assert not plain_greedy([seq(Sampling(temperature=0.0, repetition_penalty=1.2))])
    assert not plain_greedy([seq(Sampling(temperature=0.0, logprobs=0))])
    assert not plain_greedy([seq(Sampling(temperature=0.0, logit_bias={5: 1.0}))])
    # min_tokens not reached: a stop id is masked out of the logits first
    held = Sampling(temperature=0.0, min_tokens=3)
    assert not plain_greedy([seq(held, stop_ids=frozenset({3}))])
    assert plain_greedy([seq(held, output=[4, 5, 6], stop_ids=frozenset({3}))])


def test_a_grammars_bitmask_bars_the_same_tokens_either_way():
    """The CPU's bitwise penalty equals torch's shifted one (a GPU's): 0 where a token's
    bit is set, -inf where not, a vocabulary that ends inside a 32-bit word included."""
    vocab = 49155
    bitmask = torch.randint(-2**31, 2**31 - 1, (5, (vocab + 31) // 32), dtype=torch.int32)
    bitwise = penalty_bitwise(bitmask, vocab)
    assert bitwise.shape == (5, vocab) and torch.equal(bitwise, penalty_shifted(bitmask, vocab))
    token = 32 * 7 + 5
    allowed = bool(bitmask[2, 7] >> 5 & 1)
    assert bitwise[2, token].item() == (0.0 if allowed else -math.inf)
    assert set(bitwise.unique().tolist()) == {0.0, -math.inf}
