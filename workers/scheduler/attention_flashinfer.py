# Attention on CUDA with flashinfer's paged kernels (the `gpu` extra): the
# decode wrapper when a step only decodes, the prefill wrapper (causal,
# aligned to each sequence's end) for steps with prompt chunks.

from __future__ import annotations

import torch

from workers.scheduler.attention import KVCache, slot_mapping
from workers.scheduler.batcher import StepPlan

WORKSPACE_BYTES = 128 * 2**20


class FlashInferAttention:
    def __init__(self, cache: KVCache, num_heads: int, num_kv_heads: int, head_dim: int,
                 device: torch.device):
        import flashinfer  # lazily: only the gpu extra installs it

        self.cache = cache
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
        self.prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
        self.slots: torch.Tensor | None = None
        self.wrapper = self.decode

    def prepare(self, plan: StepPlan, tables: list[list[int]], device: torch.device) -> None:
        """Plan the kernels once per step; every layer reuses the plan."""
        size = plan.block_size
        kv_lengths = [c.start + c.num_tokens for c in plan.chunks]
        pages = [table[:-(-n // size)] for table, n in zip(tables, kv_lengths, strict=True)]
        page_indptr, query_indptr = [0], [0]
        for chunk, used in zip(plan.chunks, pages, strict=True):
            page_indptr.append(page_indptr[-1] + len(used))
            query_indptr.append(query_indptr[-1] + chunk.num_tokens)

        def tensor(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int32, device=device)

        indices = tensor([p for used in pages for p in used])
        last_page_len = tensor([(n - 1) % size + 1 for n in kv_lengths])
        dims = (self.num_heads, self.num_kv_heads, self.head_dim, size)
        dtype = self.cache.k[0].dtype
        if all(c.num_tokens == 1 for c in plan.chunks):
            self.wrapper = self.decode
            self.decode.plan(tensor(page_indptr), indices, last_page_len, *dims,
                             q_data_type=dtype, kv_data_type=dtype)
        else:
            self.wrapper = self.prefill
            self.prefill.plan(tensor(query_indptr), tensor(page_indptr), indices, last_page_len,
                              *dims, causal=True, q_data_type=dtype, kv_data_type=dtype)
        self.slots = torch.tensor(slot_mapping(plan, tables), dtype=torch.long, device=device)

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor) -> torch.Tensor:
        self.cache.k[layer].view(-1, *k.shape[1:]).index_copy_(0, self.slots, k)
        self.cache.v[layer].view(-1, *v.shape[1:]).index_copy_(0, self.slots, v)
        out = self.wrapper.run(q.contiguous(), (self.cache.k[layer], self.cache.v[layer]))
        return out.reshape(q.shape[0], -1)
