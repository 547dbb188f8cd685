"""Attention read in place from the paged cache (our C kernel: decodes, and
prefill tokens as rows of their own) against the torch gather path and SDPA,
on scattered block tables and uneven lengths."""

import random

import pytest
import torch

from pipeline.messages import Sampling
from workers.scheduler import native, paged
from workers.scheduler.attention import KVCache, TorchAttention, kv_dtype, make_cache
from workers.scheduler.batcher import Chunk, StepPlan
from workers.scheduler.blocks import Copy
from workers.scheduler.native import NEEDS_AVX512, cpu_flags
from workers.scheduler.sequence import Sequence

LAYERS, BLOCKS, BLOCK, HEADS, KV_HEADS, DIM = 2, 40, 16, 9, 3, 64


def step(in_place: bool, lengths: list[int], prefill: int = 0, sharpness: float = 1.0,
         dtype: torch.dtype = torch.float32, heads: int = HEADS,
         kv_heads: int = KV_HEADS, prefill_from: int = 0, kv_cache_dtype: str = "model",
         kv_in_bf16: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """One step's attention output for decode rows at `lengths` (and one
    prefill chunk after them: positions `prefill_from` to `prefill`, the ones
    before it cached already), same random inputs;
    `sharpness` scales the queries, so the softmax runs from flat to one-hot.
    `kv_cache_dtype` "model": bf16 for a bf16 model, else fp32; "auto": as
    kv_dtype picks it beside int8 activations. `kv_in_bf16`: the cache's
    contents and the step's keys and values rounded to bf16 (in their dtype).
    Returns it with the KV cache after the step."""
    generator = torch.Generator().manual_seed(0)
    cache = make_cache("torch", LAYERS, BLOCKS, BLOCK, kv_heads, DIM, dtype,
                       torch.device("cpu"), kv_cache_dtype, int8_activations=True)
    rounded = (lambda t: t.bfloat16().to(t.dtype)) if kv_in_bf16 else (lambda t: t)
    for tensor in cache.k + cache.v:
        tensor.copy_(rounded(torch.randn(tensor.shape, generator=generator)))
    if kv_cache_dtype == "model":
        assert cache.dtype == (torch.bfloat16 if dtype == torch.bfloat16 else torch.float32)
    blocks = list(range(BLOCKS))
    random.Random(0).shuffle(blocks)
    plan, tables = StepPlan(block_size=BLOCK), []
    for i, length in enumerate([*lengths, *([prefill] if prefill else [])]):
        decode = i < len(lengths)
        seq = Sequence(str(i), [1] * length, length, Sampling(), 0, i)
        plan.chunks.append(Chunk(seq, length - 1, 1) if decode
                           else Chunk(seq, prefill_from, length - prefill_from))
        tables.append([blocks.pop() for _ in range(-(-length // BLOCK))])
    attention = TorchAttention(cache, heads, kv_heads, DIM, in_place=in_place)
    assert attention.in_place == in_place
    attention.prepare(plan, tables, torch.device("cpu"))
    rows = plan.num_tokens
    q = sharpness * torch.randn(rows, heads, DIM, generator=generator)
    k, v = (rounded(torch.randn(rows, kv_heads, DIM, generator=generator)) for _ in range(2))
    qkv = torch.cat([q, k, v], dim=1).to(dtype)  # as the model hands them: rows apart
    q, k, v = qkv.split([heads, kv_heads, kv_heads], dim=1)
    with torch.inference_mode():
        out = torch.stack([attention(layer, q, k, v) for layer in range(LAYERS)]).float()
    return out, torch.stack(cache.k + cache.v)


@pytest.mark.skipif(paged.load() is None, reason="no AVX2 CPU or no C compiler")
@pytest.mark.parametrize("sharpness", [0.01, 1.0, 30.0])
@pytest.mark.parametrize("lengths", [[1], [17], [5, 16, 33, 100, 2], [64] * 6])
def test_in_place_decode_matches_the_gathered_one(lengths, sharpness):
    (ours, _), (gathered, _) = (step(in_place, lengths, 7, sharpness)
                                for in_place in (True, False))
    assert ours.shape == (LAYERS, len(lengths) + 7, HEADS * DIM)
    assert (ours - gathered).abs().max().item() < 5e-5  # fp32 rounding of scores
    assert ours.abs().max().item() > 0.1  # the values were attended, not left at zero


@pytest.mark.skipif(paged.load() is None, reason="no AVX2 CPU or no C compiler")
@pytest.mark.parametrize("prefill, prefill_from", [(40, 0), (70, 33), (130, 129)])
def test_in_place_prefill_matches_sdpa(prefill, prefill_from):
    """Prefill chunks, first or continuing a cached prefix (chunked prefill),
    causal within the chunk."""
    (ours, _), (theirs, _) = (step(in_place, [5, 20], prefill, prefill_from=prefill_from)
                              for in_place in (True, False))
    assert ours.shape == (LAYERS, 2 + prefill - prefill_from, HEADS * DIM)
    assert (ours - theirs).abs().max().item() < 5e-5


@pytest.mark.skipif(paged.load() is None, reason="no AVX2 CPU or no C compiler")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_in_place_decode_takes_the_models_dtype(dtype):
    lengths = [5, 16, 33, 100, 2]
    (ours, _), (gathered, _) = (step(in_place, lengths, 7, dtype=dtype)
                                for in_place in (True, False))
    # the gathered path rounds scores and probabilities to bf16 too; ours keeps fp32
    assert (ours - gathered).abs().max().item() < 2e-2


@pytest.mark.skipif(paged.load() is None, reason="no AVX2 CPU or no C compiler")
def test_an_fp32_model_beside_int8_activations_keeps_a_bf16_cache():
    """Its rows go in and out in fp32; the step's keys and values are rounded to
    bf16 as they are written, and attention reads the cache as the fp32 path
    reads the same values (the AVX-512 build: by bf16 dot products)."""
    cpu = torch.device("cpu")
    assert kv_dtype("torch", torch.float32, cpu, "auto", int8_activations=True) == torch.bfloat16
    assert kv_dtype("torch", torch.float32, cpu, "auto") == torch.float32  # exact activations
    assert kv_dtype("torch", torch.float32, cpu, "model", int8_activations=True) == torch.float32
    for lengths, prefill in (([5, 16, 33, 100, 2], 7), ([], 9), ([3, 40], 0)):
        ours, our_cache = step(True, lengths, prefill, kv_cache_dtype="auto")
        theirs, their_cache = step(True, lengths, prefill, kv_in_bf16=True)
        assert our_cache.dtype == torch.bfloat16 and ours.dtype == torch.float32
        assert torch.equal(our_cache.float(), their_cache)
        assert (ours - theirs).abs().max().item() < (2e-2 if "avx512_bf16" in cpu_flags()
                                                     else 5e-5)


@pytest.mark.skipif(paged.load() is None, reason="no AVX2 CPU or no C compiler")
def test_in_place_step_writes_every_new_key_and_value():
    for lengths in ([], [3, 40]):  # prefill only, and decodes before a prefill
        (ours, our_cache), (gathered, their_cache) = (step(in_place, lengths, 9)
                                                      for in_place in (True, False))
        assert torch.equal(our_cache, their_cache)
        assert (ours - gathered).abs().max().item() < 5e-5


@pytest.mark.skipif(paged.load() is None, reason="no AVX2 CPU or no C compiler")
@pytest.mark.parametrize("heads, kv_heads", [(8, 8), (8, 4), (8, 2), (10, 2)],
                         ids=["group1", "group2", "group4", "group5"])
def test_in_place_decode_takes_every_group_size(heads, kv_heads):
    """Query heads go 3 to a pass over the keys: groups of 1, 2, 4 and 5 leave
    every remainder."""
    lengths = [5, 16, 33, 100, 2]
    (ours, _), (gathered, _) = (step(in_place, lengths, 7, heads=heads, kv_heads=kv_heads)
                                for in_place in (True, False))
    assert (ours - gathered).abs().max().item() < 5e-5


@pytest.mark.skipif(not NEEDS_AVX512 <= cpu_flags() or paged.load() is None,
                    reason="no avx512_bf16 CPU or no C compiler")
@pytest.mark.parametrize("dim", [64, 128])
def test_avx512_bf16_build_matches_the_avx2_one(dim):
    """bf16 dot products are exact, as the AVX2 build's fp32 ones: q . k, and
    the weighted sum of values with the softmax's numerators in two bf16 parts
    (~2^-17). Within one bf16 rounding of the largest output (one bf16 part
    alone was 2^-8.6 of it here, and fails this)."""
    generator = torch.Generator().manual_seed(0)
    caches = [torch.randn(KV_HEADS, 64 * BLOCK, dim, generator=generator).bfloat16()
              for _ in range(2)]
    rows, width, lengths = 6, 10, torch.tensor([1, 15, 16, 17, 100, 160], dtype=torch.int32)
    tables = torch.randperm(64, generator=generator)[:rows * width].reshape(rows, width)
    last = (lengths - 1).long()  # each row's new key and value at its last position
    slots = tables[torch.arange(rows), last // BLOCK].long() * BLOCK + last % BLOCK
    q = torch.randn(rows, HEADS, dim, generator=generator).bfloat16()
    k, v = (torch.randn(rows, KV_HEADS, dim, generator=generator).bfloat16() for _ in range(2))
    outs = []
    for lib in (paged.load(), native.load(paged.SOURCE, paged.SIGNATURES)):
        k_cache, v_cache = caches[0].clone(), caches[1].clone()  # alive: the kernel keeps pointers
        kernel = paged.InPlace([k_cache], [v_cache], lib)
        kernel.prepare(slots, tables.to(torch.int32).contiguous(), lengths, BLOCK)
        out = torch.zeros(rows, HEADS * dim, dtype=torch.bfloat16)
        kernel(0, q, k, v, dim ** -0.5, out)
        outs.append(out.float())
    assert (outs[0] - outs[1]).abs().max().item() <= 2 ** -9 * outs[1].abs().max().item()
    assert outs[0].abs().max().item() > 0.1


@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_a_copy_moves_each_slot_of_every_layer_and_nothing_else(layout):
    """KVCache.copy, as the engine applies partial prefix reuse: both layouts (NHD
    is flashinfer's); a slot that is a source and, later in the list, a target
    gives its old contents."""
    cache = KVCache(2, 6, 4, 3, 8, torch.float32, torch.device("cpu"), layout)
    for tensor in (*cache.k, *cache.v):
        tensor.copy_(torch.randn(tensor.shape))
    before = [t.clone() for t in (*cache.k, *cache.v)]

    def slot(tensor: torch.Tensor, index: int) -> torch.Tensor:  # [kv_heads, dim]
        return tensor.flatten(0, 1)[index] if layout == "NHD" else tensor[:, index]

    cache.copy([Copy(1, 4, 3), Copy(4, 2, 2)])  # block 4's own first slots go to 2
    moved = {16: 4, 17: 5, 18: 6, 8: 16, 9: 17}  # target slot: source slot
    for old, new in zip(before, (*cache.k, *cache.v), strict=True):
        for index in range(24):
            assert torch.equal(slot(new, index), slot(old, moved.get(index, index)))
