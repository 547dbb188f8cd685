"""CPU a streamed token costs each process of a running tier over one `pipeline bench`
run: the api workers, the scheduler (its event loop apart from its engine's threads),
the detokenizers, every redis-server on the host, and this client itself.
Run beside a tier (`pipeline serve`, or workers by hand):
    .venv/bin/python bench/tier_cpu.py --base-url http://127.0.0.1:8000 --concurrency 64
Processes are found by command line (`pipeline.cli worker --role ROLE`, as `pipeline serve`
starts them): run it with one tier on the host."""

from __future__ import annotations

import argparse
import json
import resource
from collections import defaultdict

import psutil

from pipeline.bench import BenchOptions, run_bench

ROLES = ("api", "scheduler", "detokenizer")


def role_of(cmdline: list[str]) -> str | None:
    if "pipeline.cli" not in cmdline or "--role" not in cmdline:
        return "redis" if cmdline and "redis-server" in cmdline[0] else None
    role = cmdline[cmdline.index("--role") + 1]
    return role if role in ROLES else None


def tier_processes() -> dict[str, list[psutil.Process]]:
    found: dict[str, list[psutil.Process]] = defaultdict(list)
    for proc in psutil.process_iter(["cmdline"]):
        role = role_of(proc.info["cmdline"] or [])
        if role is not None:
            found[role].append(proc)
    return found


def require_tier(parser: argparse.ArgumentParser) -> dict[str, list[psutil.Process]]:
    """Every role's processes on this host; exits through `parser` if a role has none."""
    found = tier_processes()
    missing = [role for role in ROLES if role not in found]
    if missing:
        parser.error(f"no {', '.join(missing)} process found on this host")
    return found


def cpu_times(found: dict[str, list[psutil.Process]]) -> dict[str, tuple[float, float]]:
    """(user, system) seconds by part; a scheduler splits into its event loop (the
    main thread) and its engine (every other thread: the step's own and OpenMP's)."""
    times: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for role, procs in found.items():
        for proc in procs:
            try:
                if role == "scheduler":
                    for thread in proc.threads():
                        part = "scheduler loop" if thread.id == proc.pid else "scheduler engine"
                        times[part][0] += thread.user_time
                        times[part][1] += thread.system_time
                else:
                    cpu = proc.cpu_times()
                    times[role][0] += cpu.user
                    times[role][1] += cpu.system
            except psutil.NoSuchProcess:
                continue
    usage = resource.getrusage(resource.RUSAGE_SELF)
    times["bench client"] = [usage.ru_utime, usage.ru_stime]
    return {part: (user, system) for part, (user, system) in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--num-requests", type=int, default=192)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=None,
                        help="requests run first, unmeasured (default: --concurrency): a "
                        "fresh tier's first wave pays page faults and lazy setup (the engine "
                        "took 1914 µs a token in one first run, 1670-1692 in the next two)")
    parser.add_argument("--json", default=None, help="write the figures here too")
    args = parser.parse_args()
    found = require_tier(parser)

    def bench(num_requests: int) -> dict:
        return run_bench(BenchOptions(base_url=args.base_url, num_requests=num_requests,
                                      concurrency=args.concurrency, max_tokens=args.max_tokens,
                                      ignore_eos=True))

    warmup = args.concurrency if args.warmup is None else args.warmup
    if warmup:
        bench(warmup)
    before = cpu_times(found)
    result = bench(args.num_requests)
    after = cpu_times(found)
    tokens = result["total_output_tokens"]
    per_token = {part: {"user_us": (after[part][0] - before[part][0]) / tokens * 1e6,
                        "system_us": (after[part][1] - before[part][1]) / tokens * 1e6}
                 for part in after if part in before}
    print(f"concurrency {args.concurrency}: {result['output_throughput']:.1f} tok/s, "
          f"{tokens} tokens, {result['failed']} failed; CPU a token (µs, user + system):")
    for part, spent in sorted(per_token.items(), key=lambda item: -sum(item[1].values())):
        print(f"  {part:>16}: {spent['user_us']:8.1f} + {spent['system_us']:6.1f}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"concurrency": args.concurrency, "tok_s": result["output_throughput"],
                       "tokens": tokens, "cpu_us_per_token": per_token}, out, indent=1)


if __name__ == "__main__":
    main()
