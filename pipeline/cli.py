"""The `pipeline` command: the only place that reads argv and the environment.

    pipeline serve                  every role + an embedded Redis on one machine
    pipeline worker --role ROLE     exactly one role, against any Redis
    pipeline status                 who is alive, and their load
"""

from __future__ import annotations

import enum
import os
from dataclasses import replace
from typing import Annotated

import typer

from pipeline import logs
from pipeline.bench import bench_command
from pipeline.config import ApiConfig, Config, RedisConfig, SchedulerConfig
from pipeline.errors import ConfigError
from pipeline.models import DEFAULT_MODEL

app = typer.Typer(add_completion=False, no_args_is_help=True, rich_markup_mode=None,
                  help="An LLM serving tier whose every hop is a Redis stream.")


class Role(enum.StrEnum):
    api = "api"
    scheduler = "scheduler"
    detokenizer = "detokenizer"


def _opt(envvar: str, help: str, **kwargs) -> typer.models.OptionInfo:
    return typer.Option(envvar=f"PIPELINE_{envvar}", help=help, **kwargs)


def _redis_url(url: str | None) -> str | None:
    """A Sentinel or cluster URL that lacks its parts is a usage error, not a crash."""
    from pipeline.redis_cluster import cluster_url
    from pipeline.redis_url import sentinel_url

    try:
        sentinel_url(url or "")
        cluster_url(url or "")
    except ValueError as error:
        raise typer.BadParameter(str(error)) from None
    return url


def _check_prefix(url: str | None, prefix: str) -> None:
    """On a Redis Cluster, a prefix without a hash tag is a usage error."""
    from pipeline.redis_cluster import cluster_url, tier_slot

    if url and cluster_url(url) is not None:
        try:
            tier_slot(prefix)
        except ValueError as error:
            raise typer.BadParameter(str(error), param_hint="--prefix") from None


RedisUrl = Annotated[str | None, _opt(
    "REDIS_URL", "redis://, rediss:// or unix:// URL, with auth (redis://user:pass@host:6379/0); "
    "Sentinel's, redis+sentinel://[user:pass@]host:26379[,host:port...]/service[/db]; or a "
    "cluster's, redis+cluster://[user:pass@]host:port[,host:port...] (--prefix with a hash "
    "tag: '{pipeline}'). rediss+sentinel:// and rediss+cluster:// for TLS, which any "
    "rediss scheme configures in its query: ?ssl_ca_certs=CA.crt&ssl_certfile=...&"
    "ssl_keyfile=...&ssl_cert_reqs=required&ssl_check_hostname=true.",
    callback=_redis_url)]
Prefix = Annotated[str, _opt("PREFIX", "Key prefix shared by every worker of one tier.")]
Model = Annotated[str, _opt("MODEL", f"A local HF model directory, or {DEFAULT_MODEL}.")]
Host = Annotated[str, _opt("HOST", "Address the api listens on.")]
Port = Annotated[int, _opt("PORT", "Port the api listens on.")]
ApiKey = Annotated[str | None, _opt(
    "API_KEY", "Require 'Authorization: Bearer KEY'; KEY,KEY,...: any of them (a rotation); "
    "KEY:TIER: its requests run at that service tier (priority, default, flex) or a less "
    "urgent one.")]
ServedModelName = Annotated[str | None, _opt(
    "SERVED_MODEL_NAME", "The model's name in the API (/v1/models, responses, requests' "
    "model field) instead of --model's; NAME,ALIAS,...: the first is shown, any is taken.")]
AllowedOrigins = Annotated[str | None, _opt(
    "ALLOWED_ORIGINS", "Origins a browser page may call the api from (CORS): "
    "https://a.example,https://b.example, or * for any; default none.")]
MaxRunning = Annotated[int | None, _opt("MAX_RUNNING_REQUESTS", "Requests batched per "
                                        "scheduler (default: 64 on a CPU, 256 on a GPU).")]
MaxBatchTokens = Annotated[int | None, _opt("MAX_BATCH_TOKENS", "Tokens per step (chunked "
                                            "prefill; default: 512 on a CPU, 8192 on a GPU).")]
KvCacheMb = Annotated[int | None, _opt("KV_CACHE_MB", "KV cache memory budget per scheduler, "
                                       "MiB (default: 512 on a CPU; on a GPU half the memory "
                                       "free once the weights are loaded).")]
Dtype = Annotated[str, _opt("DTYPE", "auto | bfloat16 | float32 | float16.")]
Quantization = Annotated[str, _opt("QUANTIZATION", "auto | int4 | none: 4-bit weights for small "
                                   "batches (auto: only where the checkpoint is exactly 4- or "
                                   "8-bit already, on the CPU).")]
Activations = Annotated[str, _opt("ACTIVATIONS", "auto | exact | int8: what a 4- or 8-bit weight "
                                 "multiplies (int8: rows rounded to 8 bits per group of 32, "
                                 "as llama.cpp runs a GGUF; auto: int8 where that is the "
                                 "fastest kernel on this CPU).")]
Device = Annotated[str, _opt("DEVICE", "auto | cpu | cuda.")]
KvCacheDtype = Annotated[str, _opt("KV_CACHE_DTYPE", "auto | model | int8: the KV cache's dtype "
                                   "(int8: keys and values rounded to 8 bits per token and "
                                   "head, half of bf16's memory, on a CPU with AVX2; "
                                   "model: the model's; auto: int8 for a bf16 model where it "
                                   "runs, bf16 for an fp32 model on int8 activations (a CPU "
                                   "with AVX2 alone), else model).")]
Threads = Annotated[int | None, _opt("NUM_THREADS", "torch threads per scheduler.")]
CudaGraphs = Annotated[int, _opt("CUDA_GRAPH_MAX_BATCH", "On CUDA with flashinfer, decode steps "
                                 "of up to this many requests replay CUDA graphs; 0: off.")]
ResponseTtl = Annotated[float, _opt(
    "RESPONSE_TTL_S", "Seconds a stored Responses API response is kept in Redis (its "
    "`store`, on by default, so that previous_response_id continues it on any api); 0 "
    "stores none.", min=0.0)]
GrammarTimeout = Annotated[float, _opt(
    "GRAMMAR_TIMEOUT", "Seconds a structured request's grammar (response_format, tools) may "
    "take to compile on a scheduler before the request is refused (a 400); the steps go on "
    "meanwhile.", min=0.1)]
Timeout = Annotated[float, _opt("REQUEST_TIMEOUT", "Seconds before a request is abandoned.")]
MaxQueued = Annotated[int, _opt("MAX_QUEUED_REQUESTS", "In-flight requests per api before 503.")]
StreamInterval = Annotated[int, _opt("STREAM_INTERVAL", "Tokens a streamed response's chunk "
                                     "carries (the last may carry fewer); more: less CPU a "
                                     "token under load, coarser streaming.", min=1)]
WorkerId = Annotated[str | None, typer.Option("--id", envvar="PIPELINE_WORKER_ID",
                                             help="Stable worker id (default: random).")]
AliveTtl = Annotated[float, _opt("ALIVE_TTL_S", "A worker silent this long is presumed dead "
                                 "and its work taken over.")]
DrainTimeout = Annotated[float, _opt("DRAIN_TIMEOUT_S", "On SIGTERM: seconds a scheduler takes "
                                     "no new requests and finishes its running ones (then "
                                     "hands the rest to other schedulers), and an api finishes "
                                     "its responses; 0: no drain. A second signal stops "
                                     "at once, as SIGINT does but to the api (uvicorn: a "
                                     "second Ctrl-C).")]
LogLevel = Annotated[str, _opt("LOG_LEVEL", "debug | info | warning | error.")]
AccessLog = Annotated[bool, _opt("ACCESS_LOG", "Log every HTTP request (api: client, method, "
                                 "path, status).")]
LogFormat = Annotated[str, _opt("LOG_FORMAT", "text | json: one JSON object a line (time, "
                                "level, logger, pid, message), for a log pipeline.")]


def build_config(*, redis_url: str, prefix: str, model: str, host: str, port: int,
                 api_key: str | None, max_running_requests: int | None,
                 max_batch_tokens: int | None, kv_cache_mb: int | None, dtype: str,
                 quantization: str, activations: str, device: str,
                 num_threads: int | None, cuda_graph_max_batch: int,
                 request_timeout: float, max_queued_requests: int,
                 alive_ttl_s: float, stream_interval: int,
                 kv_cache_dtype: str = "auto", drain_timeout_s: float = 20.0,
                 served_model_name: str | None = None, access_log: bool = False,
                 allowed_origins: str | None = None,
                 grammar_timeout_s: float = 10.0, response_ttl_s: float = 3600.0) -> Config:
    _check_prefix(redis_url, prefix)
    names = () if served_model_name is None else tuple(
        name.strip() for name in served_model_name.split(",") if name.strip())
    if served_model_name is not None and not names:
        raise ConfigError("--served-model-name needs a name")
    return Config(
        model=model, drain_timeout_s=drain_timeout_s,
        redis=RedisConfig(url=redis_url, prefix=prefix, alive_ttl_s=alive_ttl_s,
                          heartbeat_s=min(1.0, alive_ttl_s / 4)),
        api=ApiConfig(host=host, port=port, api_key=api_key, request_timeout_s=request_timeout,
                      max_queued_requests=max_queued_requests, stream_interval=stream_interval,
                      served_model_names=names, access_log=access_log,
                      allowed_origins=_listed(allowed_origins), response_ttl_s=response_ttl_s),
        scheduler=SchedulerConfig(max_running_requests=max_running_requests,
                                  max_batch_tokens=max_batch_tokens, kv_cache_mb=kv_cache_mb,
                                  dtype=dtype, quantization=quantization,
                                  activations=activations, device=device, num_threads=num_threads,
                                  cuda_graph_max_batch=cuda_graph_max_batch,
                                  kv_cache_dtype=kv_cache_dtype,
                                  grammar_timeout_s=grammar_timeout_s),
    )


def _listed(text: str | None) -> tuple[str, ...]:
    """A comma-separated option's items, blanks dropped."""
    return tuple(item.strip() for item in (text or "").split(",") if item.strip())


def child_env(config: Config, redis_url: str, log_level: str, api_workers: int,
              log_format: str) -> dict[str, str]:
    """The PIPELINE_* variables that make `pipeline worker` rebuild `config`."""
    values = {
        "REDIS_URL": redis_url, "PREFIX": config.redis.prefix, "MODEL": config.model,
        "HOST": config.api.host, "PORT": config.api.port, "API_KEY": config.api.api_key,
        "SERVED_MODEL_NAME": ",".join(config.api.served_model_names) or None,
        "ACCESS_LOG": "true" if config.api.access_log else None,
        "ALLOWED_ORIGINS": ",".join(config.api.allowed_origins) or None,
        "API_WORKERS": api_workers,
        "MAX_RUNNING_REQUESTS": config.scheduler.max_running_requests,
        "MAX_BATCH_TOKENS": config.scheduler.max_batch_tokens,
        "KV_CACHE_MB": config.scheduler.kv_cache_mb, "DTYPE": config.scheduler.dtype,
        "KV_CACHE_DTYPE": config.scheduler.kv_cache_dtype,
        "QUANTIZATION": config.scheduler.quantization,
        "ACTIVATIONS": config.scheduler.activations,
        "DEVICE": config.scheduler.device, "NUM_THREADS": config.scheduler.num_threads,
        "CUDA_GRAPH_MAX_BATCH": config.scheduler.cuda_graph_max_batch,
        "GRAMMAR_TIMEOUT": config.scheduler.grammar_timeout_s,
        "REQUEST_TIMEOUT": config.api.request_timeout_s,
        "RESPONSE_TTL_S": config.api.response_ttl_s,
        "MAX_QUEUED_REQUESTS": config.api.max_queued_requests, "LOG_LEVEL": log_level,
        "LOG_FORMAT": log_format,
        "STREAM_INTERVAL": config.api.stream_interval,
        "ALIVE_TTL_S": config.redis.alive_ttl_s, "DRAIN_TIMEOUT_S": config.drain_timeout_s,
    }
    return {f"PIPELINE_{name}": str(value) for name, value in values.items() if value is not None}


@app.command()
def serve(
    port: Port = 8000, host: Host = "127.0.0.1", redis_url: RedisUrl = None,
    prefix: Prefix = "pipeline", model: Model = DEFAULT_MODEL,
    api_workers: Annotated[int, _opt("API_WORKERS", "api worker processes.")] = 1,
    schedulers: Annotated[int, _opt("SCHEDULERS", "Scheduler processes.")] = 1,
    detokenizers: Annotated[int, _opt("DETOKENIZERS", "Detokenizer processes.")] = 1,
    api_key: ApiKey = None, served_model_name: ServedModelName = None,
    max_running_requests: MaxRunning = None,
    max_batch_tokens: MaxBatchTokens = None, kv_cache_mb: KvCacheMb = None, dtype: Dtype = "auto",
    kv_cache_dtype: KvCacheDtype = "auto",
    quantization: Quantization = "auto", activations: Activations = "auto",
    device: Device = "auto", num_threads: Threads = None, cuda_graph_max_batch: CudaGraphs = 256,
    grammar_timeout: GrammarTimeout = 10.0,
    request_timeout: Timeout = 600.0, response_ttl_s: ResponseTtl = 3600.0,
    max_queued_requests: MaxQueued = 1024, alive_ttl_s: AliveTtl = 5.0,
    stream_interval: StreamInterval = 1, drain_timeout_s: DrainTimeout = 20.0,
    log_level: LogLevel = "info", log_format: LogFormat = "text", access_log: AccessLog = False,
    allowed_origins: AllowedOrigins = None,
) -> None:
    """Run every role as its own process, plus an embedded Redis when no URL is given."""
    from pipeline.supervisor import serve_forever

    logs.setup(log_level, log_format)
    if num_threads is None:
        # the cores shared among the schedulers. (Leaving one to the api and detokenizer
        # looked faster only while engine steps ran on varying threads, which ignore
        # set_num_threads. On one engine thread, 2 cores, all of them vs one: 38 vs 31
        # tok/s at concurrency 1, 126 vs 104 at 16, 228 vs 193 at 64.)
        num_threads = max(1, len(os.sched_getaffinity(0)) // schedulers)
    config = build_config(
        redis_url=redis_url or "", prefix=prefix, model=model, host=host, port=port,
        api_key=api_key, max_running_requests=max_running_requests,
        max_batch_tokens=max_batch_tokens, kv_cache_mb=kv_cache_mb, dtype=dtype,
        quantization=quantization, activations=activations, device=device,
        num_threads=num_threads, cuda_graph_max_batch=cuda_graph_max_batch,
        kv_cache_dtype=kv_cache_dtype,
        request_timeout=request_timeout,
        max_queued_requests=max_queued_requests, alive_ttl_s=alive_ttl_s,
        stream_interval=stream_interval, drain_timeout_s=drain_timeout_s,
        served_model_name=served_model_name, access_log=access_log,
        allowed_origins=allowed_origins, grammar_timeout_s=grammar_timeout,
        response_ttl_s=response_ttl_s)
    counts = {"api": api_workers, "scheduler": schedulers, "detokenizer": detokenizers}
    raise typer.Exit(serve_forever(config, counts, lambda url: child_env(
        config, url, log_level, api_workers, log_format)))


@app.command()
def worker(
    role: Annotated[Role, typer.Option(envvar="PIPELINE_ROLE", help="Which role to run.")],
    redis_url: RedisUrl = "redis://127.0.0.1:6379/0", prefix: Prefix = "pipeline",
    model: Model = DEFAULT_MODEL, port: Port = 8000, host: Host = "127.0.0.1",
    worker_id: WorkerId = None,
    api_workers: Annotated[int, _opt("API_WORKERS", "uvicorn worker processes (api).")] = 1,
    api_key: ApiKey = None, served_model_name: ServedModelName = None,
    max_running_requests: MaxRunning = None,
    max_batch_tokens: MaxBatchTokens = None, kv_cache_mb: KvCacheMb = None, dtype: Dtype = "auto",
    kv_cache_dtype: KvCacheDtype = "auto",
    quantization: Quantization = "auto", activations: Activations = "auto",
    device: Device = "auto", num_threads: Threads = None, cuda_graph_max_batch: CudaGraphs = 256,
    grammar_timeout: GrammarTimeout = 10.0,
    request_timeout: Timeout = 600.0, response_ttl_s: ResponseTtl = 3600.0,
    max_queued_requests: MaxQueued = 1024, alive_ttl_s: AliveTtl = 5.0,
    stream_interval: StreamInterval = 1, drain_timeout_s: DrainTimeout = 20.0,
    log_level: LogLevel = "info", log_format: LogFormat = "text", access_log: AccessLog = False,
    allowed_origins: AllowedOrigins = None,
) -> None:
    """Run exactly one role against a shared Redis."""
    from pipeline.roles import run_role

    logs.setup(log_level, log_format)
    config = build_config(
        redis_url=redis_url or "redis://127.0.0.1:6379/0", prefix=prefix, model=model,
        host=host, port=port, api_key=api_key, max_running_requests=max_running_requests,
        max_batch_tokens=max_batch_tokens, kv_cache_mb=kv_cache_mb, dtype=dtype,
        quantization=quantization, activations=activations, device=device,
        num_threads=num_threads, cuda_graph_max_batch=cuda_graph_max_batch,
        kv_cache_dtype=kv_cache_dtype,
        request_timeout=request_timeout,
        max_queued_requests=max_queued_requests, alive_ttl_s=alive_ttl_s,
        stream_interval=stream_interval, drain_timeout_s=drain_timeout_s,
        served_model_name=served_model_name, access_log=access_log,
        allowed_origins=allowed_origins, grammar_timeout_s=grammar_timeout,
        response_ttl_s=response_ttl_s)
    config = _with_worker_id(config, role, worker_id)
    run_role(role.value, config, api_workers=api_workers)


def _with_worker_id(config: Config, role: Role, worker_id: str | None) -> Config:
    if worker_id is None:
        return config
    match role:
        case Role.api:
            return replace(config, api=replace(config.api, frontend_id=worker_id))
        case Role.scheduler:
            return replace(config, scheduler=replace(config.scheduler, scheduler_id=worker_id))
        case Role.detokenizer:
            return replace(config, detokenizer=replace(config.detokenizer,
                                                       detokenizer_id=worker_id))


@app.command()
def status(redis_url: RedisUrl = "redis://127.0.0.1:6379/0", prefix: Prefix = "pipeline",
           as_json: Annotated[bool, typer.Option(
               "--json", help="One JSON object: every live worker's record.")] = False) -> None:
    """Show the live workers of a tier, their load, and the requests queued."""
    from pipeline.status import print_status

    _check_prefix(redis_url, prefix)
    raise typer.Exit(print_status(redis_url or "redis://127.0.0.1:6379/0", prefix, as_json))


@app.command()
def acl(prefix: Prefix = "pipeline",
        password: Annotated[str, typer.Option(help="Password for every role's user.")]
        = "change-me") -> None:
    """Print the ACL SETUSER lines giving each role only the keys and commands it needs."""
    from pipeline.acl import acl_lines

    for line in acl_lines(prefix, password):
        typer.echo(line)


app.command("bench")(bench_command)


def main() -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        app()
    except ConfigError as error:  # the user's settings: one line, not a traceback
        typer.echo(f"error: {error.detail}", err=True)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
