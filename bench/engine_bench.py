# Offline throughput of the scheduler's engine against transformers `generate`
# (static batch, same prompts, greedy, ignore_eos) at several batch sizes;
# prints tok/s, ratios, and per-token decode latency at batch 1. On CUDA it
# also runs the engine with every step eager (no CUDA graphs), batch by batch
# beside the graphed one.

from __future__ import annotations

import argparse
import random
import time
from dataclasses import replace

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from pipeline.config import SchedulerConfig
from pipeline.messages import Sampling
from pipeline.models import resolve_model
from workers.scheduler.calibrate import cpu_has_bf16
from workers.scheduler.engine import Engine, EngineRequest

WORDS = ("river mountain quiet engine paper window garden silver market winter story "
         "candle forest bridge signal yellow number travel ocean planet music simple "
         "history letter orange kitchen machine morning shadow friend").split()


def make_prompts(tokenizer, num: int, num_words: int = 24) -> list[list[int]]:
    rng = random.Random(0)
    texts = [" ".join(rng.choice(WORDS) for _ in range(num_words)) for _ in range(num)]
    return [tokenizer(text)["input_ids"] for text in texts]


def run_engine(engine: Engine, prompts: list[list[int]], num_new: int) -> tuple[float, float]:
    """Seconds for everything, and seconds to the first token of the last request."""
    sampling = Sampling(max_tokens=num_new, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    for i, ids in enumerate(prompts):
        engine.add(EngineRequest(str(i), ids, [], sampling))
    first = None
    while engine.has_work():
        results = engine.step()
        if first is None and len(results) == len(prompts):
            first = time.perf_counter() - start
    return time.perf_counter() - start, first or 0.0


def run_transformers(model, prompts: list[list[int]], num_new: int,
                     pad_id: int) -> tuple[float, float]:
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=model.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts],
                        device=model.device)
    times = []
    for num in (1, num_new):  # time to first token, then the whole run
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(ids, attention_mask=mask, max_new_tokens=num, min_new_tokens=num,
                           do_sample=False, pad_token_id=pad_id)
        if model.device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return times[1], times[0]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--num-new", type=int, default=64)
    parser.add_argument("--dtype", default="auto", help="the engine's dtype")
    parser.add_argument("--activations", default="auto", help="auto | exact | int8")
    parser.add_argument("--hf-dtype", default="auto",
                        help="auto: the engine's on CUDA; on a CPU bfloat16 where it has "
                        "a bf16 matmul, else float32")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda")
    parser.add_argument("--model", default="SmolLM2-135M-Instruct",
                        help="a local HF directory, or the default model")
    parser.add_argument("--kv-cache-dtype", default="auto", help="auto | model | int8")
    parser.add_argument("--prompt-words", type=int, default=24)
    args = parser.parse_args()
    path = resolve_model(args.model).path
    tokenizer = AutoTokenizer.from_pretrained(path)
    config = SchedulerConfig(dtype=args.dtype, activations=args.activations,
                             max_running_requests=64, device=args.device,
                             kv_cache_dtype=args.kv_cache_dtype)
    engine = Engine(path, config)
    cuda = engine.device.type == "cuda"
    if args.hf_dtype == "auto":
        args.hf_dtype = (str(engine.dtype).removeprefix("torch.") if cuda
                         else "bfloat16" if cpu_has_bf16() else "float32")
    eager = Engine(path, replace(config, cuda_graph_max_batch=0)) if engine.graphs else None
    hf = None if args.skip_hf else AutoModelForCausalLM.from_pretrained(
        path, dtype=getattr(torch, args.hf_dtype)).to(engine.device)
    print(f"engine dtype {engine.dtype} on {engine.device}, KV cache {engine.cache.dtype}, "
          f"{engine.kernels}, transformers "
          f"dtype {args.hf_dtype}, threads {torch.get_num_threads()}, {args.num_new} new tokens")
    for warming in (engine, eager):
        if warming is not None:
            run_engine(warming, make_prompts(tokenizer, 4), 8)
    if hf is not None:
        run_transformers(hf, make_prompts(tokenizer, 4), 8, 2)
    for batch in (int(b) for b in args.batches.split(",")):
        prompts = make_prompts(tokenizer, batch, args.prompt_words)
        if eager is not None:
            plain, plain_first = run_engine(eager, prompts, args.num_new)
            report("eager engine", batch, args.num_new, plain, plain_first)
        ours, ours_first = run_engine(engine, prompts, args.num_new)
        report("engine", batch, args.num_new, ours, ours_first)
        if eager is not None:
            step = (decode_ms(ours, ours_first, args.num_new)
                    / decode_ms(plain, plain_first, args.num_new))
            print(f"  batch {batch}: CUDA graphs' throughput ratio {plain / ours:.2f}x, "
                  f"per-token time ratio {step:.3f}")
        if hf is not None:
            theirs, theirs_first = run_transformers(hf, prompts, args.num_new, 2)
            report("transformers", batch, args.num_new, theirs, theirs_first)
            latency = (decode_ms(ours, ours_first, args.num_new)
                       / decode_ms(theirs, theirs_first, args.num_new))
            print(f"  batch {batch}: throughput ratio {theirs / ours:.2f}x, "
                  f"per-token time ratio {latency:.3f}")


def decode_ms(total_s: float, first_s: float, num_new: int) -> float:
    return (total_s - first_s) / max(1, num_new - 1) * 1000


def report(name: str, batch: int, num_new: int, total_s: float, first_s: float) -> None:
    step_ms = decode_ms(total_s, first_s, num_new)
    print(f"{name:>12} batch {batch:3d}: {batch * num_new / total_s:8.1f} tok/s, "
          f"first token {first_s * 1000:7.1f} ms, decode {step_ms:6.2f} ms/step")


if __name__ == "__main__":
    main()
