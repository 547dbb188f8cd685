"""Chats arriving together that share a system prompt, on the scheduler's engine
offline: each wave is a cold burst (its system prompt starts with its own
"Session N."), then 64 new tokens each, greedy, ignore_eos. Prints each wave's
output tok/s, when its last first token came, and the prompt tokens the prefix
cache gave (the rest were computed). Compare two checkouts by running it in
each (PYTHONPATH=<checkout>).
Run: .venv/bin/python bench/prefix_burst.py --system-words 300 --max-batch-tokens 8192"""

from __future__ import annotations

import argparse
import time

from pipeline.bench import make_prompts
from pipeline.config import SchedulerConfig
from pipeline.messages import Sampling
from pipeline.models import DEFAULT_MODEL, resolve_model
from pipeline.tokenizer import Tokenizer
from workers.scheduler.engine import Engine, EngineRequest


def wave_prompts(tokenizer: Tokenizer, system: str, wave: int, chats: int) -> list[list[int]]:
    return [tokenizer.encode(tokenizer.apply_chat_template([
        {"role": "system", "content": f"Session {wave}. {system}"},
        {"role": "user", "content": question}])) for question in make_prompts(chats, 24, wave)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--system-words", type=int, default=300)
    parser.add_argument("--chats", type=int, default=64, help="a wave's requests")
    parser.add_argument("--waves", type=int, default=3)
    parser.add_argument("--max-batch-tokens", type=int, default=None,
                        help="the step's token budget (default: the device's)")
    args = parser.parse_args()
    path = resolve_model(DEFAULT_MODEL).path
    tokenizer = Tokenizer(path)
    engine = Engine(path, SchedulerConfig(max_batch_tokens=args.max_batch_tokens))
    system = make_prompts(1, args.system_words, 777)[0]
    sampling = Sampling(max_tokens=64, temperature=0.0, ignore_eos=True)
    for wave in range(args.waves):
        prompts = wave_prompts(tokenizer, system, wave, args.chats)
        hits = engine.stats().num_prefix_hit_tokens
        first: dict[str, float] = {}
        tokens, started = 0, time.perf_counter()
        for i, ids in enumerate(prompts):
            engine.add(EngineRequest(f"{wave}-{i}", ids, [], sampling))
        while engine.has_work():
            for result in engine.step():
                first.setdefault(result.request_id, time.perf_counter() - started)
                tokens += len(result.new_ids)
        elapsed = time.perf_counter() - started
        reused = engine.stats().num_prefix_hit_tokens - hits
        total = sum(len(ids) for ids in prompts)
        print(f"wave {wave}: {args.chats} chats of ~{total // args.chats} prompt tokens: "
              f"{tokens / elapsed:.0f} tok/s, last first token {max(first.values()) * 1000:.0f} "
              f"ms, {reused} of {total} prompt tokens reused", flush=True)


if __name__ == "__main__":
    main()
