"""The 8-bit KV cache (--kv-cache-dtype int8: paged_int8.c on AVX-512 VNNI,
paged_attention.c's paged_decode_int8 on AVX2, each tested where it runs): a
step's new keys and values rounded to 127 levels per token and head, attention
over them against the same attention computed from the levels in fp32, and
against an exact cache; its copies and its configuration."""

import random

import pytest
import torch

from pipeline.errors import ConfigError
from pipeline.messages import Sampling
from workers.scheduler import paged
from workers.scheduler.attention import KVCache, TorchAttention, kv_dtype, make_cache
from workers.scheduler.batcher import Chunk, StepPlan
from workers.scheduler.blocks import Copy
from workers.scheduler.sequence import Sequence

pytestmark = pytest.mark.skipif(paged.load_int8() is None,
                                reason="no AVX2 CPU or no C compiler")
# the engine's choice, and the AVX2 one where that is another (a VNNI CPU)
KERNELS = [pytest.param(lib, id=name) for name, lib in (
    ("chosen", paged.load_int8()), ("avx2", paged.load_int8_avx2()))
    if lib is not None and (name == "chosen" or lib is not paged.load_int8())]
BLOCKS, BLOCK = 40, 16
CPU = torch.device("cpu")


def step(kv: str, lengths: list[int], prefill: int, prefill_from: int = 0, heads: int = 9,
         kv_heads: int = 3, dim: int = 64, sharpness: float = 1.0, lib=None,
         dtype: torch.dtype = torch.bfloat16):
    """One layer's step over a cache filled by earlier steps of the same
    kernel (`lib`: another build than the engine's): decodes at `lengths`, then
    a prefill chunk (positions prefill_from..prefill), q, k and v in `dtype`.
    Returns the output, the cache, the plan and tables."""
    generator = torch.Generator().manual_seed(0)
    cache = make_cache("torch", 1, BLOCKS, BLOCK, kv_heads, dim, torch.bfloat16, CPU, kv)
    blocks = list(range(BLOCKS))
    random.Random(0).shuffle(blocks)
    chunks, history, tables = [], [], []
    for i, length in enumerate([*lengths, prefill]):
        seq = Sequence(str(i), [1] * length, length, Sampling(), 0, i)
        start = length - 1 if i < len(lengths) else prefill_from
        chunks.append(Chunk(seq, start, length - start))
        history.append(Chunk(seq, 0, start))
        tables.append([blocks.pop() for _ in range(-(-length // BLOCK))])
    attention = TorchAttention(cache, heads, kv_heads, dim)
    assert attention.in_place
    if lib is not None and cache.dtype == torch.int8:
        attention.kernel = paged.InPlace(cache.k, cache.v, lib, (cache.k_scale, cache.v_scale))
    out = None
    for plan_chunks in ([c for c in history if c.num_tokens], chunks):  # the past, then the step
        plan = StepPlan(plan_chunks, block_size=BLOCK)
        used = [tables[int(c.seq.request_id)] for c in plan_chunks]
        attention.prepare(plan, used, CPU)
        rows = plan.num_tokens
        q = sharpness * torch.randn(rows, heads, dim, generator=generator)
        k, v = (torch.randn(rows, kv_heads, dim, generator=generator) for _ in range(2))
        qkv = torch.cat([q, k, v], dim=1).to(dtype)
        q, k, v = qkv.split([heads, kv_heads, kv_heads], dim=1)
        with torch.inference_mode():
            out = attention(0, q, k, v).float()
    return out, cache, q.float(), chunks, tables


def attend_levels(cache: KVCache, q: torch.Tensor, chunks: list[Chunk],
                  tables: list[list[int]]) -> torch.Tensor:
    """The step's attention in fp32 from the cache's levels and scales."""
    keys = (cache.k[0].float() - 128) * cache.k_scale[0][..., None]  # [kv_heads, slots, dim]
    values = cache.v[0].float() * cache.v_scale[0][..., None]
    kv_heads, _, dim = keys.shape
    rows = []
    for chunk, table in zip(chunks, tables, strict=True):
        for position in range(chunk.start, chunk.start + chunk.num_tokens):
            slots = torch.tensor([table[p // BLOCK] * BLOCK + p % BLOCK
                                  for p in range(position + 1)])
            query = q[len(rows)].view(kv_heads, -1, dim)
            scores = query @ keys[:, slots].transpose(1, 2) * dim ** -0.5
            rows.append((scores.softmax(-1) @ values[:, slots]).reshape(-1))
    return torch.stack(rows)


@pytest.mark.parametrize("lib", KERNELS)
@pytest.mark.parametrize("sharpness", [0.01, 1.0, 30.0])
@pytest.mark.parametrize("heads, kv_heads, dim", [(9, 3, 64), (8, 8, 64), (10, 2, 64),
                                                  (8, 2, 128), (4, 2, 256)])
def test_attention_reads_its_levels_as_fp32_would(heads, kv_heads, dim, sharpness, lib):
    """Decodes at uneven lengths and a prefill continuing a cached prefix, every
    group size's remainder (3 query heads a pass) and dims 64, 128 and 256: within
    bf16's rounding of the output (VNNI's queries' 14 bits and weights' 16 are
    finer; AVX2's are fp32)."""
    out, cache, q, chunks, tables = step("int8", [1, 5, 16, 33, 100, 2], 40, 17, heads,
                                         kv_heads, dim, sharpness, lib)
    expected = attend_levels(cache, q, chunks, tables)
    assert out.shape == expected.shape
    assert (out - expected).abs().max().item() <= 2 ** -8 * expected.abs().max().item()
    assert expected.abs().max().item() > 0.1


@pytest.mark.parametrize("lib", KERNELS)
def test_fp32_queries_and_outputs_read_the_levels_in_fp32(lib):
    """An fp32 model's step (the AVX2 hosts' int8-activation kernels run one)
    goes to the kernel as it is: within fp32's rounding on the AVX2 kernel."""
    out, cache, q, chunks, tables = step("int8", [1, 5, 33, 100], 40, 17, lib=lib,
                                         dtype=torch.float32)
    assert out.dtype == torch.float32
    expected = attend_levels(cache, q, chunks, tables)
    exact = lib is paged.load_int8_avx2()
    tolerance = 2 ** -16 if exact else 2 ** -10  # VNNI's queries: 14 bits
    assert (out - expected).abs().max().item() <= tolerance * expected.abs().max().item()


@pytest.mark.parametrize("lib", KERNELS)
def test_attention_stays_near_an_exact_cache(lib):
    (ours, *_), (exact, *_) = (step(kv, [5, 16, 33, 100], 40, 17, lib=lib)
                               for kv in ("int8", "model"))
    assert ((ours - exact).norm() / exact.norm()).item() < 0.03  # measured ~0.01


@pytest.mark.parametrize("lib", KERNELS)
def test_new_keys_and_values_are_127_levels_of_their_own_max(lib):
    _, cache, *_ = step("int8", [5, 33], 20, lib=lib)
    written = cache.k_scale[0] > 0  # [kv_heads, slots]
    assert written.sum().item() == 3 * (5 + 33 + 20)
    keys, values = cache.k[0][written].int() - 128, cache.v[0][written].int()
    for levels in (keys, values):
        assert levels.abs().max(-1).values.eq(127).all()  # each row's largest is its max


def test_a_copy_moves_the_scales_too():
    cache = KVCache(2, 6, 4, 3, 64, torch.int8, CPU, "HND")
    for tensor in (*cache.k, *cache.v):
        tensor.copy_(torch.randint(-127, 128, tensor.shape).to(tensor.dtype))
    for tensor in (*cache.k_scale, *cache.v_scale):
        tensor.copy_(torch.rand(tensor.shape))
    before = [t.clone() for t in (*cache.k, *cache.v, *cache.k_scale, *cache.v_scale)]
    cache.copy([Copy(1, 4, 3)])
    for old, new in zip(before, (*cache.k, *cache.v, *cache.k_scale, *cache.v_scale),
                        strict=True):
        assert torch.equal(new[:, 16:19], old[:, 4:7])
        assert torch.equal(new[:, :16], old[:, :16]) and torch.equal(new[:, 19:], old[:, 19:])


def test_int8_takes_half_the_bytes_of_bf16_and_its_scales():
    from workers.scheduler.attention import bytes_per_block

    bf16, int8 = (bytes_per_block(30, 16, 3, 64, dtype) for dtype in (torch.bfloat16, torch.int8))
    assert int8 == 2 * 30 * 16 * 3 * (64 + 4) and bf16 == 2 * int8 - 2 * 2 * 30 * 16 * 3 * 4


def test_int8_is_refused_where_our_kernel_does_not_read_it():
    with pytest.raises(ConfigError, match="CPU only"):
        kv_dtype("flashinfer", torch.bfloat16, torch.device("cuda"), "int8")
    with pytest.raises(ConfigError, match="auto, model, int8"):
        kv_dtype("torch", torch.bfloat16, CPU, "fp8")
    with pytest.raises(ConfigError, match="64, 128 or 256"):
        kv_dtype("torch", torch.bfloat16, CPU, "int8", 96)
    assert kv_dtype("torch", torch.bfloat16, CPU, "int8", 128) == torch.int8


def test_auto_is_int8_for_a_bf16_model_where_our_kernel_reads_it():
    """(This module runs where paged_int8.c does.) Other head sizes, fp32
    models, `model` and the GPU keep the model's dtype."""
    assert kv_dtype("torch", torch.bfloat16, CPU, "auto") == torch.int8
    assert kv_dtype("torch", torch.bfloat16, CPU, "auto", head_dim=96) == torch.bfloat16
    assert kv_dtype("torch", torch.float32, CPU, "auto") == torch.float32
    assert kv_dtype("torch", torch.bfloat16, CPU, "model") == torch.bfloat16
    assert kv_dtype("flashinfer", torch.float16, torch.device("cuda"), "auto") == torch.float16


def test_an_engine_reusing_int8_blocks_answers_as_a_cold_one(model_files):
    """Chats one by one, each reusing the cached blocks of the ones before (the
    template's system prompt: whole blocks shared, the part of the next one
    copied with its scales), give the greedy tokens of an engine that computes
    each chat cold: a reused slot holds the levels and scales it was written
    with. fp32 weights, whose kernels are exact."""
    from transformers import AutoTokenizer

    from pipeline.config import SchedulerConfig
    from workers.scheduler.engine import Engine, EngineRequest

    tokenizer = AutoTokenizer.from_pretrained(model_files.path)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                             add_generation_prompt=True,
                                             tokenize=True)["input_ids"]
               for text in ("What is the capital of France?", "List three colors.",
                            "Write a haiku about the sea.")]
    greedy = Sampling(max_tokens=10, temperature=0.0)

    def run(engine: Engine, prompt: list[int]) -> list[int]:
        engine.add(EngineRequest("0", prompt, [], greedy))
        out = []
        while engine.has_work():
            out += [token for result in engine.step() for token in result.new_ids]
        return out

    config = SchedulerConfig(dtype="float32", kv_cache_dtype="int8")
    warm = Engine(model_files.path, config)
    reused = [run(warm, prompt) for prompt in prompts]
    assert warm.stats().num_prefix_hit_tokens >= 2 * 24  # the system prompt, twice
    assert reused == [run(Engine(model_files.path, config), prompt) for prompt in prompts]
    assert len({tuple(ids) for ids in reused}) == len(prompts)
