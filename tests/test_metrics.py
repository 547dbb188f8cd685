"""GET /metrics: the api's requests, generations, tokens and latencies as a real
tier serves them, the tier's state from Redis, merged over --api-workers."""

from __future__ import annotations

from pathlib import Path

import httpx
import psutil
from prometheus_client.parser import text_string_to_metric_families

from api.metrics import Metrics, tier_families
from pipeline.embedded_redis import EmbeddedRedis
from pipeline.status import records
from tests.test_api_validation import serving


def scrape(base_url: str, **headers) -> tuple[dict, str]:
    """{(sample name, sorted labels): value} and the frontend that answered."""
    response = httpx.get(f"{base_url}/metrics", headers=headers, timeout=10)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain")
    return samples(response.text), response.headers["x-pipeline-frontend"]


def samples(text: str) -> dict:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(found: dict, name: str, **labels) -> float:
    return found.get((name, tuple(sorted(labels.items()))), 0.0)


def test_a_tiers_requests_tokens_and_latencies_are_counted(tier):
    before, _ = scrape(tier.base_url)
    body = {"prompt": "Once upon a time", "max_tokens": 6, "ignore_eos": True}
    with httpx.Client(base_url=tier.base_url, timeout=120) as client:
        with client.stream("POST", "/v1/completions",
                           json=body | {"stream": True, "service_tier": "priority"}) as stream:
            assert stream.status_code == 200 and "[DONE]" in stream.read().decode()
        whole = client.post("/v1/completions", json=body)
        assert whole.status_code == 200
        assert client.post("/v1/completions", json=body | {"max_tokens": 0}).status_code == 400
        assert client.get("/no/such/route").status_code == 404
        assert client.post("/v1/responses", json={}).status_code == 400
        probe = client.get("/health_generate")  # a probe: no generation counted
        assert probe.status_code == 200 and probe.json()["status"] == "ok", probe.text
        for model in ("a", "b/c"):  # every id asked for counts under one route label
            assert client.get(f"/v1/models/{model}").status_code == 404
    after, _ = scrape(tier.base_url)

    def grew(name: str, **labels) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    route = "/v1/completions"
    assert grew("pipeline_http_requests_total", route=route, code="200") == 2
    assert grew("pipeline_http_requests_total", route=route, code="400") == 1
    assert grew("pipeline_http_requests_total", route="other", code="404") == 1
    assert grew("pipeline_http_requests_total", route="/v1/responses", code="400") == 1
    assert grew("pipeline_http_requests_total", route="/health_generate", code="200") == 1
    assert grew("pipeline_http_requests_total", route="/v1/models/{model}", code="404") == 2
    assert grew("pipeline_http_request_duration_seconds_count", route=route) == 3
    assert grew("pipeline_generations_total", outcome="length") == 2
    assert grew("pipeline_generation_tokens_total") == 12
    prompt_tokens = whole.json()["usage"]["prompt_tokens"]
    assert grew("pipeline_prompt_tokens_total") == 2 * prompt_tokens
    for tier_name in ("priority", "default"):  # latencies by service tier
        assert grew("pipeline_generation_duration_seconds_count", service_tier=tier_name) == 1
    # time to first token and per token: the streamed generation's alone
    assert grew("pipeline_time_to_first_token_seconds_count", service_tier="priority") == 1
    assert grew("pipeline_time_to_first_token_seconds_count", service_tier="default") == 0
    assert grew("pipeline_time_per_output_token_seconds_count", service_tier="priority") == 1
    first = grew("pipeline_time_to_first_token_seconds_sum", service_tier="priority")
    assert 0 < first < grew("pipeline_generation_duration_seconds_sum", service_tier="priority")
    assert ("pipeline_queued_requests", (("service_tier", "flex"),)) in after


def test_the_tiers_workers_and_scheduler_state_come_from_redis(tier):
    found, frontend = scrape(tier.base_url)
    assert value(found, "pipeline_redis_up") == 1
    for role in ("api", "scheduler", "detokenizer"):
        assert value(found, "pipeline_workers", role=role) == 1
    assert ("pipeline_api_in_flight_requests", (("frontend", frontend),)) in found
    [(_, labels)] = [key for key in found if key[0] == "pipeline_scheduler_kv_blocks"]
    scheduler = dict(labels)["scheduler"]
    blocks = value(found, "pipeline_scheduler_kv_blocks", scheduler=scheduler)
    free = value(found, "pipeline_scheduler_kv_free_blocks", scheduler=scheduler)
    assert blocks > 0 and 0 <= free <= blocks
    assert value(found, "pipeline_scheduler_kv_cache_bytes", scheduler=scheduler) > 0
    assert value(found, "pipeline_models") == 1  # every worker runs the one model
    offsets = {dict(labels)["role"]: found[(name, labels)] for name, labels in found
               if name == "pipeline_worker_clock_offset_seconds"}
    assert sorted(offsets) == ["api", "detokenizer", "scheduler"]
    assert all(abs(offset) < 1 for offset in offsets.values())  # one host, one clock


async def test_metrics_need_the_api_key_and_say_when_redis_is_gone(prefix, model_files):
    redis_server = EmbeddedRedis()
    url = redis_server.start()
    try:
        async with serving(url, prefix, model_files, api_key="s3cret") as client:
            assert (await client.get("/metrics")).status_code == 401
            good = {"Authorization": "Bearer s3cret"}
            up = samples((await client.get("/metrics", headers=good)).text)
            assert value(up, "pipeline_redis_up") == 1
            redis_server.stop()
            response = await client.get("/metrics", headers=good)
            assert response.status_code == 200
            down = samples(response.text)
            assert value(down, "pipeline_redis_up") == 0
            # the api's own counters still answer: the 401 and the scrape before
            assert value(down, "pipeline_http_requests_total", route="/metrics", code="401") == 1
            assert value(down, "pipeline_http_requests_total", route="/metrics", code="200") == 1
    finally:
        redis_server.stop()


def test_malformed_liveness_records_are_skipped_not_a_failed_scrape():
    found = records([b"not json", b"[1, 2]", None, b'{"role": "api", "id": "a", '
                     b'"in_flight": "many"}', b'{"role": "scheduler", "id": "s", '
                     b'"num_running": 3, "busy": null, "num_blocks": true}',
                     b'{"role": ["odd"], "num_running": 1}', b'{"role": "scheduler"}'])
    assert len(found) == 4
    by_name = {family.name: family for family in tier_families(found, {"default": 0})}
    assert [s.value for s in by_name["pipeline_api_in_flight_requests"].samples] == []
    assert [(s.labels, s.value) for s in by_name["pipeline_workers"].samples] == [
        ({"role": "['odd']"}, 1), ({"role": "api"}, 1), ({"role": "scheduler"}, 2)]
    assert [s.value for s in by_name["pipeline_scheduler_running_requests"].samples] == [3]
    assert by_name["pipeline_scheduler_busy_ratio"].samples == []
    assert by_name["pipeline_scheduler_kv_blocks"].samples == []
    text = Metrics().render(found, {"flex": 3}).decode()
    assert 'pipeline_queued_requests{service_tier="flex"} 3.0' in text.splitlines()
    assert 'pipeline_workers{role="scheduler"} 2.0' in text.splitlines()


def test_api_workers_share_their_counts_and_clean_up_after(tier):
    """Whichever of --api-workers 2 answers a scrape, it counts both workers' requests."""
    with tier.extra_api(**{"api-workers": 2}) as (base_url, proc):
        body = {"prompt": "Hello", "max_tokens": 2, "ignore_eos": True}
        frontends, sent = set(), 0
        # a fresh connection each, until both workers have answered (the second may
        # still be starting when the port first answers /health)
        while len(frontends) < 2 and sent < 60:
            response = httpx.post(f"{base_url}/v1/completions", json=body, timeout=120)
            assert response.status_code == 200
            frontends.add(response.headers["x-pipeline-frontend"])
            sent += 1
        scraped_by = set()
        for _ in range(30):
            found, frontend = scrape(base_url)
            scraped_by.add(frontend)
            assert value(found, "pipeline_generations_total", outcome="length") == sent
            assert value(found, "pipeline_workers", role="api") >= 2
            if len(scraped_by) == 2:
                break
        assert len(frontends) == 2 and len(scraped_by) == 2
        workers = psutil.Process(proc.pid).children(recursive=True)
        folders = {Path(w.environ()["PROMETHEUS_MULTIPROC_DIR"]) for w in workers
                   if "PROMETHEUS_MULTIPROC_DIR" in w.environ()}
        assert len(folders) == 1 and next(iter(folders)).is_dir()
    assert not next(iter(folders)).exists()

