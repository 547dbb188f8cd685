"""Which decode batches replay a CUDA graph: the policy, which runs anywhere.
The graphs themselves are tested on a GPU (test_gpu.py)."""

from __future__ import annotations

from dataclasses import replace

import torch

from pipeline.config import SchedulerConfig, sized
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
    on_gpu = sized(SchedulerConfig(), "cuda", free_mb=1000)
    assert graph_batch_size(on_gpu, CUDA, "flashinfer") == 256
    for cap in (24, 0):
        config_cap = replace(on_gpu, cuda_graph_max_batch=cap)
        assert graph_batch_size(config_cap, CUDA, "flashinfer") == cap
    assert graph_batch_size(config, CUDA, "torch") == 0
    assert graph_batch_size(config, torch.device("cpu"), "torch") == 0


def test_unset_sizes_follow_the_device_and_set_ones_stay():
    assert sized(SchedulerConfig(), "cpu") == SchedulerConfig(
        max_running_requests=64, max_batch_tokens=512, kv_cache_mb=512)
    on_gpu = sized(SchedulerConfig(), "cuda", free_mb=100_000)
    assert (on_gpu.max_running_requests, on_gpu.max_batch_tokens, on_gpu.kv_cache_mb) == (
        256, 8192, 50_000)  # half the memory left once the weights are in
    mine = SchedulerConfig(max_running_requests=8, max_batch_tokens=64, kv_cache_mb=100)
    assert sized(mine, "cuda", free_mb=100_000) == mine == sized(mine, "cpu")
