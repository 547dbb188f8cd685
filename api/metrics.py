# GET /metrics in Prometheus' text format: this api process's HTTP requests,
# generations, tokens and latencies (under --api-workers, every worker's, merged
# from their files in ApiConfig.metrics_dir), then the tier's state as the live
# workers' liveness records in Redis give it at scrape time. Torch-free.

from __future__ import annotations

import time
from collections import Counter as Tally
from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.process_collector import ProcessCollector

# a route outside these is counted as "other": a scan of random paths adds no series
ROUTES = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/models",
                    "/generate", "/tokenize", "/detokenize", "/health", "/health_generate",
                    "/metrics"})
MODEL = "/v1/models/{model}"  # one label for every id asked for
RESPONSE = "/v1/responses/{response_id}"  # a stored response's routes, its input_items too
SECONDS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
TOKEN_SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.1, 0.25, 0.5, 1.0)

# A scheduler's liveness record (Scheduler.info): field -> (metric, help, scale, is_counter)
SCHEDULER_FIELDS = {
    "num_running": ("running_requests", "Requests in the running batch", 1, False),
    "num_waiting": ("waiting_requests", "Admitted requests waiting for KV blocks or budget",
                    1, False),
    "num_free_blocks": ("kv_free_blocks", "KV cache blocks free", 1, False),
    "num_blocks": ("kv_blocks", "KV cache blocks in all", 1, False),
    "kv_cache_bytes": ("kv_cache_bytes", "Bytes the KV cache's tensors hold", 1, False),
    "num_preemptions": ("preemptions", "Sequences preempted for blocks (recomputed later)",
                        1, True),
    "num_prefix_hit_tokens": ("prefix_hit_tokens", "Prompt tokens found in the prefix cache",
                              1, True),
    "num_expired": ("expired_requests", "Requests dropped past their deadline", 1, True),
    "step_ms_p50": ("step_seconds_p50", "Median engine step time over the last 30 s",
                    0.001, False),
    "output_tokens_per_s": ("output_tokens_per_second", "Tokens made a second, last 30 s",
                            1, False),
    "busy": ("busy_ratio", "Share of the last 30 s spent in engine steps", 1, False),
}


class Metrics:
    """One api process's counters and histograms, in a registry of its own."""

    def __init__(self, multiprocess_dir: str | None = None):
        self.registry = CollectorRegistry()
        own = None if multiprocess_dir else self.registry  # files, not a registry, hold them
        if multiprocess_dir:
            MultiProcessCollector(self.registry, path=multiprocess_dir)
        else:
            ProcessCollector(registry=self.registry)
        self.http_requests = Counter(
            "pipeline_http_requests", "HTTP requests answered, by route and status code",
            ["route", "code"], registry=own)
        self.http_seconds = Histogram(
            "pipeline_http_request_duration_seconds",
            "Time from a request's arrival to its response's last byte", ["route"],
            buckets=SECONDS, registry=own)
        self.prompt_tokens = Counter("pipeline_prompt_tokens",
                                     "Prompt tokens submitted, a generation each", registry=own)
        self.generation_tokens = Counter("pipeline_generation_tokens",
                                         "Output tokens received", registry=own)
        self.generations = Counter(
            "pipeline_generations", "Generations ended, by outcome: stop, length, or the "
            "error code (timeout, cancelled, overloaded, ...)", ["outcome"], registry=own)
        self.ttft = Histogram("pipeline_time_to_first_token_seconds",
                              "Streamed generations' time from submit to the first token, "
                              "by service tier", ["service_tier"], buckets=SECONDS, registry=own)
        self.tpot = Histogram("pipeline_time_per_output_token_seconds",
                              "Streamed generations' mean time a token after the first, "
                              "by service tier", ["service_tier"], buckets=TOKEN_SECONDS,
                              registry=own)
        self.e2e = Histogram("pipeline_generation_duration_seconds",
                             "Time from submit to a generation's end, by service tier",
                             ["service_tier"], buckets=SECONDS, registry=own)
        self.resubmits = Counter("pipeline_resubmits",
                                 "Requests resubmitted after their scheduler died, a drain "
                                 "handed them back, or Redis failed over", registry=own)
        self.redis_changes = Counter("pipeline_redis_server_changes",
                                     "Times the Redis behind --redis-url was another server "
                                     "than before (a failover, or a restart)", registry=own)

    def http(self, path: str, code: int, seconds: float) -> None:
        route = (path if path in ROUTES else MODEL if path.startswith("/v1/models/")
                 else RESPONSE if path.startswith("/v1/responses/") else "other")
        self.http_requests.labels(route, str(code)).inc()
        self.http_seconds.labels(route).observe(seconds)

    def generation(self, num_prompt_tokens: int, is_streamed: bool,
                   service_tier: str = "default", counted: bool = True) -> Generation:
        """`counted` False: a probe's (/health_generate), kept out of every figure."""
        if not counted:
            return UNCOUNTED
        self.prompt_tokens.inc(num_prompt_tokens)
        return Generation(self, is_streamed, service_tier)

    def render(self, workers: list[dict] | None, queued: dict[str, int]) -> bytes:
        """The exposition text: this process's (or every worker's) metrics, then
        the tier's from `workers` (pipeline.status.records; None: Redis unreachable)
        and `queued` (service tier -> requests no scheduler has admitted yet)."""
        tier = _Snapshot(tier_families(workers, queued))
        return generate_latest(self.registry) + generate_latest(tier)


class Generation:
    """One generation's figures, observed as its deltas arrive."""

    def __init__(self, metrics: Metrics, is_streamed: bool, service_tier: str):
        self.metrics = metrics
        self.is_streamed = is_streamed  # a whole response's one delta says nothing of TTFT
        self.service_tier = service_tier
        self.start = time.perf_counter()
        self.first: float | None = None
        self.num_tokens = 0

    def delta(self, num_tokens: int) -> None:
        if num_tokens and self.first is None:
            self.first = time.perf_counter()
            if self.is_streamed:
                self.metrics.ttft.labels(self.service_tier).observe(self.first - self.start)
        self.num_tokens += num_tokens
        self.metrics.generation_tokens.inc(num_tokens)

    def end(self, outcome: str) -> None:
        now = time.perf_counter()
        self.metrics.generations.labels(outcome).inc()
        self.metrics.e2e.labels(self.service_tier).observe(now - self.start)
        if self.is_streamed and self.first is not None and self.num_tokens > 1:
            self.metrics.tpot.labels(self.service_tier).observe(
                (now - self.first) / (self.num_tokens - 1))


class _Uncounted(Generation):
    def __init__(self):
        pass

    def delta(self, num_tokens: int) -> None:
        pass

    def end(self, outcome: str) -> None:
        pass


UNCOUNTED = _Uncounted()


def tier_families(workers: list[dict] | None, queued: dict[str, int]) -> list[Metric]:
    redis_up = GaugeMetricFamily("pipeline_redis_up", "Whether this api reached Redis to "
                                 "read the tier's state", value=int(workers is not None))
    workers = workers or []
    roles = GaugeMetricFamily("pipeline_workers", "Live workers, by role", labels=["role"])
    for role, count in sorted(Tally(str(w.get("role")) for w in workers).items()):
        roles.add_metric([role], count)
    waiting = GaugeMetricFamily("pipeline_queued_requests", "Requests no scheduler has "
                                "admitted yet, tier-wide, by service tier",
                                labels=["service_tier"])
    for service_tier, count in queued.items():
        waiting.add_metric([service_tier], count)
    in_flight = GaugeMetricFamily("pipeline_api_in_flight_requests",
                                  "Requests in flight, by api frontend", labels=["frontend"])
    for worker in workers:
        if worker.get("role") == "api" and _is_number(worker.get("in_flight")):
            in_flight.add_metric([str(worker.get("id"))], worker["in_flight"])
    schedulers = [w for w in workers if w.get("role") == "scheduler"]
    return [redis_up, roles, waiting, in_flight, *_worker_families(workers),
            *_scheduler_families(schedulers)]


def _worker_families(workers: list[dict]) -> Iterable[Metric]:
    """What an operator alerts on across the tier: hosts' clocks (pipeline.clock) and
    the models the workers run (one, unless misconfigured: pipeline.model_identity)."""
    clocks = GaugeMetricFamily("pipeline_worker_clock_offset_seconds", "How far each "
                               "worker's host clock runs ahead of the Redis server's "
                               "(negative: behind)", labels=["role", "worker"])
    for worker in workers:
        if _is_number(offset := worker.get("clock_offset_s")):
            clocks.add_metric([str(worker.get("role")), str(worker.get("id"))], -offset)
    yield clocks
    fingerprints = {w["fingerprint"] for w in workers if isinstance(w.get("fingerprint"), str)}
    yield GaugeMetricFamily("pipeline_models", "Distinct models the live workers run (a "
                            "tier serves one: more is a misconfiguration)",
                            value=len(fingerprints))


def _scheduler_families(schedulers: list[dict]) -> Iterable[Metric]:
    for field, (name, text, scale, is_counter) in SCHEDULER_FIELDS.items():
        kind = CounterMetricFamily if is_counter else GaugeMetricFamily
        family = kind(f"pipeline_scheduler_{name}", text, labels=["scheduler"])
        for scheduler in schedulers:
            if _is_number(value := scheduler.get(field)):
                family.add_metric([str(scheduler.get("id"))], value * scale)
        yield family


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


class _Snapshot:
    """Families already made, as generate_latest reads a registry."""

    def __init__(self, families: list[Metric]):
        self.families = families

    def collect(self) -> list[Metric]:
        return self.families
