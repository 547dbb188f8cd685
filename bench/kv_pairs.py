"""Decode step time on two KV cache dtypes, paired: two engines in one process
(the same model and kernels) take waves of the same prompts in turn, the order
alternating wave by wave, so that the shared host's drift (10-30% within
minutes) lands on both; prints each wave's median full-batch decode step and
the ratio (second / first).
Run: .venv/bin/python bench/kv_pairs.py [--kv auto int8] [--rows 64 --prompt-words 24]
     .venv/bin/python bench/kv_pairs.py --rows 16 --prompt-words 700 --waves 4"""

from __future__ import annotations

import argparse
import statistics
import time

from engine_bench import make_prompts  # beside this script: bench/ is first on the path
from transformers import AutoTokenizer

from pipeline.config import SchedulerConfig
from pipeline.messages import Sampling
from pipeline.models import resolve_model
from workers.scheduler.engine import Engine, EngineRequest


def wave(engine: Engine, prompts: list[list[int]], tag: str, new_tokens: int) -> float:
    """Median seconds of the wave's decode steps with every row in them."""
    sampling = Sampling(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    for i, ids in enumerate(prompts):
        engine.add(EngineRequest(f"{tag}-{i}", ids, [], sampling))
    steps = []
    while engine.has_work():
        start = time.perf_counter()
        results = engine.step()
        if len(results) == len(prompts) and all(len(r.new_ids) == 1 for r in results):
            steps.append(time.perf_counter() - start)
    return statistics.median(steps[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kv", nargs=2, default=["auto", "int8"], metavar="DTYPE")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--prompt-words", type=int, default=24)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--waves", type=int, default=6)
    parser.add_argument("--dtype", default="auto", help="the engines' model dtype")
    args = parser.parse_args()
    path = resolve_model("SmolLM2-135M-Instruct").path
    engines = [Engine(path, SchedulerConfig(dtype=args.dtype, kv_cache_dtype=kv))
               for kv in args.kv]
    names = [f"{kv} ({engine.cache.dtype})".replace("torch.", "")
             for kv, engine in zip(args.kv, engines, strict=True)]
    prompts = make_prompts(AutoTokenizer.from_pretrained(path), args.rows, args.prompt_words)
    ratios = []
    for w in range(args.waves):
        # each wave's prompts its own (no prefix reused from the last wave)
        shifted = [[(t + 7 * w) % 49152 for t in ids] for ids in prompts]
        times = [0.0, 0.0]
        for i in (0, 1) if w % 2 == 0 else (1, 0):
            times[i] = wave(engines[i], shifted, f"{w}", args.new_tokens)
        ratios.append(times[1] / times[0])
        print(f"wave {w}: {names[0]} {times[0] * 1e3:.2f} ms, {names[1]} "
              f"{times[1] * 1e3:.2f} ms a step: {ratios[-1]:.3f}x", flush=True)
    print(f"{names[1]} / {names[0]}, decode step at {args.rows} rows: median "
          f"{statistics.median(ratios):.3f}x ({min(ratios):.3f}-{max(ratios):.3f})")


if __name__ == "__main__":
    main()
