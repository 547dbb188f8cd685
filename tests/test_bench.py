# The bench client against a real HTTP server: a tiny OpenAI-compatible peer, run by
# uvicorn in a thread, that streams a known number of chunks with known delays.

from __future__ import annotations

import asyncio
import itertools
import json
import socket
import threading
import time

import pytest
import typer
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from typer.testing import CliRunner

from pipeline import sse_client
from pipeline.bench import (
    BenchOptions,
    Endpoint,
    bench_command,
    make_prompts,
    run_bench,
)
from pipeline.sse_client import sse_data
from tests.harness import load_bench_script

NUM_CHUNKS = 5
TOKENS_PER_CHUNK = 2  # what the peer's usage claims, so usage and chunk counts differ
FIRST_DELAY_S = 0.2
GAP_S = 0.05
PROMPT_TOKENS = 7
BODY = {"model": "peer", "prompt": "hi", "stream": True,
        "stream_options": {"include_usage": True}}


def sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


async def peer_chunks(is_chat: bool, with_usage: bool):
    for index in range(NUM_CHUNKS):
        await asyncio.sleep(FIRST_DELAY_S if index == 0 else GAP_S)
        choice = {"index": 0, "delta": {"content": f"w{index}"}} if is_chat else {
            "index": 0, "text": f"w{index}"}
        yield sse({"object": "chunk", "choices": [choice]})
    if with_usage:
        usage = {"prompt_tokens": PROMPT_TOKENS,
                 "completion_tokens": NUM_CHUNKS * TOKENS_PER_CHUNK}
        yield sse({"object": "chunk", "choices": [], "usage": usage})
    yield sse("[DONE]")


async def peer_awkward(model: str):
    """"split": each event's bytes in three writes; "cut": the connection drops
    mid-stream; "hang": nothing for longer than any test's timeout."""
    if model == "hang":
        await asyncio.sleep(30)
    for index in range(NUM_CHUNKS):
        event = sse({"object": "chunk", "choices": [{"index": 0, "text": f"w{index}"}]})
        if model == "cut" and index == 2:
            raise RuntimeError("the peer dies mid-stream")
        for piece in (event[:3], event[3:-1], event[-1:]):
            yield piece
            await asyncio.sleep(0.01)
    yield sse("[DONE]")


async def peer_empty():
    """A chat reply of one token and no text (a stop string at once, say)."""
    yield sse({"object": "chunk", "choices": [{"index": 0, "delta": {"role": "assistant",
                                                                   "content": ""}}]})
    yield sse({"object": "chunk", "choices": [{"index": 0, "delta": {"content": ""},
                                               "finish_reason": "stop"}]})
    yield sse({"object": "chunk", "choices": [],
               "usage": {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": 1}})
    yield sse("[DONE]")


def peer_app() -> FastAPI:
    """Model "peer" reports usage; "no-usage" does not; "flaky" fails every other
    request; "split", "cut" and "hang" stream awkwardly (peer_awkward); "empty"
    answers with no text (peer_empty)."""
    app = FastAPI()
    numbers = itertools.count()
    app.state.clients = []  # (host, port) of each request: which connection carried it
    app.state.tiers = []  # each request's service_tier, if it sent one

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "peer", "object": "model"}]}

    async def generate(request: Request, is_chat: bool):
        app.state.clients.append((request.client.host, request.client.port))
        body = await request.json()
        app.state.tiers.append(body.get("service_tier"))
        if body["model"] in ("split", "cut", "hang"):
            return StreamingResponse(peer_awkward(body["model"]), media_type="text/event-stream")
        if body["model"] == "empty":
            return StreamingResponse(peer_empty(), media_type="text/event-stream")
        if body["model"] == "flaky" and next(numbers) % 2 == 1:
            return JSONResponse({"error": {"message": "boom"}}, status_code=500)
        with_usage = body["model"] != "no-usage" and body["stream_options"]["include_usage"]
        return StreamingResponse(peer_chunks(is_chat, with_usage),
                                 media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(request, is_chat=False)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await generate(request, is_chat=True)

    return app


def serve_peer(app: FastAPI, **config):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", **config))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    server.should_exit = True
    thread.join(timeout=5)
    sock.close()


@pytest.fixture(scope="module")
def shared_peer():
    return peer_app()


@pytest.fixture(scope="module")
def peer_url(shared_peer):
    yield from serve_peer(shared_peer)


def test_prompts_are_reproducible_and_differ_from_their_first_words():
    prompts = make_prompts(64, 24, seed=0)
    assert prompts == make_prompts(64, 24, seed=0)
    assert prompts != make_prompts(64, 24, seed=1)
    assert all(len(prompt.split()) == 24 for prompt in prompts)
    assert len({tuple(prompt.split()[:3]) for prompt in prompts}) == 64


def test_serving_bench_levels_share_no_prompt_opening():
    """No level in any round (nor the warm-up) reuses another's prompts: our
    prefix cache would serve their first blocks, and transformers has none."""
    sb = load_bench_script("serving_bench")
    for levels in (sb.LEVELS, sb.GPU_LEVELS):
        assert_no_shared_opening(sb, levels)


def test_host_cpu_idle_is_the_share_of_cpu_time_nothing_ran_in():
    import psutil

    sb = load_bench_script("serving_bench")
    before = psutil.cpu_times()
    later = before._replace(user=before.user + 3.0, idle=before.idle + 0.5,
                            iowait=before.iowait + 0.5)
    assert sb.idle_share(before, later) == pytest.approx(0.25)
    # guest time is counted in user time already: not twice
    assert sb.idle_share(before, later._replace(guest=before.guest + 2.0)) == pytest.approx(0.25)
    assert sb.idle_share(before, before) is None
    # on this host, around a second of one core spinning: that core's time at least was used
    start, spun = psutil.cpu_times(), time.perf_counter() + 1.0
    while time.perf_counter() < spun:
        pass
    assert 0.0 <= sb.idle_share(start, psutil.cpu_times()) <= 1.0 - 0.8 / psutil.cpu_count()
    assert 0.0 <= sb.host_idle_now(0.2) <= 1.0


def assert_no_shared_opening(sb, levels: dict[int, int]) -> None:
    runs = [make_prompts(n, sb.PROMPT_WORDS, sb.level_seed(level, round_))
            for level, n in levels.items() for round_ in range(sb.ROUNDS)]
    runs.append(make_prompts(4, sb.PROMPT_WORDS, sb.SEED + 99))
    openings = [tuple(prompt.split()[:3]) for run in runs for prompt in run]
    assert len(set(openings)) == len(openings)


def test_sse_data_joins_data_lines_and_skips_the_rest():
    assert sse_data(b'data: {"a": 1}') == b'{"a": 1}'
    assert sse_data(b"event: ping\ndata: one\ndata: two") == b"one\ntwo"
    assert sse_data(b": a comment") == b""


def test_bench_counts_tokens_from_usage_and_times_the_first_token(peer_url):
    summary = run_bench(BenchOptions(base_url=peer_url, num_requests=4, concurrency=2,
                                     max_tokens=NUM_CHUNKS * TOKENS_PER_CHUNK))
    assert summary["model"] == "peer"  # discovered from GET /v1/models
    assert (summary["completed"], summary["failed"]) == (4, 0)
    assert summary["total_output_tokens"] == 4 * NUM_CHUNKS * TOKENS_PER_CHUNK
    assert summary["total_input_tokens"] == 4 * PROMPT_TOKENS
    assert summary["ttft_ms"]["p50"] >= FIRST_DELAY_S * 1000
    assert summary["itl_ms"]["p50"] >= GAP_S * 1000 / 2
    assert summary["tpot_ms"]["mean"] < summary["itl_ms"]["mean"]  # two tokens per chunk
    assert summary["e2e_ms"]["p99"] >= (FIRST_DELAY_S + (NUM_CHUNKS - 1) * GAP_S) * 1000


def test_bench_counts_content_chunks_when_the_server_sends_no_usage(peer_url):
    summary = run_bench(BenchOptions(base_url=f"{peer_url}/v1", num_requests=3,
                                     model="no-usage", endpoint=Endpoint.chat))
    assert summary["completed"] == 3
    assert summary["total_output_tokens"] == 3 * NUM_CHUNKS
    assert summary["total_input_tokens"] is None


def test_a_finished_reply_with_no_text_is_completed_but_not_timed(peer_url):
    summary = run_bench(BenchOptions(base_url=peer_url, num_requests=3, model="empty",
                                     endpoint=Endpoint.chat))
    assert (summary["completed"], summary["failed"]) == (3, 0), summary["errors"]
    assert summary["total_output_tokens"] == 3
    assert summary["ttft_ms"]["p50"] is None and summary["itl_ms"]["p50"] is None
    assert summary["e2e_ms"]["p50"] > 0


def test_bench_counts_server_errors_as_failed_requests(peer_url):
    summary = run_bench(BenchOptions(base_url=peer_url, num_requests=6, concurrency=1,
                                     model="flaky"))
    assert (summary["completed"], summary["failed"]) == (3, 3)
    assert summary["total_output_tokens"] == 3 * NUM_CHUNKS * TOKENS_PER_CHUNK
    assert any(error.startswith("HTTP 500") for error in summary["errors"])


def test_events_split_across_reads_are_each_counted_once(peer_url):
    summary = run_bench(BenchOptions(base_url=peer_url, num_requests=2, model="split"))
    assert (summary["completed"], summary["failed"]) == (2, 0)
    assert summary["total_output_tokens"] == 2 * NUM_CHUNKS


def test_a_stream_cut_short_or_stalled_past_the_timeout_is_a_failure(peer_url):
    cut = run_bench(BenchOptions(base_url=peer_url, num_requests=2, model="cut"))
    assert (cut["completed"], cut["failed"]) == (0, 2)
    assert any("ConnectionError" in error for error in cut["errors"]), cut["errors"]
    started = time.monotonic()
    hung = run_bench(BenchOptions(base_url=peer_url, num_requests=2, model="hang",
                                  timeout_s=0.5))
    assert (hung["completed"], hung["failed"]) == (0, 2)
    assert any("TimeoutError" in error for error in hung["errors"]), hung["errors"]
    assert time.monotonic() - started < 5


def test_requests_reuse_keep_alive_connections(shared_peer, peer_url):
    shared_peer.state.clients.clear()
    summary = run_bench(BenchOptions(base_url=peer_url, num_requests=8, concurrency=2))
    assert summary["completed"] == 8
    assert len(shared_peer.state.clients) == 8
    assert len(set(shared_peer.state.clients)) <= 2  # one connection per stream in flight


@pytest.fixture
def brief_peer():
    """A peer that closes a connection idle for 0.2 s."""
    app = peer_app()
    for url in serve_peer(app, timeout_keep_alive=0.2):
        yield app, url


def test_a_connection_the_server_dropped_while_idle_is_not_reused(brief_peer):
    app, url = brief_peer

    async def twice() -> None:
        client = sse_client.Client()
        try:
            for _ in range(2):
                await client.request("POST", f"{url}/v1/completions",
                                     body=json.dumps(BODY).encode(),
                                     headers={"Content-Type": "application/json"},
                                     on_event=lambda data: data == b"[DONE]", timeout_s=10)
                await asyncio.sleep(0.6)  # past the peer's keep-alive
        finally:
            client.close()

    asyncio.run(twice())
    assert len(app.state.clients) == 2
    assert len(set(app.state.clients)) == 2  # the second request came on a new connection


def test_bench_counts_an_unreachable_server_as_failures_not_a_crash():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"  # bound, never listening
        summary = run_bench(BenchOptions(base_url=url, num_requests=2, model="peer"))
    assert (summary["completed"], summary["failed"]) == (0, 2)
    assert summary["ttft_ms"]["p50"] is None


def test_bench_command_writes_json_with_the_documented_keys(peer_url, tmp_path):
    app = typer.Typer()
    app.command("bench")(bench_command)
    path = tmp_path / "bench.json"
    result = CliRunner().invoke(app, ["--base-url", peer_url, "--num-requests", "3",
                                      "--request-rate", "20", "--ignore-eos",
                                      "--json", str(path)])
    assert result.exit_code == 0, result.output
    assert "TTFT" in result.output
    summary = json.loads(path.read_text())
    assert set(summary) == {
        "options", "model", "completed", "failed", "errors", "duration_s",
        "total_input_tokens", "total_output_tokens", "request_throughput",
        "output_throughput", "ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"}
    assert set(summary["itl_ms"]) == {"mean", "p50", "p90", "p99"}
    assert summary["options"]["ignore_eos"] is True
    assert summary["options"]["request_rate"] == 20


def test_tier_cpu_finds_a_tiers_processes_and_splits_the_scheduler(tier):
    """bench/tier_cpu.py beside the real tier: every role found by its command
    line, the scheduler's event loop apart from its engine, every part's CPU
    moving forward over a run."""
    tc = load_bench_script("tier_cpu")
    found = tc.tier_processes()
    ours = {proc.pid for procs in found.values() for proc in procs}
    assert {proc.pid for proc in tier.procs} <= ours
    before = tc.cpu_times(found)
    assert {"api", "scheduler loop", "scheduler engine", "detokenizer",
            "bench client"} <= before.keys()
    result = run_bench(BenchOptions(base_url=tier.base_url, num_requests=4, concurrency=4,
                                    max_tokens=8, ignore_eos=True))
    assert result["failed"] == 0
    after = tc.cpu_times(found)
    assert sum(after["scheduler engine"]) > sum(before["scheduler engine"])
    assert all(sum(after[part]) >= sum(before[part]) for part in before)


def test_bench_sends_the_service_tier_it_is_given(shared_peer, peer_url):
    shared_peer.state.tiers.clear()
    run_bench(BenchOptions(base_url=peer_url, num_requests=2, service_tier="flex"))
    run_bench(BenchOptions(base_url=peer_url, num_requests=1))
    assert shared_peer.state.tiers == ["flex", "flex", None]
