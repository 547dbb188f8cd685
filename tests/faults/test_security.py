"""Security: each role runs with only its documented ACL, and an API key
guards every route but health."""

from __future__ import annotations

import json
import signal

import httpx
import pytest
import redis

from pipeline.acl import acl_lines


def test_every_role_serves_with_only_its_documented_acl(own_redis7, make_tier):
    admin = own_redis7.client()
    tier = make_tier(own_redis7.url)
    for line in acl_lines(tier.prefix, "s3cret"):
        admin.execute_command(*line.split())
    as_role = {role: f"redis://pipeline-{role}:s3cret@127.0.0.1:{own_redis7.port}/0"
               for role in ("api", "scheduler", "detokenizer")}
    tier.start("scheduler", **{"redis-url": as_role["scheduler"]})
    tier.start("detokenizer", **{"redis-url": as_role["detokenizer"]})
    url = tier.start_api(**{"redis-url": as_role["api"]})
    tier.wait_ready()
    body = {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}
    assert httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code == 200
    # a stored response (Responses API), fetched and continued
    stored = httpx.post(f"{url}/v1/responses", timeout=60,
                        json={"input": "Hi", "max_output_tokens": 2}).json()
    assert httpx.get(f"{url}/v1/responses/{stored['id']}", timeout=10).status_code == 200
    assert httpx.post(f"{url}/v1/responses", timeout=60, json={
        "input": "Hi", "max_output_tokens": 2, "previous_response_id": stored["id"]},
    ).status_code == 200
    # a streamed background response: its events kept in Redis and read again
    with httpx.stream("POST", f"{url}/v1/responses", timeout=60, json={
            "input": "Hi", "max_output_tokens": 2, "background": True, "stream": True}) as sent:
        streamed = b"".join(sent.iter_bytes()).decode()
    created = json.loads(streamed.split("data: ", 1)[1].split("\n", 1)[0])
    replayed = httpx.get(f"{url}/v1/responses/{created['response']['id']}?stream=true",
                         timeout=60)
    assert "response.incomplete" in streamed and replayed.text == streamed
    assert httpx.get(f"{url}/health_generate", timeout=60).status_code == 200
    # /metrics reads every worker's liveness record with the api's own user
    metrics = httpx.get(f"{url}/metrics", timeout=10).text.splitlines()
    assert "pipeline_redis_up 1.0" in metrics
    assert 'pipeline_workers{role="scheduler"} 1.0' in metrics
    api_user = redis.Redis.from_url(as_role["api"])
    with pytest.raises(redis.exceptions.NoPermissionError):
        api_user.xrange(f"{tier.prefix}:tokens")
    with pytest.raises(redis.exceptions.NoPermissionError):
        api_user.get("some-other-tenant:key")
    # a drain (SIGTERM) leaves the tier with those grants too
    workers = {proc.args[proc.args.index("--role") + 1]: proc for proc in tier.procs}
    for role in ("scheduler", "detokenizer"):
        workers[role].send_signal(signal.SIGTERM)
        assert workers[role].wait(timeout=30) == 0
    roles = [line for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines()
             if line.startswith("pipeline_workers{")]
    assert roles == ['pipeline_workers{role="api"} 1.0']  # both gone at once, not a TTL later


def test_an_api_key_guards_every_route_but_health(redis_url, make_tier):
    tier = make_tier(redis_url)
    tier.start("scheduler")
    tier.start("detokenizer")
    url = tier.start_api(**{"api-key": "k-123"})
    tier.wait_ready()
    body = {"prompt": "Hi", "max_tokens": 2}
    assert httpx.get(f"{url}/health").status_code == 200
    denied = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert denied.status_code == 401 and denied.json()["error"]["code"] == "unauthorized"
    assert httpx.get(f"{url}/v1/models").status_code == 401
    wrong = httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401
    ok = httpx.post(f"{url}/v1/completions", json=body, timeout=60,
                    headers={"Authorization": "Bearer k-123"})
    assert ok.status_code == 200
