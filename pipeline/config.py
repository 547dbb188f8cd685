"""The one frozen settings object, a section per role. Built only by
`pipeline.cli` from options and `PIPELINE_*` variables; copied per process
with `dataclasses.replace`."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from pipeline.models import DEFAULT_MODEL


@dataclass(frozen=True)
class RedisConfig:
    url: str = "redis://127.0.0.1:6379/0"
    prefix: str = "pipeline"
    heartbeat_s: float = 1.0  # liveness keys refreshed this often
    alive_ttl_s: float = 5.0  # a worker silent this long is dead
    read_block_ms: int = 1000  # keep well under the socket timeout (redis-py 8 pitfall)
    max_stream_len: int = 100_000  # approximate trim target for streams nobody pends on


@dataclass(frozen=True)
class ApiConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    frontend_id: str | None = None  # None: a fresh random id per process
    api_key: str | None = None
    # the names requests may give the model, the first the one /v1/models and
    # responses show; (): the model's own (--model's)
    served_model_names: tuple[str, ...] = ()
    access_log: bool = False  # a record for every HTTP request (uvicorn's, at info)
    allowed_origins: tuple[str, ...] = ()  # CORS: pages that may call the api; ("*",): any
    max_queued_requests: int = 1024  # unadmitted requests before 503
    request_timeout_s: float = 600.0
    # how long a stored Responses API response is kept (api/responses_store.py); 0: none
    response_ttl_s: float = 3600.0
    max_body_bytes: int = 4 * 1024 * 1024
    max_n: int = 8
    stream_interval: int = 1  # tokens a streamed delta carries; 1: each as it is made
    # where --api-workers' processes keep their Prometheus metrics for /metrics to
    # merge (set by pipeline.roles.run_api); None: one process, metrics in memory
    metrics_dir: str | None = None


@dataclass(frozen=True)
class SchedulerConfig:
    scheduler_id: str | None = None
    # None: sized for the device the engine lands on (`sized`)
    max_running_requests: int | None = None
    max_batch_tokens: int | None = None  # per-step token budget: chunked prefill
    kv_cache_mb: int | None = None  # KV memory budget; sets the number of blocks
    block_size: int = 16
    dtype: str = "auto"  # auto | bfloat16 | float32 | float16
    # auto: on the CPU, unless dtype is float32, small batches read 4- or 8-bit
    # weights where the checkpoint is exactly that already (a Q4_1/Q8_0 GGUF)
    # | int4: quantize any checkpoint to 4 bits | none
    quantization: str = "auto"
    # auto: where a 4- or 8-bit weight runs fastest on int8 activations (AVX-512
    # VNNI without AMX, or AVX2 alone; beside AMX, steps of up to 10 rows), each
    # row is rounded to 8 bits per group of 32 for it, as llama.cpp runs a GGUF;
    # an explicit float32 dtype keeps them exact | exact: activations stay in
    # dtype | int8: on every row
    activations: str = "auto"
    device: str = "auto"  # auto | cpu | cuda
    attention_backend: str = "auto"  # auto | torch | flashinfer
    # int8: 8-bit keys and values, each with a scale per token and head (the CPU with
    # AVX2) | model: the model's dtype (bf16 or fp32 on the CPU) | auto: int8 for a
    # bf16 model where it runs, bf16 for an fp32 one on int8 activations, else model
    kv_cache_dtype: str = "auto"
    # decode steps of up to this many sequences replay CUDA graphs (flashinfer on
    # CUDA; capped by max_running_requests); 0: every step runs eagerly
    cuda_graph_max_batch: int = 256
    num_threads: int | None = None  # torch intra-op threads; None: torch's default
    # a structured request's grammar compiles within this, from its compile's start
    # (workers/scheduler/compiling.py); past it the request is refused, a 400
    grammar_timeout_s: float = 10.0


# A 2-core CPU runs ~40 ms steps of 64 sequences; a GPU batches 256 (the H200's
# served C=256 gave 1.8x C=64's tok/s) and prefills 256 short prompts in one step
CPU_SIZES = {"max_running_requests": 64, "max_batch_tokens": 512, "kv_cache_mb": 512}
GPU_SIZES = {"max_running_requests": 256, "max_batch_tokens": 8192}
GPU_KV_SHARE = 0.5  # of the GPU memory free once the weights are loaded


def sized(config: SchedulerConfig, device_type: str, free_mb: int = 0) -> SchedulerConfig:
    """`config` with the sizes left unset filled in for its device; on CUDA the KV
    cache takes GPU_KV_SHARE of `free_mb`, the rest stays for activations and graphs."""
    defaults = dict(CPU_SIZES)
    if device_type == "cuda":
        defaults |= GPU_SIZES | {"kv_cache_mb": max(1, int(free_mb * GPU_KV_SHARE))}
    return replace(config, **{name: value for name, value in defaults.items()
                              if getattr(config, name) is None})


@dataclass(frozen=True)
class DetokenizerConfig:
    detokenizer_id: str | None = None


@dataclass(frozen=True)
class Config:
    model: str = DEFAULT_MODEL
    redis: RedisConfig = field(default_factory=RedisConfig)
    api: ApiConfig = field(default_factory=ApiConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    detokenizer: DetokenizerConfig = field(default_factory=DetokenizerConfig)
    # on SIGTERM, how long a scheduler finishes its running requests (then hands the
    # rest to its peers) and an api keeps streaming its in-flight responses
    drain_timeout_s: float = 20.0
