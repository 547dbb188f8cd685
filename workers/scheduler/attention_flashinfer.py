# Attention on CUDA with flashinfer's paged kernels (the `gpu` extra): the
# decode wrapper when a step only decodes, the prefill wrapper (causal,
# aligned to each sequence's end) for steps with prompt chunks. Decode steps
# replayed from a CUDA graph (cuda_graphs.py) run on a wrapper of their own,
# one per captured batch size, whose page tables live in fixed buffers.

from __future__ import annotations

import torch

from workers.scheduler.attention import KVCache, slot_mapping
from workers.scheduler.batcher import StepPlan

WORKSPACE_BYTES = 128 * 2**20


def _ints(values: list[int]) -> torch.Tensor:
    # on the host: flashinfer's plan schedules from host copies, and copies to
    # its device buffers itself
    return torch.tensor(values, dtype=torch.int32)


class FlashInferAttention:
    def __init__(self, cache: KVCache, num_heads: int, num_kv_heads: int, head_dim: int,
                 device: torch.device):
        import flashinfer  # lazily: only the gpu extra installs it

        self.flashinfer = flashinfer
        self.cache, self.device = cache, device
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.num_blocks, self.block_size = cache.k[0].shape[0], cache.k[0].shape[1]
        self.workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(self.workspace, "NHD")
        self.prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")
        self.slots: torch.Tensor | None = None
        self.wrapper = self.decode
        # graphed decode steps: a wrapper per batch size, and the slots their
        # captured k/v writes read (padding rows write to `scratch_block`)
        self.graph_decoders: dict[int, object] = {}
        self.graph_slots: torch.Tensor | None = None
        self.scratch_block: int | None = None

    def _plan_args(self, kv_lengths: list[int], tables: list[list[int]]):
        size = self.block_size
        pages = [table[:-(-n // size)] for table, n in zip(tables, kv_lengths, strict=True)]
        page_indptr = [0]
        for used in pages:
            page_indptr.append(page_indptr[-1] + len(used))
        indices = [p for used in pages for p in used]
        last_page_len = [(n - 1) % size + 1 for n in kv_lengths]
        return page_indptr, indices, last_page_len

    def _shape(self) -> tuple[int, int, int, int]:
        return self.num_heads, self.num_kv_heads, self.head_dim, self.block_size

    def _dtypes(self) -> dict[str, torch.dtype]:
        return dict(q_data_type=self.cache.k[0].dtype, kv_data_type=self.cache.k[0].dtype)

    def prepare(self, plan: StepPlan, tables: list[list[int]], device: torch.device) -> None:
        """Plan the kernels once per step; every layer reuses the plan."""
        kv_lengths = [c.start + c.num_tokens for c in plan.chunks]
        page_indptr, indices, last_page_len = self._plan_args(kv_lengths, tables)
        if all(c.num_tokens == 1 for c in plan.chunks):
            self.wrapper = self.decode
            self.decode.plan(_ints(page_indptr), _ints(indices), _ints(last_page_len),
                             *self._shape(), **self._dtypes())
        else:
            query_indptr = [0]
            for chunk in plan.chunks:
                query_indptr.append(query_indptr[-1] + chunk.num_tokens)
            self.wrapper = self.prefill
            self.prefill.plan(_ints(query_indptr), _ints(page_indptr), _ints(indices),
                              _ints(last_page_len), *self._shape(), causal=True,
                              **self._dtypes())
        self.slots = torch.tensor(slot_mapping(plan, tables), dtype=torch.long, device=device)

    def enable_graphs(self, batch_sizes: list[int], scratch_block: int) -> None:
        """Fixed buffers for decode steps of each of `batch_sizes` sequences."""
        self.scratch_block = scratch_block
        self.graph_slots = torch.zeros(max(batch_sizes), dtype=torch.long, device=self.device)
        for batch in batch_sizes:
            self.graph_decoders[batch] = self.flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace, "NHD", use_cuda_graph=True,
                paged_kv_indptr_buffer=torch.zeros(batch + 1, dtype=torch.int32,
                                                   device=self.device),
                paged_kv_indices_buffer=torch.zeros(self.num_blocks + batch, dtype=torch.int32,
                                                    device=self.device),
                paged_kv_last_page_len_buffer=torch.zeros(batch, dtype=torch.int32,
                                                          device=self.device))

    def prepare_graph(self, batch: int, kv_lengths: list[int], tables: list[list[int]],
                      slots: list[int]) -> None:
        """A decode step of len(kv_lengths) sequences padded to `batch`: each
        padding row writes its k, v to the scratch block and attends to that
        one slot. Run outside the graph, before its replay (and its capture)."""
        pad = batch - len(kv_lengths)
        page_indptr, indices, last_page_len = self._plan_args(kv_lengths, tables)
        page_indptr += [page_indptr[-1] + i for i in range(1, pad + 1)]
        indices += [self.scratch_block] * pad
        last_page_len += [1] * pad
        self.wrapper = self.graph_decoders[batch]
        self.wrapper.plan(_ints(page_indptr), _ints(indices), _ints(last_page_len),
                          *self._shape(), **self._dtypes())
        scratch = [self.scratch_block * self.block_size] * pad
        self.graph_slots[:batch].copy_(torch.tensor(slots + scratch))
        self.slots = self.graph_slots[:batch]

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor) -> torch.Tensor:
        self.cache.k[layer].view(-1, *k.shape[1:]).index_copy_(0, self.slots, k)
        self.cache.v[layer].view(-1, *v.shape[1:]).index_copy_(0, self.slots, v)
        out = self.wrapper.run(q.contiguous(), (self.cache.k[layer], self.cache.v[layer]))
        return out.reshape(q.shape[0], -1)
