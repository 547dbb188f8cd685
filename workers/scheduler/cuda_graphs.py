# CUDA-graph decode. A decode step of a small model on a GPU is launch-bound:
# about 30 kernels a layer (the torch ops of two norms, the rotary embedding,
# the cache writes, attention and four matmuls), each a few microseconds of
# work behind as many of Python and launch. So decode steps of up to
# `max_batch` sequences replay a forward pass captured once per bucket size,
# padded up to the next bucket (on one H200: 3.8-4.7x eager's tok/s).
# Prefill steps, and decode steps past the largest bucket, run eagerly.

from __future__ import annotations

import torch

from workers.scheduler.attention import slot_mapping
from workers.scheduler.batcher import StepPlan

BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256)


def bucket_sizes(max_batch: int) -> list[int]:
    """The captured batch sizes: BUCKETS up to `max_batch`, which is one too."""
    return [b for b in BUCKETS if b < max_batch] + [max_batch]


class DecodeGraphs:
    """`model` a model.LlamaModel and `attention` an attention_flashinfer
    FlashInferAttention on CUDA, whose `scratch_block` no sequence owns."""

    def __init__(self, model, attention, max_batch: int, scratch_block: int):
        self.model, self.attention = model, attention
        self.sizes = bucket_sizes(max_batch)
        device = attention.device
        self.input_ids = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.rows = torch.arange(max_batch, dtype=torch.long, device=device)
        attention.enable_graphs(self.sizes, scratch_block)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}  # each graph's output, rewritten by replay
        self.replays = 0
        pool = torch.cuda.graph_pool_handle()  # the graphs share one pool: one runs at a time
        for batch in reversed(self.sizes):
            self._capture(batch, pool)

    @torch.inference_mode()
    def _capture(self, batch: int, pool) -> None:
        self.attention.prepare_graph(batch, [], [], [])  # every row padding
        args = (self.input_ids[:batch], self.positions[:batch], self.rows[:batch],
                self.attention)
        self.model.forward(*args)  # once eagerly: lazy setup stays out of the graph
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            self.logits[batch] = self.model.forward(*args)
        self.graphs[batch] = graph

    def takes(self, plan: StepPlan) -> bool:
        return (len(plan.chunks) <= self.sizes[-1]
                and all(c.num_tokens == 1 and c.samples for c in plan.chunks))

    def run(self, plan: StepPlan, tables: list[list[int]]) -> torch.Tensor:
        """Logits [sequences, vocab] of a decode step that `takes` accepts. The
        tensor is the graph's own: read it before the next replay."""
        count = len(plan.chunks)
        batch = next(b for b in self.sizes if b >= count)
        pad = [0] * (batch - count)
        self.input_ids[:batch].copy_(torch.tensor(plan.input_ids() + pad))
        self.positions[:batch].copy_(torch.tensor(plan.positions() + pad))
        self.attention.prepare_graph(batch, [c.start + 1 for c in plan.chunks], tables,
                                     slot_mapping(plan, tables))
        self.graphs[batch].replay()
        self.replays += 1
        return self.logits[batch][:count]
