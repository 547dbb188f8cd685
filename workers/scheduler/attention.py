# Attention over the paged KV cache. The torch backend (CPU, or CUDA without
# flashinfer) attends on the CPU with our kernel (paged.py), which reads keys in
# place through the block tables; elsewhere it gathers each
# sequence's KV slots once per step and reuses the gather indices in every
# layer. `make_backend` picks flashinfer on CUDA.

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pipeline.errors import ConfigError
from workers.scheduler import paged
from workers.scheduler.batcher import StepPlan
from workers.scheduler.blocks import Copy


class KVCache:
    """Per layer, k and v. Layout "NHD": [num_blocks, block_size, kv_heads, dim]
    (flashinfer's paged layout). Layout "HND": [kv_heads, num_blocks * block_size,
    dim], flat by slot, so the torch backend gathers every head's keys in one
    index_select and hands them to bmm without another copy."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device, layout: str = "NHD"):
        shape = ((num_blocks, block_size, num_kv_heads, head_dim) if layout == "NHD"
                 else (num_kv_heads, num_blocks * block_size, head_dim))
        self.dtype = dtype
        # int8 (HND only): keys' levels + 128 as uint8, values' levels as int8, and an
        # fp32 scale per slot and head beside each (paged_int8.c)
        k_dtype = torch.uint8 if dtype == torch.int8 else dtype
        self.k = [torch.zeros(shape, dtype=k_dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.k_scale: list[torch.Tensor] = []
        self.v_scale: list[torch.Tensor] = []
        if dtype == torch.int8:
            self.k_scale, self.v_scale = ([torch.zeros(shape[:2], device=device)
                                           for _ in range(num_layers)] for _ in range(2))
        self.block_size, self.layout = block_size, layout

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (*self.k, *self.v, *self.k_scale, *self.v_scale))

    def copy(self, copies: list[Copy]) -> None:
        """Each copy's slots, every layer's keys and values (BlockAllocator's
        partial prefix reuse); all sources are read before any target is written."""
        size = self.block_size
        source = [c.source * size + i for c in copies for i in range(c.count)]
        target = [c.target * size + i for c in copies for i in range(c.count)]
        device = self.k[0].device
        source_t = torch.tensor(source, dtype=torch.long, device=device)
        target_t = torch.tensor(target, dtype=torch.long, device=device)
        for cache in (*self.k, *self.v, *self.k_scale, *self.v_scale):
            # by slot: NHD's [blocks, block_size, ...] is [slots, ...]; HND's slots are dim 1
            flat, dim = (cache.flatten(0, 1), 0) if self.layout == "NHD" else (cache, 1)
            flat.index_copy_(dim, target_t, flat.index_select(dim, source_t))


def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                    dtype: torch.dtype) -> int:
    per_slot = head_dim * dtype.itemsize + (4 if dtype == torch.int8 else 0)  # int8: a scale
    return 2 * num_layers * block_size * num_kv_heads * per_slot


def slot_mapping(plan: StepPlan, tables: list[list[int]]) -> list[int]:
    size = plan.block_size
    return [table[p // size] * size + p % size
            for chunk, table in zip(plan.chunks, tables, strict=True)
            for p in range(chunk.start, chunk.start + chunk.num_tokens)]


@dataclass
class PrefillPart:
    first: int  # its first row in the flat batch
    num_tokens: int
    context: torch.Tensor | None  # slots of all its keys; None: no cached prefix, attend fresh k, v
    mask: torch.Tensor | None  # [num_tokens, context_len] bool, True = may attend


@dataclass
class TorchMeta:
    slots: torch.Tensor
    num_decode: int
    decode_slots: torch.Tensor | None  # [num_decode, max_len]
    decode_bias: torch.Tensor | None  # [num_decode * kv_heads, group, max_len]: 0 or -inf
    prefills: list[PrefillPart]
    sequence_rows: list[int]  # rows of each chunk in order: a sequence's rows attend together


class TorchAttention:
    """Over an "HND" cache (kv_dtype says which dtype: torch's bf16 bmm of these
    small shapes was 2-6x slower than fp32 on one host, 3x3x64 by 64x64: 51 vs
    8 us, so only our kernel reads a bf16 cache)."""

    def __init__(self, cache: KVCache, num_heads: int, num_kv_heads: int, head_dim: int,
                 in_place: bool | None = None):
        """`in_place`: decode with our kernel; None: wherever it can run."""
        self.cache = cache
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim ** -0.5
        self.meta: TorchMeta | None = None
        if cache.dtype == torch.int8:  # only our kernel reads it (kv_dtype checked it runs)
            self.in_place = True
            self.kernel = paged.InPlace(cache.k, cache.v, scales=(cache.k_scale, cache.v_scale))
            return
        can = (cache.dtype in (torch.float32, torch.bfloat16) and cache.k[0].device.type == "cpu"
               and paged.load() is not None)
        self.in_place = can if in_place is None else in_place and can
        self.kernel = paged.InPlace(cache.k, cache.v) if self.in_place else None

    def prepare(self, plan: StepPlan, tables: list[list[int]], device: torch.device) -> None:
        """Per-step metadata, computed once and shared by every layer."""
        slots = torch.tensor(slot_mapping(plan, tables), dtype=torch.long, device=device)
        # the leading one-token chunks (decodes) attend as one batch. The kernel
        # takes prefills too, each token a query row of its own: faster than
        # SDPA's flash kernel per chunk (0.64x its time for 64 prompts of 35
        # tokens, 0.67x for one of 2048)
        num_decode = len(plan.chunks) if self.in_place else next(
            (i for i, c in enumerate(plan.chunks) if c.num_tokens != 1), len(plan.chunks))
        decode_slots = decode_bias = None
        if self.in_place:  # the kernel's own per-step arguments
            self.kernel.prepare(slots, *self._query_tables(plan, tables, num_decode),
                                plan.block_size)
        elif num_decode:
            decode_slots, decode_bias = self._decode_gather(plan, tables, num_decode, device)
        prefills, first = [], sum(c.num_tokens for c in plan.chunks[:num_decode])
        for chunk, table in zip(plan.chunks[num_decode:], tables[num_decode:], strict=True):
            prefills.append(self._prefill_part(plan.block_size, chunk.start, chunk.num_tokens,
                                               table, first, device))
            first += chunk.num_tokens
        self.meta = TorchMeta(slots, num_decode, decode_slots, decode_bias, prefills,
                              [c.num_tokens for c in plan.chunks])

    @staticmethod
    def _query_tables(plan: StepPlan, tables: list[list[int]],
                      num_chunks: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The kernel's block table and length for each token of the first
        `num_chunks` chunks: a token sees its sequence up to itself."""
        chunks = plan.chunks[:num_chunks]
        lengths = [c.start + i + 1 for c in chunks for i in range(c.num_tokens)]
        width = -(-max(lengths, default=1) // plan.block_size)
        padded = torch.tensor([t[:width] + [0] * (width - len(t[:width]))
                               for t in tables[:num_chunks]], dtype=torch.int32)
        if len(lengths) > num_chunks:  # some prefill: its table once per token
            padded = padded.reshape(num_chunks, width).repeat_interleave(
                torch.tensor([c.num_tokens for c in chunks]), dim=0)
        return padded.reshape(len(lengths), width), torch.tensor(lengths, dtype=torch.int32)

    def _decode_gather(self, plan: StepPlan, tables: list[list[int]], num_decode: int,
                       device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        size = plan.block_size
        lengths = [c.start + 1 for c in plan.chunks[:num_decode]]
        max_len = max(lengths)
        num_table = -(-max_len // size)
        padded = [t[:num_table] + [0] * (num_table - len(t[:num_table]))
                  for t in tables[:num_decode]]
        table = torch.tensor(padded, dtype=torch.long, device=device)
        offsets = torch.arange(max_len, device=device)
        slots = table[:, offsets // size] * size + offsets % size
        length = torch.tensor(lengths, device=device)
        bias = torch.zeros(slots.shape, dtype=self.cache.dtype, device=device)
        bias.masked_fill_(offsets[None, :] >= length[:, None], float("-inf"))
        group = self.num_heads // self.num_kv_heads
        # one row per (kv head, sequence), broadcast over the heads of its group
        bias = bias.repeat(self.num_kv_heads, 1)[:, None, :]
        return slots.reshape(-1), bias.expand(-1, group, -1)

    def _prefill_part(self, size: int, start: int, num_tokens: int, table: list[int], first: int,
                      device: torch.device) -> PrefillPart:
        if start == 0:
            return PrefillPart(first, num_tokens, None, None)
        end = start + num_tokens
        context = torch.tensor([table[p // size] * size + p % size for p in range(end)],
                               dtype=torch.long, device=device)
        rows = torch.arange(start, end, device=device)[:, None]
        mask = torch.arange(end, device=device)[None, :] <= rows
        return PrefillPart(first, num_tokens, context, mask)

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor) -> torch.Tensor:
        """q [T, heads, dim], k and v [T, kv_heads, dim] -> [T, heads * dim]."""
        meta = self.meta
        k_cache, v_cache = self.cache.k[layer], self.cache.v[layer]
        out = torch.empty(q.shape[0], self.num_heads * self.head_dim, dtype=q.dtype,
                          device=q.device)
        if self.in_place:  # writes k, v and decodes in one call
            self.kernel(layer, q, k, v, self.scale, out)
        else:
            k_cache.index_copy_(1, meta.slots, k.transpose(0, 1).to(self.cache.dtype))
            v_cache.index_copy_(1, meta.slots, v.transpose(0, 1).to(self.cache.dtype))
            if meta.num_decode:
                out[:meta.num_decode] = self._decode(q[:meta.num_decode], k_cache, v_cache)
        for part in meta.prefills:
            rows = slice(part.first, part.first + part.num_tokens)
            out[rows] = self._prefill(part, q[rows], k[rows], v[rows], k_cache, v_cache)
        return out

    def _decode(self, q: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor) -> torch.Tensor:
        # batched matmuls over (kv head, sequence): several times faster on CPU
        # than SDPA's flash kernel for one query row
        meta = self.meta
        batch, length = q.shape[0], meta.decode_bias.shape[-1]
        kv_heads, group, dim = self.num_kv_heads, self.num_heads // self.num_kv_heads, self.head_dim
        keys = k_cache.index_select(1, meta.decode_slots).view(kv_heads * batch, length, dim)
        values = v_cache.index_select(1, meta.decode_slots).view(kv_heads * batch, length, dim)
        queries = q.to(keys.dtype).view(batch, kv_heads, group, dim).transpose(0, 1)
        scores = torch.baddbmm(meta.decode_bias, queries.reshape(kv_heads * batch, group, dim),
                               keys.transpose(1, 2), alpha=self.scale)
        out = torch.bmm(torch.softmax(scores, dim=-1), values)
        return out.view(kv_heads, batch, group * dim).transpose(0, 1).reshape(batch, -1)

    def _prefill(self, part: PrefillPart, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        q = q.transpose(0, 1)
        if part.context is None:
            k, v = k.transpose(0, 1), v.transpose(0, 1)
        else:
            k, v = k_cache.index_select(1, part.context), v_cache.index_select(1, part.context)
            q = q.to(k.dtype)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=part.mask,
                                             is_causal=part.mask is None, scale=self.scale,
                                             enable_gqa=True)
        return out.transpose(0, 1).reshape(part.num_tokens, -1)


def choose_backend(name: str, device: torch.device) -> str:
    """"auto": flashinfer on CUDA when it is installed, else torch."""
    if name not in ("auto", "torch", "flashinfer"):
        raise ValueError(f"unknown attention backend {name!r}")
    if name == "auto":
        return "flashinfer" if device.type == "cuda" and _has_flashinfer() else "torch"
    return name


def make_cache(backend: str, num_layers: int, num_blocks: int, block_size: int,
               num_kv_heads: int, head_dim: int, dtype: torch.dtype,
               device: torch.device, kv_cache_dtype: str = "auto",
               int8_activations: bool = False) -> KVCache:
    return KVCache(num_layers, num_blocks, block_size, num_kv_heads, head_dim,
                   kv_dtype(backend, dtype, device, kv_cache_dtype, head_dim, int8_activations),
                   device,
                   "NHD" if backend == "flashinfer" else "HND")


KV_CACHE_DTYPES = ("auto", "model", "int8")
INT8_HEAD_DIMS = (64, 128, 256)


def kv_dtype(backend: str, dtype: torch.dtype, device: torch.device,
             kv_cache_dtype: str = "auto", head_dim: int = 64,
             int8_activations: bool = False) -> torch.dtype:
    """int8: 8-bit levels (half of bf16's bytes), read by paged_int8.c on a CPU
    with AVX-512 VNNI, else by paged_attention.c's AVX2 loop, for heads of 64,
    128 or 256 dims. model: the torch backend on the CPU keeps fp32, where
    torch's bf16 bmm is slow, except for a bf16 model on our kernel, which reads
    bf16; elsewhere the model's dtype.
    auto: int8 for a bf16 model where paged_int8.c runs (the same logits' KL to
    transformers, 1.88x the tokens a MiB, and faster steps: see the README's
    Models); bf16 for an fp32 model whose matmuls round activations to int8
    (`int8_activations`: qgemm_avx2.c, a CPU without VNNI) where our kernel
    reads it (half the bytes of fp32 to read; int8 there moved the logits
    further, and gained only at long contexts: README's Models); else model's
    choice."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ConfigError(f"unknown kv cache dtype {kv_cache_dtype!r}: "
                          f"{', '.join(KV_CACHE_DTYPES)}")
    int8_runs = (backend == "torch" and device.type == "cpu"
                 and paged.load_int8() is not None)
    if kv_cache_dtype == "int8":
        if not int8_runs:
            raise ConfigError("an int8 KV cache runs on the CPU only, with AVX2 and a C "
                              "compiler")
        if head_dim not in INT8_HEAD_DIMS:
            raise ConfigError(f"an int8 KV cache takes heads of 64, 128 or 256 dims, not "
                              f"{head_dim}")
        return torch.int8
    if (kv_cache_dtype == "auto" and int8_runs and dtype == torch.bfloat16
            and head_dim in INT8_HEAD_DIMS):
        return torch.int8
    if backend != "torch" or device.type != "cpu":
        return dtype
    ours = paged.load() is not None
    if kv_cache_dtype == "auto" and dtype == torch.float32 and int8_activations and ours:
        return torch.bfloat16
    return torch.bfloat16 if dtype == torch.bfloat16 and ours else torch.float32


def make_backend(backend: str, cache: KVCache, spec, device: torch.device):
    if backend == "flashinfer":
        from workers.scheduler.attention_flashinfer import FlashInferAttention

        return FlashInferAttention(cache, spec.num_heads, spec.num_kv_heads, spec.head_dim,
                                   device)
    return TorchAttention(cache, spec.num_heads, spec.num_kv_heads, spec.head_dim)


def _has_flashinfer() -> bool:
    import importlib.util

    return importlib.util.find_spec("flashinfer") is not None
