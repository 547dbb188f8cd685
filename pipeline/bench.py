"""`pipeline bench`: a load generator for any OpenAI-compatible server, measuring each
streamed request the way `vllm bench serve` does (TTFT, TPOT, ITL, E2E) and summing up
request and output-token throughput. Torch-free: it only speaks HTTP, through
sse_client, since a load generator shares the machine with the server it measures
(httpx took 4x aiohttp's CPU per streamed event, and aiohttp ~1.5x sse_client's); each
event is decoded by msgspec (1.1 us an event against json's 5.2)."""

from __future__ import annotations

import asyncio
import enum
import json
import math
import random
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Annotated

import msgspec
import typer
from rich.console import Console
from rich.table import Table

from pipeline import sse_client
from pipeline.errors import ConfigError
from pipeline.worker import run_loop

WORDS = (
    "apple river stone cloud garden winter paper engine silver forest window candle "
    "market bridge thunder mirror pocket harbor meadow lantern ladder copper island "
    "rocket violin desert castle feather planet signal basket pillow canyon anchor "
    "orange tunnel wizard jacket mountain saddle ribbon glacier falcon compass velvet "
    "marble cactus dragon helmet kettle lemon magnet needle ocean parrot quartz rabbit "
    "saturn tiger umbrella valley walnut yellow zebra acorn blanket cherry dolphin "
    "eagle fountain giraffe hammer igloo jungle koala lizard meteor noodle owl pepper "
    "quiver raven spider tomato unicorn volcano whistle yogurt breeze chimney dune "
    "ember fjord goblet hollow ivory jasmine kernel lagoon mosaic nectar orchid pebble"
).split()
PERCENTILES = (50, 90, 99)
METRICS = ("ttft", "tpot", "itl", "e2e")


class Endpoint(enum.StrEnum):
    chat = "chat"
    completions = "completions"


@dataclass(frozen=True)
class BenchOptions:
    base_url: str = "http://127.0.0.1:8000"  # with or without the trailing /v1
    num_requests: int = 64
    concurrency: int | None = None  # None: no cap beyond what request_rate lets in
    request_rate: float = math.inf  # requests/s, Poisson arrivals; inf sends all at once
    prompt_words: int = 24
    max_tokens: int = 64
    ignore_eos: bool = False
    temperature: float = 0.0
    endpoint: Endpoint = Endpoint.completions
    model: str | None = None  # None: the first id GET /v1/models lists
    api_key: str | None = None
    seed: int = 0
    timeout_s: float = 600.0
    service_tier: str | None = None  # OpenAI's field, sent where set


@dataclass
class RequestResult:
    ok: bool = False
    error: str | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    num_chunks: int = 0
    done: bool = False  # the server ended the stream itself ([DONE])
    output_tokens: int | None = None  # from the server's usage; None if it sent none
    prompt_tokens: int | None = None

    @property
    def num_output_tokens(self) -> int:
        return self.output_tokens if self.output_tokens is not None else self.num_chunks


def make_prompts(num_requests: int, prompt_words: int, seed: int) -> list[str]:
    """Seeded random words; prompts differ from their first words on, so a prefix cache
    shares nothing between them."""
    rng = random.Random(seed)
    prompts, openings = [], set()
    for _ in range(num_requests):
        for _attempt in range(100):
            words = rng.choices(WORDS, k=prompt_words)
            if tuple(words[:3]) not in openings:
                break
        openings.add(tuple(words[:3]))
        prompts.append(" ".join(words))
    return prompts


def api_root(base_url: str) -> str:
    root = base_url.rstrip("/")
    return root if root.endswith("/v1") else f"{root}/v1"


def request_body(options: BenchOptions, model: str, prompt: str) -> tuple[str, dict]:
    body: dict = {"model": model, "max_tokens": options.max_tokens,
                  "temperature": options.temperature, "stream": True,
                  "stream_options": {"include_usage": True}}
    if options.ignore_eos:
        body["ignore_eos"] = True  # an extra field; vLLM, SGLang and ours honor it
    if options.service_tier is not None:
        body["service_tier"] = options.service_tier
    if options.endpoint == Endpoint.chat:
        return "/chat/completions", body | {"messages": [{"role": "user", "content": prompt}]}
    return "/completions", body | {"prompt": prompt}


def record_chunk(result: RequestResult, chunk: dict, started: float, last: float) -> float:
    """Fold one SSE chunk into `result`; returns the time of the latest content chunk."""
    if "error" in chunk:
        raise ValueError(f"error event: {chunk['error']}")
    if usage := chunk.get("usage"):
        result.output_tokens = usage.get("completion_tokens")
        result.prompt_tokens = usage.get("prompt_tokens")
    choices = chunk.get("choices") or []
    if not any(c.get("text") or (c.get("delta") or {}).get("content") for c in choices):
        return last  # a role opening, a usage chunk, a bare finish_reason
    now = time.perf_counter()
    if result.ttft_s is None:
        result.ttft_s = now - started
    else:
        result.itl_s.append(now - last)
    result.num_chunks += 1
    return now


async def stream_one(client: sse_client.Client, url: str, body: dict,
                     timeout_s: float) -> RequestResult:
    result = RequestResult()
    started = last = time.perf_counter()

    def on_event(data: bytes) -> bool:
        nonlocal last
        if data == b"[DONE]":
            result.done = True
            return True
        last = record_chunk(result, msgspec.json.decode(data), started, last)
        return False

    try:
        await client.request("POST", url, body=msgspec.json.encode(body),
                             headers={"Content-Type": "application/json"},
                             on_event=on_event, timeout_s=timeout_s)
    except sse_client.HttpError as error:
        result.error = str(error)
        return result
    result.e2e_s = time.perf_counter() - started
    # a finished reply may hold no text (a stop string at once, a lone partial
    # character): it completed, with no first token to time
    result.ok = result.done or result.ttft_s is not None
    if not result.ok:
        result.error = "the stream ended without [DONE] or a content chunk"
    return result


async def send_one(client: sse_client.Client, url: str, body: dict, timeout_s: float,
                   gate: asyncio.Semaphore) -> RequestResult:
    try:
        async with gate:
            return await stream_one(client, url, body, timeout_s)
    except Exception as error:  # a benchmark counts failures; it does not stop for them
        return RequestResult(error=f"{type(error).__name__}: {error}")


async def first_model(client: sse_client.Client, root: str) -> str:
    try:
        reply = await client.request("GET", f"{root}/models", timeout_s=30.0)
        return msgspec.json.decode(reply)["data"][0]["id"]
    except (OSError, sse_client.HttpError, ValueError, KeyError, IndexError) as error:
        raise ConfigError(f"no model given and GET /v1/models failed: {error}") from error


async def run_bench_async(options: BenchOptions) -> dict:
    prompts = make_prompts(options.num_requests, options.prompt_words, options.seed)
    arrivals = random.Random(options.seed + 1)
    gate = asyncio.Semaphore(options.concurrency or options.num_requests)
    headers = {"Authorization": f"Bearer {options.api_key}"} if options.api_key else {}
    root = api_root(options.base_url)
    client = sse_client.Client(headers)
    try:
        model = options.model or await first_model(client, root)
        started = time.perf_counter()
        tasks = []
        for prompt in prompts:
            path, body = request_body(options, model, prompt)
            tasks.append(asyncio.create_task(
                send_one(client, root + path, body, options.timeout_s, gate)))
            if math.isfinite(options.request_rate):
                await asyncio.sleep(arrivals.expovariate(options.request_rate))
        results = await asyncio.gather(*tasks)
        duration_s = time.perf_counter() - started
    finally:
        client.close()
    return summarize(options, model, results, duration_s)


def run_bench(options: BenchOptions) -> dict:
    return run_loop(run_bench_async(options))  # a lean client: it shares the machine


def describe_ms(values_s: list[float]) -> dict[str, float | None]:
    if not values_s:
        return {"mean": None} | {f"p{p}": None for p in PERCENTILES}
    values_ms = [value * 1000 for value in values_s]
    # "inclusive" interpolates between closest ranks, as numpy's default does;
    # Python 3.11 wants two points at least
    cuts = statistics.quantiles(values_ms * (2 if len(values_ms) == 1 else 1), n=100,
                                method="inclusive")
    return {"mean": statistics.fmean(values_ms)} | {f"p{p}": cuts[p - 1] for p in PERCENTILES}


def options_record(options: BenchOptions) -> dict:
    """The options as plain JSON: no Infinity, no secret."""
    rate = options.request_rate if math.isfinite(options.request_rate) else "inf"
    return asdict(options) | {"endpoint": str(options.endpoint), "request_rate": rate,
                              "api_key": "***" if options.api_key else None}


def summarize(options: BenchOptions, model: str, results: list[RequestResult],
              duration_s: float) -> dict:
    done = [result for result in results if result.ok]
    output_tokens = sum(result.num_output_tokens for result in done)
    timed = [result for result in done if result.ttft_s is not None]
    tpots = [(r.e2e_s - r.ttft_s) / (r.num_output_tokens - 1)
             for r in timed if r.num_output_tokens > 1]
    prompt_tokens = [r.prompt_tokens for r in done if r.prompt_tokens is not None]
    return {
        "options": options_record(options),
        "model": model,
        "completed": len(done),
        "failed": len(results) - len(done),
        "errors": sorted({result.error for result in results if result.error})[:10],
        "duration_s": duration_s,
        "total_input_tokens": sum(prompt_tokens) if prompt_tokens else None,
        "total_output_tokens": output_tokens,
        "request_throughput": len(done) / duration_s,
        "output_throughput": output_tokens / duration_s,
        "ttft_ms": describe_ms([result.ttft_s for result in timed]),
        "tpot_ms": describe_ms(tpots),
        "itl_ms": describe_ms([gap for result in done for gap in result.itl_s]),
        "e2e_ms": describe_ms([result.e2e_s for result in done]),
    }


def report_table(summary: dict) -> Table:
    table = Table(title=f"Serving benchmark: {summary['model']}", show_header=True)
    for column in ("metric", "mean", *(f"p{p}" for p in PERCENTILES)):
        table.add_column(column, justify="right" if column != "metric" else "left")
    for label, value in (
        ("successful requests", f"{summary['completed']}"),
        ("failed requests", f"{summary['failed']}"),
        ("duration (s)", f"{summary['duration_s']:.2f}"),
        ("request throughput (req/s)", f"{summary['request_throughput']:.2f}"),
        ("output throughput (tok/s)", f"{summary['output_throughput']:.1f}"),
        ("total output tokens", f"{summary['total_output_tokens']}"),
    ):
        table.add_row(label, value, "", "", "")
    table.add_section()
    for metric in METRICS:
        stats = summary[f"{metric}_ms"]
        table.add_row(f"{metric.upper()} (ms)", *(
            "-" if stats[key] is None else f"{stats[key]:.1f}"
            for key in ("mean", *(f"p{p}" for p in PERCENTILES))))
    return table


BaseUrl = Annotated[str, typer.Option(help="Server URL, with or without /v1.")]
NumRequests = Annotated[int, typer.Option(help="Requests to send.")]
Concurrency = Annotated[int | None, typer.Option(help="Requests in flight at most.")]
RequestRate = Annotated[float, typer.Option(help="Poisson rate, req/s; inf: all at once.")]
PromptWords = Annotated[int, typer.Option(help="Random words per prompt.")]
MaxTokens = Annotated[int, typer.Option(help="Output tokens per request.")]
IgnoreEos = Annotated[bool, typer.Option(help="Send ignore_eos: true.")]
EndpointOpt = Annotated[Endpoint, typer.Option(help="Which OpenAI endpoint to load.")]
ModelOpt = Annotated[str | None, typer.Option(help="Default: first of GET /v1/models.")]
ApiKey = Annotated[str | None, typer.Option(help="Sent as 'Authorization: Bearer KEY'.")]
Seed = Annotated[int, typer.Option(help="Seed for the prompts and the arrival times.")]
JsonPath = Annotated[Path | None, typer.Option("--json", help="Write the results here.")]
ServiceTierOpt = Annotated[str | None, typer.Option(
    help="Send this service_tier (auto, default, flex, priority).")]


def bench_command(
    base_url: BaseUrl = "http://127.0.0.1:8000", num_requests: NumRequests = 64,
    concurrency: Concurrency = None, request_rate: RequestRate = math.inf,
    prompt_words: PromptWords = 24, max_tokens: MaxTokens = 64, ignore_eos: IgnoreEos = False,
    endpoint: EndpointOpt = Endpoint.completions, model: ModelOpt = None,
    api_key: ApiKey = None, seed: Seed = 0, json_path: JsonPath = None,
    service_tier: ServiceTierOpt = None,
) -> None:
    """Benchmark an OpenAI-compatible server: throughput and TTFT/TPOT/ITL/E2E latency."""
    options = BenchOptions(
        base_url=base_url, num_requests=num_requests, concurrency=concurrency,
        request_rate=request_rate, prompt_words=prompt_words, max_tokens=max_tokens,
        ignore_eos=ignore_eos, endpoint=endpoint, model=model, api_key=api_key, seed=seed,
        service_tier=service_tier)
    console = Console()
    try:
        summary = run_bench(options)
    except ConfigError as error:
        console.print(f"[red]{error.detail}[/red]")
        raise typer.Exit(1) from error
    console.print(report_table(summary))
    for error in summary["errors"]:
        console.print(f"[yellow]failure:[/yellow] {error}")
    if json_path is not None:
        json_path.write_text(json.dumps(summary, indent=2))
