"""Served output tok/s and ITL p50 of this checkout against another commit, paired:
each pair starts `pipeline serve` from one and then the other (the order alternating
pair by pair; the commit from a temporary git worktree) and runs the same `pipeline
bench` against each. The shared host's speed moves by 10-30% within minutes, so compare
the pairs' ratios, not runs apart.
Run: .venv/bin/python bench/paired_serve.py --base 9d5fd2f [--pairs 3]
     [--concurrency 64] [--num-requests 192]"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
from pathlib import Path

from serving_bench import (  # beside this script: bench/ is first on the path
    ROOT,
    bench_options,
    describe,
    free_port,
    make_setup,
    start_server,
    stop_server,
    tier_kernels,
)

from pipeline.bench import run_bench


def served_tok_s(root: Path, concurrency: int, num_requests: int, seed: int,
                 log_path: Path) -> tuple[float, dict, float]:
    """One `pipeline serve` from `root`: a warm-up bench, then the timed one; the
    kernels its scheduler chose (serving_bench.tier_kernels), and its ITL p50 (ms)."""
    port = free_port()
    proc = start_server(port, log_path, make_setup("cpu"), root=root)
    try:
        kernels = tier_kernels(log_path.read_text())
        url = f"http://127.0.0.1:{port}"
        run_bench(bench_options(url, concurrency, concurrency, seed + 10_000))  # warm-up
        summary = run_bench(bench_options(url, concurrency, num_requests, seed))
        if summary["failed"]:
            raise RuntimeError(f"{summary['failed']} requests failed; see {log_path}")
        return summary["output_throughput"], kernels, summary["itl_ms"]["p50"]
    finally:
        stop_server(proc)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", required=True, help="the commit to compare against")
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--num-requests", type=int, default=192)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        base = Path(scratch) / "base"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(base),
                        args.base], check=True, capture_output=True)
        try:
            ratios, itl_ratios = [], []
            for pair in range(args.pairs):
                sides = [("head", ROOT), ("base", base)][::1 if pair % 2 == 0 else -1]
                runs = {name: served_tok_s(root, args.concurrency, args.num_requests, pair,
                                           Path(scratch) / f"{name}{pair}.log")
                        for name, root in sides}
                tok_s = {name: run[0] for name, run in runs.items()}
                itl = {name: run[2] for name, run in runs.items()}
                ratios.append(tok_s["head"] / tok_s["base"])
                itl_ratios.append(itl["head"] / itl["base"])
                print(f"pair {pair + 1}: head {tok_s['head']:.1f} tok/s, base "
                      f"{tok_s['base']:.1f} ({ratios[-1]:.3f}x); ITL p50 head "
                      f"{itl['head']:.2f} ms, base {itl['base']:.2f} ({itl_ratios[-1]:.3f}x)",
                      flush=True)
                if runs["head"][1] != runs["base"][1]:  # a pair on different kernels misleads
                    print(f"  the two ran on different kernels: head {describe(runs['head'][1])}; "
                          f"base {describe(runs['base'][1])}", flush=True)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force",
                            str(base)], check=False, capture_output=True)
    print(f"head/base at concurrency {args.concurrency}: median {statistics.median(ratios):.3f}x "
          f"(pairs: {' / '.join(f'{r:.3f}' for r in ratios)}); ITL p50 head/base: median "
          f"{statistics.median(itl_ratios):.3f}x (pairs: "
          f"{' / '.join(f'{r:.3f}' for r in itl_ratios)})")


if __name__ == "__main__":
    main()
