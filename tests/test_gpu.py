"""The CUDA path (flashinfer attention, CUDA-graph decode); skipped without
CUDA and flashinfer. fp16 greedy tokens from flashinfer agree with the torch
backend on the same GPU at >= 90% of positions, and graphed decode with eager
decode likewise (kernels, and cuBLAS's choice of them per batch size, differ
in rounding, so not exactly)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import openai
import pytest
import torch

from pipeline.config import SchedulerConfig
from pipeline.messages import Sampling
from pipeline.status import live_workers
from tests.harness import free_port, worker_env
from workers.scheduler.engine import Engine, EngineRequest

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(importlib.util.find_spec("flashinfer") is None,
                       reason="needs flashinfer (pip install .[gpu])"),
]

PROMPTS = [[1, 504, 3575, 282, 4649, 314, 7042, 30] * n for n in (1, 3, 5, 8)]


def generate(engine: Engine, num_new: int = 16, prompts=PROMPTS,
             lengths: list[int] | None = None) -> dict[str, list[int]]:
    for i, ids in enumerate(prompts):
        max_tokens = num_new if lengths is None else lengths[i]
        sampling = Sampling(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        engine.add(EngineRequest(str(i), ids, [], sampling))
    outputs: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    while engine.has_work():
        for result in engine.step():
            outputs[result.request_id] += result.new_ids
    return outputs


def agreement(a: dict[str, list[int]], b: dict[str, list[int]]) -> float:
    same = sum(x == y for key in a for x, y in zip(a[key], b[key], strict=True))
    return same / sum(len(v) for v in a.values())


def test_auto_picks_flashinfer_and_captures_decode_graphs_on_cuda(model_files):
    engine = Engine(model_files.path, SchedulerConfig(device="cuda", dtype="float16"))
    assert type(engine.attention).__name__ == "FlashInferAttention"
    assert engine.backend == "flashinfer"
    assert engine.graphs.sizes[-1] == engine.config.max_running_requests


def test_flashinfer_greedy_output_equals_the_torch_backend(model_files):
    config = dict(device="cuda", dtype="float16", max_batch_tokens=32)  # chunked prefill too
    ours = generate(Engine(model_files.path, SchedulerConfig(attention_backend="flashinfer",
                                                             **config)))
    torch_backend = generate(Engine(model_files.path, SchedulerConfig(attention_backend="torch",
                                                                      **config)))
    assert agreement(ours, torch_backend) >= 0.9


def test_graphed_decode_gives_the_eager_steps_tokens(model_files):
    # requests that end at different steps: the batch shrinks through padded buckets
    prompts = [[1, 504, 3575, 282, 4649, 314, 7042, 30] * (1 + i % 4) for i in range(11)]
    lengths = [4 + 3 * i for i in range(11)]
    config = dict(device="cuda", dtype="float16", max_running_requests=16)
    graphed = Engine(model_files.path, SchedulerConfig(**config))
    eager = Engine(model_files.path, SchedulerConfig(cuda_graph_max_batch=0, **config))
    assert eager.graphs is None
    ours = generate(graphed, prompts=prompts, lengths=lengths)
    assert graphed.graphs.replays >= max(lengths) - 2  # every decode step after the prefill
    assert [len(v) for v in ours.values()] == lengths
    assert agreement(ours, generate(eager, prompts=prompts, lengths=lengths)) >= 0.9


def test_a_replayed_step_gives_the_eager_forwards_logits(model_files):
    """Padding rows write only to the scratch block, and the graph reads this
    step's inputs: its logits are the eager pass's, up to fp16 rounding."""
    engine = Engine(model_files.path, SchedulerConfig(device="cuda", dtype="float16"))
    sampling = Sampling(max_tokens=8, temperature=0.0, ignore_eos=True)
    for i, ids in enumerate(PROMPTS * 2):  # 8 sequences, replayed in the graph of 8
        engine.add(EngineRequest(str(i), ids[: 5 + 3 * i], [], sampling))
    engine.step()  # the prefill
    engine.step()  # a first decode step, replayed
    plan = engine.batcher.schedule()
    tables = [engine.allocator.block_table(c.seq.request_id) for c in plan.chunks]
    assert engine.graphs.takes(plan) and len(plan.chunks) == 8
    replayed = engine.graphs.run(plan, tables).clone()
    eager = engine.forward(plan, tables)
    assert replayed.shape == eager.shape == (8, engine.model.spec.vocab_size)
    assert (replayed - eager).abs().max() <= 0.02 * eager.abs().max()


@pytest.mark.timeout(600)  # the first run compiles flashinfer's kernels
def test_pipeline_serve_on_cuda_answers_the_openai_client(model_files, tmp_path):
    """The whole tier as a user starts it on a GPU host: embedded Redis, every role, the
    scheduler on CUDA in its default dtype with graphs; the real model answers."""
    port = free_port()
    env = worker_env()
    with (tmp_path / "serve.log").open("w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "pipeline.cli", "serve", "--port",
                                 str(port), "--device", "cuda"], stdout=subprocess.PIPE,
                                stderr=log, env=env, text=True)
    try:
        # serve prints its serving line once every role is up (children share its stdout)
        line = next((line for line in proc.stdout if "serving" in line), "")
        assert f"127.0.0.1:{port}" in line, (tmp_path / "serve.log").read_text()
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused",
                               timeout=120)
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        whole = client.chat.completions.create(model=model_files.name, messages=messages,
                                               temperature=0, max_tokens=20)
        assert "Paris" in whole.choices[0].message.content
        stream = client.chat.completions.create(model=model_files.name, messages=messages,
                                                temperature=0, max_tokens=20, stream=True)
        streamed = "".join(chunk.choices[0].delta.content or "" for chunk in stream
                           if chunk.choices)
        assert "Paris" in streamed
        redis_url = line.split("(Redis: ")[1].split(")")[0]
        [scheduler] = [w for w in live_workers(redis_url, "pipeline")
                       if w["role"] == "scheduler"]
        assert (scheduler["device"], scheduler["dtype"], scheduler["attention"]) == (
            "cuda", "bfloat16", "flashinfer")
        assert scheduler["cuda_graphs"] == 256  # a GPU's default --max-running-requests
    finally:
        proc.terminate()
        proc.wait(timeout=60)
