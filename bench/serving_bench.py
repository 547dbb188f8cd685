"""Our `pipeline serve` against transformers `generate` on the same prompts: output tok/s at
concurrency (ours) or static batch (transformers) 1, 16 and 64, and per-token latency at 1,
in ROUNDS rounds; each level's ratio is the median of its rounds' ratios.
Writes bench/results/serving.{json,md,png}.  Run: .venv/bin/python bench/serving_bench.py

With `--device cuda` (auto picks it where CUDA is) both sides run on the GPU, at
GPU_LEVELS, with two api workers (GPU_SERVER_ENV); it writes serving_gpu.*."""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import httpx
import psutil
import redis

from pipeline.bench import BenchOptions, make_prompts, run_bench
from pipeline.models import DEFAULT_MODEL, resolve_model
from pipeline.status import live_workers

LEVELS = {1: 8, 16: 32, 64: 64}  # concurrency or batch size -> requests at that level
# a GPU serves ~10x the CPU's tokens: more requests a level and a level of 256, but few at 1,
# where transformers' GPU step is bound by its Python and kernel launches, not the GPU
GPU_LEVELS = {1: 2, 16: 32, 64: 128, 256: 256}
# `pipeline serve` sizes its batches for the GPU itself (pipeline.config.GPU_SIZES); at
# ~20k tok/s one api process would spend most of a core on the streams, so two
GPU_SERVER_ENV = {"PIPELINE_API_WORKERS": "2"}
PROMPT_WORDS, MAX_TOKENS, SEED = 24, 64, 0
# this shared machine's speed moves by 10-30% within minutes (transformers' batch 64
# gave 301-404 tok/s across one afternoon's runs): each round measures ours, then
# theirs, level by level, so each ratio pairs neighbours in time, and the median
# of the rounds' ratios is what a level reports
QUIET = 0.9  # host CPU idle below this before a run: other processes would skew it
ROUNDS = 3
OUR_DTYPE = "auto"  # what `pipeline serve` picks on this machine
# transformers runs in both and is credited with its faster one at each level: on
# some hosts here bf16 matmul is 2x fp32, on others 1.7x slower. A CPU without a
# bf16 matmul (no avx512_bf16 or amx_bf16) emulates it ~150x slower: fp32 only.
HF_DTYPES = ("bfloat16", "float32")
ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
COMMAND = ".venv/bin/python bench/serving_bench.py"


@dataclass(frozen=True)
class Setup:
    """Where both sides run, and what that asks of the run."""
    device: str
    levels: dict[int, int]
    hf_dtypes: tuple[str, ...]  # transformers runs in each, credited with its faster
    server_env: dict[str, str]  # for `pipeline serve`, beside this process's
    results_name: str  # bench/results/NAME.{json,md,png}


def make_setup(device: str) -> Setup:
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        return Setup("cuda", dict(GPU_LEVELS), ("bfloat16",), dict(GPU_SERVER_ENV),
                     "serving_gpu")
    return Setup("cpu", dict(LEVELS), hf_dtypes(), {}, "serving")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(port: int, log_path: Path, setup: Setup, deadline_s: float = 600,
                 root: Path = ROOT) -> subprocess.Popen:
    """`pipeline serve` as a child, from the checkout at `root` (`-m` puts its working
    directory first on the path, its workers' too); returns once it printed its
    "serving" line and /health answers. The first run converts the model, hence the
    long deadline."""
    cmd = [sys.executable, "-m", "pipeline.cli", "serve", "--port", str(port),
           "--dtype", OUR_DTYPE, "--device", setup.device, "--log-level", "warning"]
    proc = subprocess.Popen(cmd, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=os.environ | setup.server_env)
    serving = threading.Event()

    def copy_output() -> None:
        with log_path.open("w") as log:
            for line in proc.stdout:
                log.write(line)
                log.flush()
                if "serving" in line:
                    serving.set()

    threading.Thread(target=copy_output, daemon=True).start()
    deadline = time.monotonic() + deadline_s
    while not serving.wait(0.5):
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_server(proc)
            raise RuntimeError(f"pipeline serve did not come up; see {log_path}")
    if httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).status_code != 200:
        stop_server(proc)
        raise RuntimeError("pipeline serve printed its serving line but /health is not 200")
    return proc


# what a scheduler says it runs on (its liveness key, as `pipeline status` shows it)
KERNEL_FIELDS = ("dtype", "4bit_matmul", "activations", "dense_matmul", "attention",
                 "kv_cache_dtype")


def tier_kernels(serve_output: str, wait_s: float = 10.0) -> dict:
    """The kernels the scheduler of a `pipeline serve` chose, found through the
    Redis URL its "serving" line names: the engine times some choices at
    startup, and a tier started beside a busy process once served C=64 at 0.35x
    on fp32 kernels (round AB in bench/HISTORY.md). Empty if none answers."""
    match = re.search(r"\(Redis: (\S+)\)", serve_output)
    deadline = time.monotonic() + wait_s
    while match is not None:
        try:
            workers = live_workers(match.group(1), "pipeline")
        except redis.RedisError:
            workers = []
        for worker in workers:
            if worker.get("role") == "scheduler":
                return {key: worker[key] for key in KERNEL_FIELDS if key in worker}
        if time.monotonic() > deadline:
            break
        time.sleep(0.5)
    return {}


def describe(kernels: dict) -> str:
    return ", ".join(f"{key} {value}" for key, value in kernels.items()) or "unknown"


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def level_seed(level: int, round_: int = 0) -> int:
    """Each level and round its own prompts: with one seed for all, a level's
    prompts began with the last level's, whose first blocks our prefix cache
    still held (transformers has none): 528 of the 1555 prompt tokens at 64."""
    return SEED + level + 1000 * round_


def bench_options(base_url: str, level: int, num_requests: int, seed: int) -> BenchOptions:
    return BenchOptions(base_url=base_url, num_requests=num_requests, concurrency=level,
                        prompt_words=PROMPT_WORDS, max_tokens=MAX_TOKENS, ignore_eos=True,
                        temperature=0.0, model=DEFAULT_MODEL, seed=seed)


def measure_ours(base_url: str, level: int, num_requests: int, round_: int) -> dict:
    before = psutil.cpu_times()
    summary = run_bench(bench_options(base_url, level, num_requests, level_seed(level, round_)))
    summary["host_cpu_idle"] = idle_share(before, psutil.cpu_times())
    print(f"ours  level {level:>2}: {summary['output_throughput']:.1f} tok/s, "
          f"{summary['failed']} failed", flush=True)
    return summary


def idle_share(before, after) -> float | None:
    """The share of the host's CPU time between two psutil.cpu_times() that
    nothing ran in (idle and iowait). Near 0: every core was busy, with the
    engine's threads (OpenMP's spin-waits between regions count too), the
    tier's other processes and the bench client; on 2 cores that holds even
    at C=1 (round AC in bench/HISTORY.md: 0.2-1.1% at every level)."""
    fields = [f for f in before._fields if f not in ("guest", "guest_nice")]  # in user already
    spent = sum(getattr(after, f) - getattr(before, f) for f in fields)
    idle = sum(getattr(after, f) - getattr(before, f) for f in ("idle", "iowait")
               if f in fields)
    return idle / spent if spent > 0 else None


def host_idle_now(seconds: float = 2.0) -> float:
    """idle_share over `seconds` of this host doing nothing of ours."""
    before = psutil.cpu_times()
    time.sleep(seconds)
    share = idle_share(before, psutil.cpu_times())
    return 1.0 if share is None else share


def load_transformers(dtype: str, device: str):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_model(DEFAULT_MODEL).path
    tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
    return tokenizer, model.to(device)


def generate_batch(tokenizer, model, prompts: list[str]) -> tuple[float, int, list[float]]:
    """One static batch, greedy, exactly MAX_TOKENS new tokens each (like ignore_eos).
    Returns (seconds, new tokens, gaps between decode steps in seconds)."""
    import torch
    from transformers import LogitsProcessor, LogitsProcessorList

    class StepClock(LogitsProcessor):  # called once per generated token, batch-wide
        def __init__(self) -> None:
            self.times: list[float] = []

        def __call__(self, input_ids, scores):
            self.times.append(time.perf_counter())
            return scores

    clock = StepClock()
    inputs = tokenizer(prompts, return_tensors="pt", padding=True).to(model.device)
    started = time.perf_counter()
    with torch.inference_mode():
        output = model.generate(**inputs, max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS,
                                do_sample=False, pad_token_id=tokenizer.pad_token_id,
                                logits_processor=LogitsProcessorList([clock]))
    if model.device.type == "cuda":
        torch.cuda.synchronize()
    elapsed_s = time.perf_counter() - started
    new_tokens = (output.shape[1] - inputs["input_ids"].shape[1]) * len(prompts)
    gaps = [later - earlier for earlier, later in itertools.pairwise(clock.times)]
    return elapsed_s, new_tokens, gaps


def hf_dtypes() -> tuple[str, ...]:
    from workers.scheduler.calibrate import cpu_has_bf16

    return HF_DTYPES if cpu_has_bf16() else ("float32",)


def measure_transformers(models: dict[str, tuple], level: int, num_requests: int,
                         round_: int) -> dict:
    """The level at transformers' faster dtype (each dtype it was given)."""
    runs = [measure_transformers_in(dtype, *models[dtype], level, num_requests, round_)
            for dtype in models]
    return max(runs, key=lambda run: run["output_throughput"])


def measure_transformers_in(dtype: str, tokenizer, model, level: int, num_requests: int,
                            round_: int) -> dict:
    prompts = make_prompts(num_requests, PROMPT_WORDS, level_seed(level, round_))  # run_bench's
    elapsed_s, new_tokens, gaps = 0.0, 0, []
    for start in range(0, num_requests, level):
        seconds, tokens, batch_gaps = generate_batch(tokenizer, model,
                                                     prompts[start:start + level])
        elapsed_s, new_tokens = elapsed_s + seconds, new_tokens + tokens
        gaps += batch_gaps
    stats = {"output_throughput": new_tokens / elapsed_s, "elapsed_s": elapsed_s,
             "output_tokens": new_tokens, "dtype": dtype,
             "per_token_ms_p50": 1000 * sorted(gaps)[len(gaps) // 2]}
    print(f"transformers {dtype} batch {level:>2}: {stats['output_throughput']:.1f} tok/s",
          flush=True)
    return stats


def targets(levels: list[dict]) -> list[dict]:
    by_level = {entry["level"]: entry for entry in levels}
    latency = [r["itl_per_token"] for r in by_level[1]["rounds"]]
    latency = None if None in latency else statistics.median(latency)
    return [
        *({"name": f"C={level} tok/s ratio >= 3", "value": by_level[level]["ratio"],
           "met": by_level[level]["ratio"] >= 3} for level in (64, 16)),
        {"name": "C=1 our ITL p50 <= 0.15 x transformers per-token time at batch 1 "
                 "(rounds' median)",
         "value": latency, "met": latency is not None and latency <= 0.15},
    ]


def processor(device: str) -> str:
    """The CPU's model name and the vector extensions that decide its matmuls; the GPU's
    name where both sides ran there."""
    if device == "cuda":
        import torch

        return f"{torch.cuda.get_device_name()} (CUDA {torch.version.cuda})"
    from workers.scheduler.native import cpu_flags

    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines()
                 if line.startswith("model name")), platform.processor())
    flags = sorted(cpu_flags() & {"avx2", "avx512f", "avx512_bf16", "amx_bf16"})
    return f"{name} ({', '.join(flags) or 'no AVX2'})"


def median_run(runs: list[dict]) -> dict:
    return sorted(runs, key=lambda run: run["output_throughput"])[(len(runs) - 1) // 2]


def level_entry(level: int, num_requests: int, ours: list[dict], theirs: list[dict]) -> dict:
    """One level over its rounds: the ratio is the median of the rounds' ratios;
    each side's figures (latencies too) are its median round's."""
    rounds = [{"ours": mine["output_throughput"], "transformers": other["output_throughput"],
               "ratio": mine["output_throughput"] / other["output_throughput"],
               "itl_per_token": None if mine["itl_ms"]["p50"] is None
               else mine["itl_ms"]["p50"] / other["per_token_ms_p50"]}
              for mine, other in zip(ours, theirs, strict=True)]
    return {"level": level, "num_requests": num_requests, "ours": median_run(ours),
            "transformers": median_run(theirs),
            "ratio": statistics.median(r["ratio"] for r in rounds), "rounds": rounds}


def build_record(setup: Setup, ours: dict[int, list[dict]], theirs: dict[int, list[dict]],
                 kernels: dict, idle_before: float) -> dict:
    """`kernels`: what our scheduler chose (tier_kernels); `idle_before`: the host's
    CPU idle share just before the run (host_idle_now)."""
    import torch
    import transformers

    levels = [level_entry(level, setup.levels[level], ours[level], theirs[level])
              for level in setup.levels]
    command = COMMAND + (" --device cuda" if setup.device == "cuda" else "")
    return {
        "command": command, "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "device": setup.device,
                    "cpu": processor(setup.device), "platform": platform.platform(),
                    "python": platform.python_version(), "torch": torch.__version__,
                    "transformers": transformers.__version__, "idle_before": idle_before},
        "settings": {"model": DEFAULT_MODEL, "dtype": OUR_DTYPE, "hf_dtypes": setup.hf_dtypes,
                     "server_env": setup.server_env,
                     "prompt_words": PROMPT_WORDS,
                     "max_tokens": MAX_TOKENS, "greedy": True, "ignore_eos": True,
                     "endpoint": "completions (plain-text prompts on both sides)",
                     "levels": setup.levels, "rounds": len(levels[0]["rounds"])},
        "levels": levels, "targets": targets(levels), "ours_kernels": kernels,
    }


def markdown(record: dict) -> str:
    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:.1f}"

    def share(value: float | None) -> str:
        return "-" if value is None else f"{100 * value:.1f}%"

    lines = ["| level | ours tok/s | transformers tok/s (its dtype) | ratio (rounds' median) "
             "| rounds' ratios | our TTFT p50 ms | our ITL p50 ms | our TPOT p50 ms | failed "
             "| host CPU idle (ours) |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for entry in record["levels"]:
        ours = entry["ours"]
        ratios = " / ".join(f"{r['ratio']:.2f}" for r in entry["rounds"])
        lines.append(
            f"| {entry['level']} | {ours['output_throughput']:.1f} "
            f"| {entry['transformers']['output_throughput']:.1f} "
            f"({entry['transformers']['dtype']}) | {entry['ratio']:.2f}x | {ratios} "
            f"| {ms(ours['ttft_ms']['p50'])} | {ms(ours['itl_ms']['p50'])} "
            f"| {ms(ours['tpot_ms']['p50'])} | {ours['failed']} "
            f"| {share(ours.get('host_cpu_idle'))} |")
    per_token = record["levels"][0]["transformers"]["per_token_ms_p50"]
    lines += ["", f"transformers per-token time at batch 1 (p50 decode step): {per_token:.1f} ms",
              ""]
    for target in record["targets"]:
        value = "-" if target["value"] is None else f"{target['value']:.3f}"  # 0.154 is not met
        lines.append(f"- {'met' if target['met'] else 'NOT met'}: {target['name']} ({value})")
    settings = record["settings"]
    lines += ["", f"Made by `{record['command']}` at {record['created']} on "
              f"{record['machine']['cpus']} CPUs, {record['machine']['cpu']} "
              f"({record['machine']['platform']}): "
              f"{settings['model']}, ours with --dtype {settings['dtype']}, transformers in "
              f"{' and '.join(settings['hf_dtypes'])} (the faster at each level); "
              f"{settings['prompt_words']}-word prompts, "
              f"{settings['max_tokens']} output tokens, greedy, ignore_eos; ours at concurrency "
              f"= level, transformers as static batches of that size, left-padded; "
              f"{settings['rounds']} rounds, each level by level, ours then theirs; each "
              f"side's figures are its median round's. Host CPU idle: the share of "
              f"the host's CPU time nothing ran in during our median round (near 0: "
              f"every core busy, with the engine's threads, OpenMP's spin-waits "
              f"included, the tier's other processes and the bench client)."]
    if settings["server_env"]:
        lines.append("Our server's settings: " + ", ".join(
            f"{key}={value}" for key, value in settings["server_env"].items()) + ".")
    lines.append(f"Our scheduler ran on: {describe(record['ours_kernels'])}.")
    if (quiet := record["machine"].get("idle_before")) is not None:
        lines.append(f"The host's CPU was {100 * quiet:.1f}% idle in the 2 s before the run.")
    lines.append("")
    return "\n".join(lines)


def plot(record: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [str(entry["level"]) for entry in record["levels"]]
    ours = [entry["ours"]["output_throughput"] for entry in record["levels"]]
    theirs = [entry["transformers"]["output_throughput"] for entry in record["levels"]]
    positions = range(len(labels))
    figure, axes = plt.subplots(figsize=(7, 4.2))
    axes.bar([p - 0.2 for p in positions], ours, width=0.4, label="pipeline serve")
    axes.bar([p + 0.2 for p in positions], theirs, width=0.4, label="transformers generate")
    for p, entry, height in zip(positions, record["levels"], ours, strict=True):
        axes.annotate(f"{entry['ratio']:.2f}x", (p - 0.2, height), ha="center", va="bottom")
    axes.set_xticks(list(positions), labels)
    axes.set_xlabel("concurrency (ours) / static batch size (transformers)")
    axes.set_ylabel("output tokens/s")
    machine = record["machine"]
    where = machine["cpu"] if machine["device"] == "cuda" else f"{machine['cpus']} CPUs"
    axes.set_title(f"{record['settings']['model']}, {where}")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main() -> None:
    """Rounds of level by level, ours then transformers, so that a noisy spell
    on this shared machine lands on both sides of a ratio more often than on
    one. The server idles (blocked on Redis) while transformers runs. Its
    faster dtype at each level, found in the first round, runs the later ones."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    setup = make_setup(parser.parse_args().device)
    RESULTS.mkdir(parents=True, exist_ok=True)
    quiet = host_idle_now()
    print(f"host CPU idle before the run: {100 * quiet:.1f}%", flush=True)
    if quiet < QUIET:
        print(f"warning: other processes use {100 * (1 - quiet):.0f}% of this host's CPU; "
              "both sides' figures will be slower and noisier", flush=True)
    models = {}
    for dtype in setup.hf_dtypes:
        models[dtype] = load_transformers(dtype, setup.device)
        # warm-up; on a GPU each batch size's first call also picks its kernels (in the
        # first run there, transformers' first round at each level was 1.5-3x slower)
        for size in (2, *setup.levels) if setup.device == "cuda" else (2,):
            generate_batch(*models[dtype], make_prompts(size, PROMPT_WORDS, SEED + 99))
    port = free_port()
    log_path = Path(tempfile.gettempdir()) / "serving-bench-server.log"
    proc = start_server(port, log_path, setup)
    base_url = f"http://127.0.0.1:{port}"
    ours: dict[int, list[dict]] = {level: [] for level in setup.levels}
    theirs: dict[int, list[dict]] = {level: [] for level in setup.levels}
    try:
        kernels = tier_kernels(log_path.read_text())
        print(f"our scheduler runs on: {describe(kernels)}", flush=True)
        run_bench(bench_options(base_url, 4, 4, seed=SEED + 99))  # warm-up
        for round_ in range(ROUNDS):
            print(f"round {round_ + 1} of {ROUNDS}", flush=True)
            for level, num_requests in setup.levels.items():
                ours[level].append(measure_ours(base_url, level, num_requests, round_))
                dtypes = [theirs[level][0]["dtype"]] if round_ else list(models)
                theirs[level].append(measure_transformers(
                    {dtype: models[dtype] for dtype in dtypes}, level, num_requests, round_))
    finally:
        stop_server(proc)
    record = build_record(setup, ours, theirs, kernels, quiet)
    name = setup.results_name
    (RESULTS / f"{name}.json").write_text(json.dumps(record, indent=2))
    (RESULTS / f"{name}.md").write_text(markdown(record))
    plot(record, RESULTS / f"{name}.png")
    print(markdown(record))


if __name__ == "__main__":
    main()
