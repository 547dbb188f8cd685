"""The `pipeline` command as an operator runs it: `status` against the session's
real tier, bad settings refused in one line, and logs as JSON lines (an
access log's too)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import uuid

import httpx
import redis

from pipeline.cli import build_config, child_env
from pipeline.status import live_workers
from pipeline.streams import SCHEDULERS, Keys


def pipeline(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipeline.cli", *args],
                          capture_output=True, text=True, timeout=60)


def status(*args: str) -> subprocess.CompletedProcess:
    return pipeline("status", *args)


def test_status_shows_every_live_worker_by_role_and_the_queue(tier):
    ids = {w["role"]: w["id"] for w in live_workers(tier.redis_url, tier.prefix)}
    shown = status("--redis-url", tier.redis_url, "--prefix", tier.prefix)
    assert shown.returncode == 0, shown.stderr
    assert f"tier {tier.prefix!r}:" in shown.stdout and "requests queued" in shown.stdout
    assert "no live" not in shown.stdout
    for role, worker_id in ids.items():
        assert role in shown.stdout and worker_id in shown.stdout
    assert "engines and caches" in shown.stdout  # the scheduler's kernels
    assert re.search(r"Redis \d+\.\d+\.\d+ \(master\): \S+ used \(no limit\), \d+ clients",
                     shown.stdout), shown.stdout

    found = json.loads(status("--redis-url", tier.redis_url, "--prefix", tier.prefix,
                              "--json").stdout)
    assert found["prefix"] == tier.prefix and found["queued_requests"] == 0
    assert found["queued_by_tier"] == {"priority": 0, "default": 0, "flex": 0}
    assert {w["role"]: w["id"] for w in found["workers"]} == ids
    [scheduler] = [w for w in found["workers"] if w["role"] == "scheduler"]
    assert scheduler["num_blocks"] > 0 and "4bit_matmul" in scheduler


def test_status_says_which_roles_are_missing_and_when_redis_is_unreachable(tier):
    empty = status("--redis-url", tier.redis_url, "--prefix", "status-no-such-tier")
    assert empty.returncode == 0
    assert "0 requests queued" in empty.stdout
    for role in ("api", "scheduler", "detokenizer"):
        assert f"no live {role}" in empty.stdout
    down = status("--redis-url", "redis://127.0.0.1:1/0")
    assert down.returncode == 1 and "cannot reach Redis" in down.stdout


def test_status_counts_each_service_tiers_queue(tier):
    prefix = f"status-tiers-{uuid.uuid4().hex[:8]}"
    client = redis.Redis.from_url(tier.redis_url)
    lane = Keys(prefix).lane("flex")
    try:
        client.xgroup_create(lane, SCHEDULERS, id="0", mkstream=True)
        for _ in range(2):
            client.xadd(lane, {"m": b"queued"})
        shown = status("--redis-url", tier.redis_url, "--prefix", prefix)
        assert "2 requests queued (2 flex)" in shown.stdout, shown.stdout
    finally:
        client.delete(lane)
        client.close()


def test_serve_hands_its_api_options_to_the_workers_it_starts():
    options = {"allowed_origins": "https://a.example, *", "served_model_name": "a,b",
               "api_key": "k1,k2:flex", "access_log": True, "grammar_timeout_s": 2.5,
               "response_ttl_s": 60.0}
    config = build_config(redis_url="", prefix="p", model="m", host="h", port=1,
                          max_running_requests=None, max_batch_tokens=None, kv_cache_mb=None,
                          dtype="auto", quantization="auto", activations="auto", device="cpu",
                          num_threads=1, cuda_graph_max_batch=1, request_timeout=1.0,
                          max_queued_requests=1, alive_ttl_s=1.0, stream_interval=1, **options)
    assert config.api.allowed_origins == ("https://a.example", "*")
    env = child_env(config, "redis://r", "info", 1, "text")
    assert env["PIPELINE_ALLOWED_ORIGINS"] == "https://a.example,*"
    assert env["PIPELINE_SERVED_MODEL_NAME"] == "a,b" and env["PIPELINE_API_KEY"] == "k1,k2:flex"
    assert env["PIPELINE_ACCESS_LOG"] == "true"
    assert config.scheduler.grammar_timeout_s == 2.5 and env["PIPELINE_GRAMMAR_TIMEOUT"] == "2.5"
    assert config.api.response_ttl_s == 60.0 and env["PIPELINE_RESPONSE_TTL_S"] == "60.0"


def test_bad_settings_are_one_line_and_exit_2_not_a_traceback(tmp_path):
    for args, words in [
        (("serve", "--model", str(tmp_path / "nowhere")), "unknown model"),
        (("worker", "--role", "scheduler", "--model", str(tmp_path)), "no config.json"),
        (("worker", "--role", "api", "--api-workers", "2", "--id", "x"), "--id names one"),
        (("worker", "--role", "api", "--served-model-name", " , "), "needs a name"),
    ]:
        refused = pipeline(*args)
        assert refused.returncode == 2, (args, refused.stderr)
        assert refused.stderr.startswith("error: ") and words in refused.stderr
        assert "Traceback" not in refused.stderr + refused.stdout


def test_every_command_s_help_lists_its_options_as_written():
    """--help prints each option's text as it is (brackets in a URL's syntax are not
    markup to render: `[/db]` once made `worker --help` a traceback)."""
    for command, option in [("serve", "--redis-url"), ("worker", "--role"),
                            ("status", "--json"), ("bench", "--concurrency")]:
        shown = pipeline(command, "--help")
        assert shown.returncode == 0, (command, shown.stderr)
        assert option in shown.stdout and "Traceback" not in shown.stdout + shown.stderr
    assert "/service[/db]" in "".join(pipeline("worker", "--help").stdout.split())


def _stderr_lines(*args: str, count: int) -> list[str]:
    """The first `count` lines a `pipeline` command writes to stderr (it is then
    stopped, if it has not ended)."""
    proc = subprocess.Popen([sys.executable, "-m", "pipeline.cli", *args],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        return [line for line in (proc.stderr.readline() for _ in range(count)) if line]
    finally:
        proc.kill()
        proc.wait()


def test_json_logs_are_one_object_a_line_uvicorn_s_too(tier, prefix):
    """--log-format json: a worker waiting for Redis, and an api whose port is
    taken (uvicorn's own error), each write JSON objects with the same fields.
    That api is on a prefix of its own: killed, it leaves a liveness key for a
    TTL, which the session tier's worker counts must not see."""
    waiting = _stderr_lines("worker", "--role", "detokenizer", "--log-format", "json",
                            "--redis-url", "redis://127.0.0.1:1/0", count=2)
    port = tier.base_url.rsplit(":", 1)[1]
    refused = _stderr_lines("worker", "--role", "api", "--log-format", "json", "--port", port,
                            "--redis-url", tier.redis_url, "--prefix", prefix, count=1)
    records = [json.loads(line) for line in waiting + refused]
    assert len(records) == 3
    assert all(set(r) >= {"time", "level", "logger", "pid", "message"} for r in records)
    assert "Redis unavailable" in records[0]["message"] and records[0]["level"] == "WARNING"
    assert records[2]["logger"].startswith("uvicorn") and "address already in use" in (
        records[2]["message"].lower())


def test_an_access_log_records_each_request(tier):
    """--access-log with --log-format json: uvicorn's record of each request,
    method, path and status in its message and its request id beside them, as a
    JSON line in the api's log (and --allowed-origins answers a browser's preflight)."""
    with tier.extra_api(**{"access-log": True, "log-format": "json",
                           "allowed-origins": "https://app.example"}) as (url, proc):
        preflight = httpx.options(f"{url}/v1/completions", timeout=10, headers={
            "Origin": "https://app.example", "Access-Control-Request-Method": "POST"})
        assert preflight.headers["access-control-allow-origin"] == "https://app.example"
        body = {"prompt": "Hello", "max_tokens": 2}
        completed = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert completed.status_code == 200
        missing = httpx.get(f"{url}/v1/models/nope", headers={"x-request-id": "gw-42"},
                            timeout=10)
        assert missing.status_code == 404
    records = [json.loads(line) for p in tier.log_dir.glob("api-*.log")
               for line in p.read_text().splitlines() if line.startswith("{")]
    access = {r["message"].split('"')[1]: r for r in records
              if r["logger"] == "uvicorn.access" and r["pid"] == proc.pid}
    posted, got = access["POST /v1/completions HTTP/1.1"], access["GET /v1/models/nope HTTP/1.1"]
    assert posted["message"].endswith(" 200") and got["message"].endswith(" 404"), access
    # each record names its request, as its response's x-request-id did
    assert posted["request_id"] == completed.headers["x-request-id"]
    assert got["request_id"] == "gw-42"
