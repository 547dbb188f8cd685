"""What structured output costs a step on the CPU: a constrained row's bitmask made
into the -inf penalty added to its logits, numpy's bitwise way (what the CPU runs)
against torch's shifts (what a GPU runs), in turns, and constrain() whole with
matchers inside a JSON string (the json_object grammar, many tokens allowed).

    .venv/bin/python bench/grammar_mask.py [--repeats 200]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pipeline.messages import Structure
from pipeline.models import resolve_model
from pipeline.tokenizer import Tokenizer
from workers.scheduler.grammar import Grammars, constrain, penalty_bitwise, penalty_shifted

VOCAB = 49152  # SmolLM2's


def timed_ms(work, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        work()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=200)
    repeats = parser.parse_args().repeats
    files = resolve_model("SmolLM2-135M-Instruct")
    grammars, tokenizer = Grammars(files.path, VOCAB, [2]), Tokenizer(files.path)
    inside_a_string = tokenizer.encode('{"name": "Al')
    print("| rows | bitwise ms | shifts ms | ratio | constrain() ms, 64-row logits |")
    print("|---:|---:|---:|---:|---:|")
    for rows in (1, 16, 64):
        bitmask = torch.randint(-2**31, 2**31 - 1, (rows, VOCAB // 32), dtype=torch.int32)
        assert torch.equal(penalty_bitwise(bitmask, VOCAB), penalty_shifted(bitmask, VOCAB))
        bitwise = timed_ms(lambda b=bitmask: penalty_bitwise(b, VOCAB), repeats)
        shifts = timed_ms(lambda b=bitmask: penalty_shifted(b, VOCAB), repeats)
        matchers = [grammars.matcher(Structure(kind="json_object"), inside_a_string)
                    for _ in range(rows)] + [None] * (64 - rows)
        logits = torch.randn(64, VOCAB)
        whole = timed_ms(lambda m=matchers, x=logits: constrain(x, m), repeats // 4)
        print(f"| {rows} | {bitwise:.3f} | {shifts:.3f} | {bitwise / shifts:.2f}x | {whole:.2f} |")


if __name__ == "__main__":
    main()
