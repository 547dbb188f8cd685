"""Roles as separate processes the way users run them: several api workers
sharing one scheduler and detokenizer, and `pipeline serve` on the embedded Redis."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
import uuid

import httpx
import psutil

from tests.harness import Tier, free_port, load_bench_script, worker_env


async def _ask(client: httpx.AsyncClient, base_url: str, i: int) -> tuple[str, str, dict]:
    body = {"prompt": f"Count from {i} to {i + 5}:", "max_tokens": 12, "temperature": 0}
    response = await client.post(f"{base_url}/v1/completions", json=body, timeout=300)
    assert response.status_code == 200, response.text
    return base_url, response.headers["x-pipeline-frontend"], response.json()


def test_three_api_workers_share_one_scheduler_and_each_answers_its_own(redis_url, tmp_path):
    tier = Tier(redis_url, f"test-{uuid.uuid4().hex[:10]}", tmp_path)
    try:
        tier.start("scheduler")
        tier.start("detokenizer")
        urls = [tier.start_api() for _ in range(3)]
        tier.wait_ready()

        async def main():
            async with httpx.AsyncClient() as client:
                return await asyncio.gather(*(_ask(client, urls[i % 3], i) for i in range(30)))

        results = asyncio.run(main())
        frontends = {url: {fid for u, fid, _ in results if u == url} for url in urls}
        assert all(len(ids) == 1 for ids in frontends.values())  # one frontend per process
        assert len({next(iter(ids)) for ids in frontends.values()}) == 3
        # same prompt through any worker gives the same greedy text
        by_prompt = {}
        for _, _, body in results:
            assert body["choices"][0]["finish_reason"] in ("length", "stop")
            assert body["usage"]["completion_tokens"] >= 1
        for i, (_, _, body) in enumerate(results):
            by_prompt.setdefault(i, body["choices"][0]["text"])
        assert all(text for text in by_prompt.values())
    finally:
        tier.stop()


def _tree(pid: int) -> list[int]:
    try:
        parent = psutil.Process(pid)
        return [pid] + [p.pid for p in parent.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def test_pipeline_serve_answers_on_embedded_redis_and_drains_and_leaves_nothing_on_sigterm(
        tmp_path):
    port = free_port()
    env = worker_env() | {"PIPELINE_LOG_LEVEL": "warning", "PIPELINE_DTYPE": "float32"}
    log = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "pipeline.cli", "serve", "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=log, env=env, text=True)
    try:
        line = proc.stdout.readline()  # printed once every role is up
        assert f"127.0.0.1:{port}" in line, (tmp_path / "serve.log").read_text()
        # the benches read what the scheduler chose through the Redis the line names
        kernels = load_bench_script("serving_bench").tier_kernels(line)
        assert kernels["dtype"] == "float32" and "4bit_matmul" in kernels
        tree = _tree(proc.pid)
        assert len(tree) >= 5  # serve, redis, api, scheduler, detokenizer
        body = {"messages": [{"role": "user", "content": "What is the capital of France?"}],
                "temperature": 0, "max_tokens": 16}
        response = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body,
                              timeout=120)
        assert response.status_code == 200
        assert "Paris" in response.json()["choices"][0]["message"]["content"]
        # SIGTERM mid-stream: every role drains, so the stream still ends whole
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", timeout=120,
                          json={"prompt": "Once upon a time", "max_tokens": 96,
                                "ignore_eos": True, "stream": True}) as stream:
            lines = stream.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            proc.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]" and '"finish_reason":"length"' in rest[-2]
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    time.sleep(0.5)
    assert [pid for pid in tree if psutil.pid_exists(pid) and
            psutil.Process(pid).status() != psutil.STATUS_ZOMBIE] == []
