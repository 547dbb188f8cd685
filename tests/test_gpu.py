"""The CUDA path (flashinfer attention); skipped without CUDA and flashinfer.
fp16 greedy tokens from flashinfer agree with the torch backend on the same
GPU at >= 90% of positions (kernels differ in rounding, so not exactly)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from pipeline.config import SchedulerConfig
from pipeline.messages import Sampling
from workers.scheduler.engine import Engine, EngineRequest

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(importlib.util.find_spec("flashinfer") is None,
                       reason="needs flashinfer (pip install .[gpu])"),
]

PROMPTS = [[1, 504, 3575, 282, 4649, 314, 7042, 30] * n for n in (1, 3, 5, 8)]


def generate(engine: Engine, num_new: int = 16) -> dict[str, list[int]]:
    sampling = Sampling(max_tokens=num_new, temperature=0.0, ignore_eos=True)
    for i, ids in enumerate(PROMPTS):
        engine.add(EngineRequest(str(i), ids, [], sampling))
    outputs: dict[str, list[int]] = {str(i): [] for i in range(len(PROMPTS))}
    while engine.has_work():
        for result in engine.step():
            outputs[result.request_id] += result.new_ids
    return outputs


def test_auto_picks_flashinfer_on_cuda(model_files):
    engine = Engine(model_files.path, SchedulerConfig(device="cuda"))
    assert type(engine.attention).__name__ == "FlashInferAttention"


def test_flashinfer_greedy_output_equals_the_torch_backend(model_files):
    config = dict(device="cuda", dtype="float16", max_batch_tokens=32)  # chunked prefill too
    ours = generate(Engine(model_files.path, SchedulerConfig(attention_backend="flashinfer",
                                                             **config)))
    torch_backend = generate(Engine(model_files.path, SchedulerConfig(attention_backend="torch",
                                                                      **config)))
    same = sum(a == b for key in ours for a, b in zip(ours[key], torch_backend[key], strict=True))
    assert same >= 0.9 * sum(len(v) for v in ours.values())
