"""Service tiers under a saturating load: default-tier requests arriving faster than the
tier serves them (Poisson arrivals, so that slots free steadily, not in waves), a queue
that grows behind them, and, beside it, a few probe requests of each
tier named, sent together once the queue has formed; each group's time to first token.
A priority request starts at once (a running default one makes way); a default one
waits behind the queue; a flex one waits until the queue is empty (here, until the
load ends).
Run beside a tier (`pipeline serve`, or workers by hand):
    .venv/bin/python bench/tiers_bench.py --base-url http://127.0.0.1:8000"""

from __future__ import annotations

import argparse
import asyncio
import json
import math

from pipeline.bench import BenchOptions, run_bench_async
from pipeline.worker import run_loop


async def measure(args: argparse.Namespace) -> dict:
    def options(service_tier: str, num_requests: int, max_tokens: int, seed: int,
                request_rate: float = math.inf):
        return BenchOptions(base_url=args.base_url, num_requests=num_requests,
                            request_rate=request_rate, max_tokens=max_tokens,
                            ignore_eos=True, seed=seed, service_tier=service_tier)

    load = asyncio.create_task(run_bench_async(options(
        "default", args.load_requests, args.max_tokens, 0, args.load_rate)))
    await asyncio.sleep(args.settle_s)  # the slots full, a queue behind them
    probes = await asyncio.gather(*(run_bench_async(options(
        tier, args.probes, args.probe_tokens, 10 + i)) for i, tier in enumerate(args.tiers)))
    loaded = await load
    return {"load": _figures(loaded)} | {
        tier: _figures(probe) for tier, probe in zip(args.tiers, probes, strict=True)}


def _figures(summary: dict) -> dict:
    return {"completed": summary["completed"], "failed": summary["failed"],
            "ttft_p50_ms": summary["ttft_ms"]["p50"], "ttft_p99_ms": summary["ttft_ms"]["p99"],
            "output_tok_s": round(summary["output_throughput"], 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--load-rate", type=float, default=26.0,
                        help="default-tier requests a second (past what the tier serves)")
    parser.add_argument("--load-requests", type=int, default=600)
    parser.add_argument("--probes", type=int, default=8, help="requests of each probe tier, "
                        "sent together")
    parser.add_argument("--tiers", nargs="+", default=["priority", "default", "flex"])
    parser.add_argument("--max-tokens", type=int, default=64, help="each load request's")
    parser.add_argument("--probe-tokens", type=int, default=8, help="each probe's")
    parser.add_argument("--settle-s", type=float, default=8.0)
    args = parser.parse_args()
    figures = run_loop(measure(args))
    print(json.dumps(figures, indent=2))
    print("\n| requests | TTFT p50 ms | TTFT p99 ms | completed |\n|---|---:|---:|---:|")
    for name, row in figures.items():
        p50, p99 = (f"{row[key]:.0f}" if row[key] is not None else "-"
                    for key in ("ttft_p50_ms", "ttft_p99_ms"))
        print(f"| {name} | {p50} | {p99} | {row['completed']} |")


if __name__ == "__main__":
    main()
