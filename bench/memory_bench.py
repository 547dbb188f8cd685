"""Memory of a running tier over many requests: the resident set (RSS) of each role's
processes, sampled after every --every requests, and the scheduler's KV cache against
its budget (from its liveness record, as `pipeline status` shows it).
Run beside a tier (`pipeline serve`, or workers by hand), one tier on the host:
    .venv/bin/python bench/memory_bench.py --base-url http://127.0.0.1:8000 \
        --redis-url redis://127.0.0.1:6379/0
The requests vary, chunk by chunk, in prompt length (8 to 160 words), output length
(4 to 64 tokens), endpoint (completions or chat), greedy or sampled, and prompts, so
that the prefix cache keeps turning over and every kind of request runs many times.
Flat means: from the first sample after --settle requests (lazy setup and the
allocators' first growth) to the last, each role's RSS grows by nothing per request.
An allocator's high-water mark may still rise now and then (the scheduler's by 16-35
MiB once in some fresh tiers' first 1,000 requests), and on some hosts its RSS swings
by tens of MiB up and down; a leak sets a new high in nearly every chunk."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from itertools import accumulate
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from tier_cpu import ROLES, require_tier  # noqa: E402  (bench/ is not a package)

from pipeline.bench import BenchOptions, Endpoint, run_bench  # noqa: E402
from pipeline.status import live_workers  # noqa: E402

MiB = 2**20
Shape = tuple[int, int, Endpoint, float]  # prompt words, max tokens, endpoint, temperature
# a chunk takes the next shape in turn
SHAPES: list[Shape] = [(24, 16, Endpoint.completions, 0.7), (160, 4, Endpoint.chat, 0.0),
                       (8, 64, Endpoint.completions, 0.0), (64, 32, Endpoint.chat, 0.7)]


@dataclass
class Sample:
    requests: int  # done so far
    rss: dict[str, int]  # bytes, summed over the role's processes
    failed: int  # so far
    errors: list[str]  # so far, distinct


def rss_by_role(found: dict) -> dict[str, int]:
    return {role: sum(proc.memory_info().rss for proc in procs)
            for role, procs in found.items() if role in ROLES}


def run(base_url: str, found: dict, num_requests: int, every: int, concurrency: int,
        shapes: list[Shape] = SHAPES, seed: int = 0) -> list[Sample]:
    """`found`: role -> its psutil processes (tier_cpu.require_tier); each chunk's
    prompts come from its own seed, `seed` + its number."""
    samples = [Sample(0, rss_by_role(found), 0, [])]
    done = failed = 0
    errors: list[str] = []
    while done < num_requests:
        words, max_tokens, endpoint, temperature = shapes[len(samples) % len(shapes)]
        count = min(every, num_requests - done)
        summary = run_bench(BenchOptions(
            base_url=base_url, num_requests=count, concurrency=concurrency,
            prompt_words=words, max_tokens=max_tokens, endpoint=endpoint,
            ignore_eos=True, seed=seed + len(samples), temperature=temperature))
        done += count
        failed += summary["failed"]
        errors += [error for error in summary["errors"] if error not in errors]
        samples.append(Sample(done, rss_by_role(found), failed, list(errors)))
    return samples


def growth_mib(samples: list[Sample], role: str, settle: int) -> float:
    """RSS growth of `role` from the first sample at or past `settle` requests to the last."""
    start = next(s for s in samples if s.requests >= settle)
    return (samples[-1].rss[role] - start.rss[role]) / MiB


def new_highs(samples: list[Sample], role: str, settle: int, over_mib: float = 2.0) -> int:
    """Chunks past `settle` that left `role` more than `over_mib` above its highest RSS
    so far: a leak sets a new high in nearly every chunk, while an allocator that
    hands memory back and takes it again (glibc's arenas swing the scheduler by tens
    of MiB on some hosts) only touches its old peak."""
    kept = [s.rss[role] for s in samples if s.requests >= settle]
    peaks = accumulate(kept, max)  # each the highest up to and with its sample
    return sum((rss - peak) / MiB > over_mib for peak, rss in zip(peaks, kept[1:], strict=False))


def kv_report(redis_url: str, prefix: str) -> list[str]:
    lines = []
    for info in live_workers(redis_url, prefix):
        if info.get("role") == "scheduler" and "kv_cache_bytes" in info:
            lines.append(f"scheduler {info['id']}: KV cache {info['kv_cache_bytes'] / MiB:.1f} "
                         f"MiB in {info['num_blocks']} blocks, budget "
                         f"{info['kv_budget_bytes'] / MiB:.0f} MiB")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--redis-url", default=None, help="for the KV figures; none: skipped")
    parser.add_argument("--prefix", default="pipeline")
    parser.add_argument("--num-requests", type=int, default=1000)
    parser.add_argument("--every", type=int, default=100)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--settle", type=int, default=200,
                        help="requests before the growth is counted")
    parser.add_argument("--json", default=None, help="write the samples here too")
    args = parser.parse_args()
    found = require_tier(parser)
    samples = run(args.base_url, found, args.num_requests, args.every, args.concurrency)
    roles = sorted(samples[0].rss)
    print("| requests | " + " | ".join(f"{role} RSS MiB" for role in roles) + " | failed |")
    print("|---:|" + "---:|" * len(roles) + "---:|")
    for s in samples:
        print(f"| {s.requests} | " + " | ".join(f"{s.rss[r] / MiB:.1f}" for r in roles)
              + f" | {s.failed} |")
    for error in samples[-1].errors:
        print(f"error: {error}")
    for role in roles:
        print(f"{role}: {growth_mib(samples, role, args.settle):+.1f} MiB from request "
              f"{args.settle} to {samples[-1].requests}, a new high (by over 2 MiB) in "
              f"{new_highs(samples, role, args.settle)} of its chunks")
    if args.redis_url:
        print("\n".join(kv_report(args.redis_url, args.prefix)))
    if args.json:
        Path(args.json).write_text(json.dumps([s.__dict__ for s in samples], indent=1))


if __name__ == "__main__":
    main()
