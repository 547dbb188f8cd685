"""Which decode batches replay a CUDA graph: the policy, which runs anywhere.
The graphs themselves are tested on a GPU (test_gpu.py)."""

from __future__ import annotations

import torch

from pipeline.config import SchedulerConfig
from workers.scheduler.cuda_graphs import bucket_sizes
from workers.scheduler.engine import graph_batch_size

CUDA = torch.device("cuda")


def test_buckets_rise_to_the_largest_batch_and_no_further():
    assert bucket_sizes(1) == [1]
    assert bucket_sizes(16) == [1, 2, 4, 8, 12, 16]
    assert bucket_sizes(50) == [1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 50]
    sizes = bucket_sizes(256)
    assert sizes == sorted(set(sizes)) and sizes[-1] == 256
    # a batch past 8 pads to its bucket with at most half as many rows again
    assert all(b - a <= max(4, a // 2) for a, b in zip(sizes, sizes[1:], strict=False))


def test_graphs_only_for_flashinfer_on_cuda_and_never_past_the_running_limit():
    config = SchedulerConfig(max_running_requests=64)
    assert graph_batch_size(config, CUDA, "flashinfer") == 64
    assert graph_batch_size(SchedulerConfig(cuda_graph_max_batch=24), CUDA, "flashinfer") == 24
    assert graph_batch_size(SchedulerConfig(cuda_graph_max_batch=0), CUDA, "flashinfer") == 0
    assert graph_batch_size(config, CUDA, "torch") == 0
    assert graph_batch_size(config, torch.device("cpu"), "torch") == 0
