# The Engine: one scheduler's model, KV cache and batch. Each step is
# schedule (Batcher, torch-free) -> run (model forward + sampling) ->
# postprocess (append tokens, finish, free blocks).

from __future__ import annotations

import itertools
import random
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from pipeline.config import SchedulerConfig, sized
from pipeline.errors import ConfigError, ContextLengthExceeded, InvalidRequest
from pipeline.messages import Sampling, TokenLogprob
from pipeline.streams import TIERS
from workers.scheduler.attention import (
    bytes_per_block,
    choose_backend,
    kv_dtype,
    make_backend,
    make_cache,
)
from workers.scheduler.batcher import Batcher, StepPlan
from workers.scheduler.blocks import BlockAllocator
from workers.scheduler.calibrate import choose_kernels, cpu_dtype
from workers.scheduler.cuda_graphs import DecodeGraphs
from workers.scheduler.grammar import Grammars
from workers.scheduler.layers import Driver
from workers.scheduler.model import LlamaModel, read_spec
from workers.scheduler.pace import Pace, StepRecord
from workers.scheduler.sampler import Sampled, Sampler, plain_greedy, prompt_logprobs_of
from workers.scheduler.sequence import DEFAULT_RANK, Sequence

PROMPT_ROWS = 256  # prompt logprobs' logits made at a time


@dataclass
class EngineRequest:
    request_id: str
    prompt_ids: list[int]
    output_ids: list[int]  # already delivered: they count toward max_tokens and seed positions
    sampling: Sampling
    rank: int = DEFAULT_RANK  # its service tier's: 0 the most urgent (pipeline.streams.TIERS)


@dataclass
class StepResult:
    request_id: str
    new_ids: list[int]
    finish: str | None  # "stop" | "length" | None
    logprobs: list[TokenLogprob] | None
    # with a run's first token, where Sampling.prompt_logprobs asked: the prompt's
    # tokens from the second on, each under the logits before it
    prompt_logprobs: list[TokenLogprob] | None = None
    cached_tokens: int = 0  # prompt tokens its admission found in the prefix cache


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_blocks: int
    num_preemptions: int
    num_prefix_hit_tokens: int
    kv_cache_bytes: int  # what the cache's tensors hold
    kv_budget_bytes: int  # --kv-cache-mb: the cache never exceeds it
    # the steps of the last pace.WINDOW_S seconds (None where there were none)
    recent_steps: int
    step_ms_p50: float | None
    rows_per_step: float | None
    output_tokens_per_s: float | None
    busy: float | None  # the share of those steps' span spent stepping


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device, quantized: bool = True,
                  activations: str = "auto") -> torch.dtype:
    """`quantized`, `activations`: whether the 4-bit path may run, and on int8
    activations (calibrate.cpu_dtype)."""
    if name == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return cpu_dtype(quantized, activations)
    dtypes = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}
    if name not in dtypes:
        raise ConfigError(f"unknown dtype {name!r}: one of auto, {', '.join(dtypes)}")
    return dtypes[name]


def resolve_quantization(name: str, device: torch.device, dtype_name: str,
                         fp32_kernel: bool = False) -> str:
    """make_linear's mode. The 4-bit kernels are the CPU's. An explicit float32
    promises fp32 numerics throughout, which only qgemm keeps (`fp32_kernel`:
    fp32 activations on the checkpoint's exact weights, or int8 ones asked for
    by name); torch's takes bf16."""
    if name not in ("auto", "int4", "none"):
        raise ConfigError(f"unknown quantization {name!r}: one of auto, int4, none")
    if name == "none":
        return name
    if device.type != "cpu":
        if name == "int4":
            raise ConfigError("quantization int4 runs on the CPU only")
        return "none"
    if name == "auto":
        exact = dtype_name in ("auto", "bfloat16") or fp32_kernel
        return "lossless" if exact else "none"
    return name


def graph_batch_size(config: SchedulerConfig, device: torch.device, backend: str) -> int:
    """The largest decode batch replayed from a CUDA graph; 0: none (off, not
    CUDA, or not flashinfer, whose fixed-buffer decode the graphs capture)."""
    if device.type != "cuda" or backend != "flashinfer":
        return 0
    return max(0, min(config.cuda_graph_max_batch, config.max_running_requests))


class Engine:
    def __init__(self, model_path: Path, config: SchedulerConfig):
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.device = resolve_device(config.device)
        # an explicit float32 keeps fp32 activations unless int8 is asked for by name
        activations = ("exact" if config.dtype == "float32" and config.activations == "auto"
                       else config.activations)
        self.dtype = resolve_dtype(config.dtype, self.device, config.quantization != "none",
                                   activations)
        spec = read_spec(Path(model_path))
        self.kernels = choose_kernels(self.device, self.dtype, spec,
                                      config.quantization != "none", activations)
        self.quantization = resolve_quantization(config.quantization, self.device, config.dtype,
                                                 self.kernels.qgemm or self.kernels.vnni)
        if self.quantization == "none":
            self.kernels = replace(self.kernels, qgemm=False, vnni=False)
        self.model = LlamaModel.load(Path(model_path), spec, self.device, self.dtype,
                                     self.quantization, self.kernels)
        free_mb = (torch.cuda.mem_get_info(self.device)[0] // 2**20
                   if self.device.type == "cuda" else 0)
        self.config = config = sized(config, self.device.type, free_mb)
        self.model.warm(config.max_batch_tokens)
        self.backend = backend = choose_backend(config.attention_backend, self.device)
        int8_activations = self.kernels.vnni  # its int8 kernels run (VNNI's or AVX2's)
        per_block = bytes_per_block(spec.num_layers, config.block_size, spec.num_kv_heads,
                                    spec.head_dim, kv_dtype(backend, self.dtype, self.device,
                                                            config.kv_cache_dtype, spec.head_dim,
                                                            int8_activations))
        num_blocks = config.kv_cache_mb * 2**20 // per_block
        graph_batch = graph_batch_size(config, self.device, backend)
        usable = num_blocks - (1 if graph_batch else 0)  # graphs' padding rows write to one
        if usable < 2:
            raise ConfigError(f"kv_cache_mb={config.kv_cache_mb} holds under two KV blocks")
        self.cache = make_cache(backend, spec.num_layers, num_blocks, config.block_size,
                                spec.num_kv_heads, spec.head_dim, self.dtype, self.device,
                                config.kv_cache_dtype, int8_activations)
        self.attention = make_backend(backend, self.cache, spec, self.device)
        self.model.driver = Driver.build(self.model, self.attention)
        self.graphs = self._capture(graph_batch, usable) if graph_batch else None
        self.allocator = BlockAllocator(usable, config.block_size)
        self.batcher = Batcher(self.allocator, config.max_running_requests,
                               config.max_batch_tokens)
        self.sampler = Sampler()
        self.eos_token_ids = spec.eos_token_ids
        self.grammars = Grammars(model_path, self.model.embed.shape[0], list(spec.eos_token_ids))
        self.max_context = min(spec.max_position, usable * config.block_size)
        self.arrivals = itertools.count()
        self.done_on_arrival: list[StepResult] = []  # nothing left to generate
        self.pace = Pace()

    def _capture(self, max_batch: int, scratch_block: int) -> DecodeGraphs:
        try:
            return DecodeGraphs(self.model, self.attention, max_batch, scratch_block)
        except RuntimeError as error:  # torch.cuda.OutOfMemoryError is one too
            raise ConfigError(f"capturing CUDA graphs for decode batches of up to {max_batch} "
                              f"failed ({error}); --cuda-graph-max-batch 0 runs every step "
                              "eagerly") from error

    def can_admit(self) -> list[int]:
        """How many more requests of each service tier (TIERS' order) to take in
        (Batcher.room)."""
        return self.batcher.room(len(TIERS))

    def add(self, request: EngineRequest) -> None:
        sampling = request.sampling
        num_tokens = len(request.prompt_ids) + len(request.output_ids)
        remaining = max(0, sampling.max_tokens - len(request.output_ids))
        if num_tokens + remaining > self.max_context:
            raise ContextLengthExceeded(
                f"{num_tokens} tokens plus {remaining} to generate exceed the context of "
                f"{self.max_context} tokens", param="max_tokens")
        ids = [*request.prompt_ids, *request.output_ids]
        if ids and not 0 <= min(ids) <= max(ids) < self.model.embed.shape[0]:
            # the step's embeddings are copied by C (layers.c): no index check there
            raise InvalidRequest(f"token ids must be in [0, {self.model.embed.shape[0]})")
        if remaining == 0:
            self.done_on_arrival.append(StepResult(request.request_id, [], "length", None))
            return
        stop_ids = set(sampling.stop_token_ids) | (set() if sampling.ignore_eos
                                                   else set(self.eos_token_ids))
        seed = random.getrandbits(63) if sampling.seed is None else sampling.seed % 2**63
        # a continuation's client has them already
        wants_prompt = sampling.prompt_logprobs is not None and not request.output_ids
        grammar = (None if sampling.structure is None else
                   self.grammars.matcher(sampling.structure, request.output_ids))
        self.batcher.add(Sequence(
            request.request_id, list(request.prompt_ids) + list(request.output_ids),
            len(request.prompt_ids), sampling, seed, next(self.arrivals),
            stop_ids=frozenset(stop_ids), prompt_logprobs=[] if wants_prompt else None,
            grammar=grammar, rank=request.rank))

    def abort(self, request_id: str) -> bool:
        for result in self.done_on_arrival:
            if result.request_id == request_id:
                self.done_on_arrival.remove(result)
                return True
        return self.batcher.abort(request_id) is not None

    def has_work(self) -> bool:
        return bool(self.batcher.running or self.batcher.waiting or self.done_on_arrival)

    def step(self) -> list[StepResult]:
        results, self.done_on_arrival = self.done_on_arrival, []
        plan = self.batcher.schedule()
        if copies := self.allocator.take_copies():  # before any of the step's KV is written
            self.cache.copy(copies)
        if not plan.chunks:
            return results
        started = time.perf_counter()
        stepped = self.postprocess(plan, self.run(plan))
        self.pace.record(StepRecord(started, time.perf_counter(), plan.num_tokens, len(stepped)))
        return results + stepped

    @torch.inference_mode()
    def run(self, plan: StepPlan) -> Sampled:
        tables = [self.allocator.block_table(c.seq.request_id) for c in plan.chunks]
        seqs = [c.seq for c in plan.chunks if c.samples]
        if self.graphs is not None and self.graphs.takes(plan):
            return self.sampler(self.graphs.run(plan, tables), seqs)
        rows, prompt_rows = sampling_rows(plan), prompt_logprob_rows(plan)
        if prompt_rows:  # rows ascending, as the model's gather takes them
            wanted = sorted(rows + [row for row, _, _ in prompt_rows])
            both = self.head_input(plan, tables, wanted)
            index = {row: i for i, row in enumerate(wanted)}
            self.keep_prompt_logprobs(both[[index[row] for row, _, _ in prompt_rows]],
                                      prompt_rows)
            head_input = both[[index[row] for row in rows]]
        else:
            head_input = self.head_input(plan, tables, rows)
        # greedy picks with nothing else asked of the logits: the lm_head's
        # kernel keeps each row's best as it goes, where it can (linear.Dense.greedy)
        if plain_greedy(seqs) and (picks := self.model.lm_head.greedy(head_input)) is not None:
            return Sampled(picks.tolist(), [None] * len(seqs))
        return self.sampler(self.model.lm_head.logits(head_input), seqs)

    def forward(self, plan: StepPlan, tables: list[list[int]]) -> torch.Tensor:
        """The step run eagerly: logits of the chunks that sample."""
        return self.model.lm_head.logits(self.head_input(plan, tables, sampling_rows(plan)))

    def head_input(self, plan: StepPlan, tables: list[list[int]], rows: list[int]) -> torch.Tensor:
        """The step run eagerly up to the lm_head, for `rows` (ascending) of its tokens."""
        self.attention.prepare(plan, tables, self.device)
        device = self.device
        return self.model.head_input(
            torch.tensor(plan.input_ids(), dtype=torch.long, device=device),
            torch.tensor(plan.positions(), dtype=torch.long, device=device),
            torch.tensor(rows, dtype=torch.long, device=device), self.attention)

    def keep_prompt_logprobs(self, head_input: torch.Tensor,
                             rows: list[tuple[int, Sequence, int]]) -> None:
        """Each prompt row's logprob of the token after it, added to its sequence's;
        the logits made PROMPT_ROWS rows at a time (a long prompt's are 200 KB a row)."""
        for start in range(0, len(rows), PROMPT_ROWS):
            part = rows[start:start + PROMPT_ROWS]
            logits = self.model.lm_head.logits(head_input[start:start + len(part)])
            targets = [seq.token_ids[position + 1] for _, seq, position in part]
            counts = [seq.sampling.prompt_logprobs or 0 for _, seq, _ in part]
            for (_, seq, _), logprob in zip(part, prompt_logprobs_of(logits, targets, counts),
                                            strict=True):
                seq.prompt_logprobs.append(logprob)

    def postprocess(self, plan: StepPlan, sampled: Sampled) -> list[StepResult]:
        results = []
        picks = iter(zip(sampled.token_ids, sampled.logprobs, strict=True))
        for chunk in plan.chunks:
            seq = chunk.seq
            seq.num_computed += chunk.num_tokens
            self.allocator.cache_full_blocks(seq.request_id, seq.token_ids, seq.num_computed)
            if not chunk.samples:
                continue
            token_id, logprobs = next(picks)
            seq.token_ids.append(token_id)
            finish = seq.finish_reason(self.max_context)
            if seq.grammar is not None:
                seq.grammar.accept_token(token_id)
                if finish is None and seq.grammar.is_terminated():  # its stop token (ignore_eos)
                    finish = "stop"
            if finish is not None:
                self.batcher.finish(seq)
            prompt_logprobs, seq.prompt_logprobs = seq.prompt_logprobs, None  # sent once
            results.append(StepResult(seq.request_id, [token_id], finish, logprobs,
                                      prompt_logprobs, seq.num_cached_tokens))
        return results

    def describe(self) -> dict:
        """What this engine runs on, for its liveness record (`pipeline status`)."""
        return {"device": self.device.type, "dtype": str(self.dtype).removeprefix("torch."),
                "attention": self.backend,
                "kv_cache_dtype": str(self.cache.dtype).removeprefix("torch."),
                "cuda_graphs": self.graphs.sizes[-1] if self.graphs else 0,
                "quantization": self.quantization,
                "dense_matmul": ("amx" if self.kernels.dense_tiles
                                 else "onednn" if self.kernels.onednn else "torch"),
                **self.kernels.names()}

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.batcher.running), num_waiting=len(self.batcher.waiting),
            num_free_blocks=self.allocator.num_free_blocks, num_blocks=self.allocator.num_blocks,
            num_preemptions=self.batcher.num_preemptions,
            num_prefix_hit_tokens=self.batcher.num_prefix_hit_tokens,
            kv_cache_bytes=self.cache.nbytes, kv_budget_bytes=self.config.kv_cache_mb * 2**20,
            **self.pace.summary(time.perf_counter()))


def sampling_rows(plan: StepPlan) -> list[int]:
    """The step's rows whose logits pick a token: each sampling chunk's last."""
    ends = itertools.accumulate(c.num_tokens for c in plan.chunks)
    return [end - 1 for end, c in zip(ends, plan.chunks, strict=True) if c.samples]


def prompt_logprob_rows(plan: StepPlan) -> list[tuple[int, Sequence, int]]:
    """(row, sequence, position) of each token in the step whose logits give the
    logprob of the prompt token after it, for sequences that collect them."""
    rows, start = [], 0
    for chunk in plan.chunks:
        seq = chunk.seq
        if seq.collects_prompt:
            last = min(chunk.start + chunk.num_tokens, seq.num_prompt_tokens - 1)
            rows += [(start + p - chunk.start, seq, p) for p in range(chunk.start, last)]
        start += chunk.num_tokens
    return rows
