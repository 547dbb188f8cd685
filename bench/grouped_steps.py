"""Paired engine steps: a step of grouped rows (layers.c's decode_layers_grouped)
against one run layer by layer, alternating in one engine so that both see the
same host, on the serving bench's prompts; quiet, and beside a process that is
busy B ms in every P (standing in for the tier's other processes on 2 cores).
Prints each round's median decode step and the ratio grouped / layer by layer.
Run: .venv/bin/python bench/grouped_steps.py --rows 64 --burst 0.5/3
(--rows 16 --min-group-rows 4: steps serving leaves ungrouped, grouped anyway;
--against-groups 3: grouped against grouped with 3 groups a thread, not layer by layer)"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

from pipeline.bench import make_prompts
from pipeline.config import SchedulerConfig
from pipeline.messages import Sampling
from pipeline.models import DEFAULT_MODEL, resolve_model
from pipeline.tokenizer import Tokenizer
from workers.scheduler import layers
from workers.scheduler.engine import Engine, EngineRequest

SERVED_GROUPS = layers.MAX_GROUPS

BUSY = """import sys, time
busy, period = float(sys.argv[1]) / 1e3, float(sys.argv[2]) / 1e3
while True:
    start = time.perf_counter()
    while time.perf_counter() - start < busy:
        pass
    time.sleep(period - busy)
"""


def timed_step(engine: Engine, kinds: dict[str, list[float]], against: int | None) -> None:
    """One step, grouped or the other kind, whichever has run fewer. The other kind
    is layer by layer, or with `against` groups a thread (layers.MAX_GROUPS)
    instead of serving's own."""
    kind = "grouped" if len(kinds["grouped"]) < len(kinds["layers"]) else "layers"
    engine.model.driver.grouped = kind == "grouped" or against is not None
    layers.MAX_GROUPS = against if kind == "layers" and against else SERVED_GROUPS
    started = time.perf_counter()
    engine.step()
    kinds[kind].append(1000 * (time.perf_counter() - started))


def one_round(engine: Engine, tokenizer: Tokenizer, rows: int, seed: int,
              burst: tuple[float, float] | None,
              against: int | None) -> dict[str, dict[str, list[float]]]:
    sampling = Sampling(max_tokens=64, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(make_prompts(rows, 24, seed)):
        engine.add(EngineRequest(f"{seed}-{i}", tokenizer.encode(prompt), [], sampling))
    prefill: dict[str, list[float]] = {"grouped": [], "layers": []}
    while engine.batcher.waiting or not all(s.is_decoding for s in engine.batcher.running):
        timed_step(engine, prefill, against)
    busy = None if burst is None else subprocess.Popen(
        [sys.executable, "-c", BUSY, str(burst[0]), str(burst[1])])
    decode: dict[str, list[float]] = {"grouped": [], "layers": []}
    try:
        while engine.has_work():
            timed_step(engine, decode, against)
    finally:
        if busy is not None:
            busy.kill()
            busy.wait()
    return {"prefill": prefill, "decode": decode}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=64, help="requests, so decode rows")
    parser.add_argument("--rounds", type=int, default=4, help="half of them beside --burst")
    parser.add_argument("--burst", default="0.5/3", help="B/P: busy B ms in every P; none")
    parser.add_argument("--min-group-rows", type=int, default=layers.MIN_GROUP_ROWS,
                        help="smaller groups, to group steps of fewer rows than serving does")
    parser.add_argument("--against-groups", type=int, default=None,
                        help="pair grouped steps against N groups a thread, not layer by layer")
    args = parser.parse_args()
    layers.MIN_GROUP_ROWS = args.min_group_rows
    burst = None if args.burst == "none" else tuple(map(float, args.burst.split("/")))
    model = resolve_model(DEFAULT_MODEL)
    engine = Engine(model.path, SchedulerConfig(max_running_requests=max(64, args.rows)))
    if engine.model.driver is None:
        sys.exit("this host runs no layers.c driver (layers.Driver.build): nothing to compare")
    tokenizer = Tokenizer(model.path)
    for round_ in range(args.rounds):
        beside = burst if round_ % 2 else None
        steps = one_round(engine, tokenizer, args.rows, 1000 + round_, beside,
                          args.against_groups)
        decode = {kind: statistics.median(times) for kind, times in steps["decode"].items()}
        prefill = steps["prefill"]
        other = (f"{args.against_groups} groups a thread" if args.against_groups
                 else "layer by layer")
        print(f"round {round_ + 1} ({'beside the busy process' if beside else 'quiet'}): "
              f"{args.rows}-row decode step {decode['grouped']:.1f} ms grouped, "
              f"{decode['layers']:.1f} {other}: {decode['grouped'] / decode['layers']:.3f}x"
              f"; prefill steps {[round(t) for t in prefill['grouped']]} grouped, "
              f"{[round(t) for t in prefill['layers']]} {other}", flush=True)


if __name__ == "__main__":
    main()
