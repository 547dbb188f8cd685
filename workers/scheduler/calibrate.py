# The kernels a CPU host runs, chosen by timing the candidates at startup:
# CPUs here differ too much to choose by name (bf16 matmul 2x fp32 on one host
# with avx512_bf16, 1.7x slower on another; MKL's sgemm 1.3-1.6x behind oneDNN's
# on an AMD host, and torch's bf16 matmul 1.5x behind oneDNN's on a packed weight
# on an AMD Zen 5). The timings take about a second in all.

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from pipeline.errors import ConfigError
from workers.scheduler import qgemm, qgemm_amx, qgemm_vnni
from workers.scheduler.linear import Dense, Int4, Int8, Kernels, quantize_int4, quantize_int8
from workers.scheduler.native import cpu_flags


def cpu_has_bf16() -> bool:
    return bool(cpu_flags() & {"avx512_bf16", "amx_bf16"})


def best_times(candidates: list[Callable[[], object]], reps: int = 24) -> list[float]:
    """Each candidate's best time; they alternate, so drift in the clock hits all."""
    best = [float("inf")] * len(candidates)
    with torch.inference_mode():
        for rep in range(reps):
            for i, fn in enumerate(candidates):
                start = time.perf_counter()
                fn()
                if rep >= 3:
                    best[i] = min(best[i], time.perf_counter() - start)
    return best


def cpu_dtype(quantized: bool = True, activations: str = "auto") -> torch.dtype:
    """The dtype `--dtype auto` means on this CPU: bf16 wherever our 4- and 8-bit kernels run
    every projection on bf16 activations (VNNI's int8 ones, AMX's tiles), so that
    torch's dense matmul does not decide; else the faster of torch's two. (On
    an AMD Zen 4, a startup beside a busy process timed fp32 ahead once, and
    that tier served C=64 at 0.35x the tok/s on the fp32 kernels.)"""
    if not cpu_has_bf16():
        return torch.float32
    vnni = qgemm_vnni.load() is not None and activations != "exact"
    if quantized and (vnni or qgemm_amx.load() is not None):
        return torch.bfloat16
    return faster_cpu_dtype()


def faster_cpu_dtype() -> torch.dtype:
    """bf16 where its matmul is clearly (10%) faster than fp32's."""
    x, w = torch.randn(64, 576), torch.randn(576, 1536)
    xb, wb = x.bfloat16(), w.bfloat16()
    bf16, fp32 = best_times([lambda: xb @ wb, lambda: x @ w], reps=7)
    return torch.bfloat16 if bf16 < 0.9 * fp32 else torch.float32


def onednn_takes(dtype: torch.dtype) -> bool:
    """Whether oneDNN packs a weight of `dtype` on this CPU (bf16 wants
    avx512bw, avx512vl and avx512dq, or avx_ne_convert: an AMD Zen 3 has neither)."""
    if dtype != torch.bfloat16:
        return True
    flags = cpu_flags()
    return {"avx512bw", "avx512vl", "avx512dq"} <= flags or "avx_ne_convert" in flags


def onednn_is_faster(dtype: torch.dtype, in_dim: int, out_dim: int) -> bool:
    """oneDNN on a packed weight against torch's own matmul (MKL's sgemm for
    fp32) on one of the model's projections at 32 rows."""
    if not onednn_takes(dtype):
        return False
    weight, x = torch.randn(out_dim, in_dim), torch.randn(32, in_dim, dtype=dtype)
    onednn, blas = (Dense(weight, None, dtype, Kernels(onednn=flag)) for flag in (True, False))
    onednn_s, blas_s = best_times([lambda: onednn(x), lambda: blas(x)])
    return onednn_s < 0.9 * blas_s


def qgemm_is_faster(dtype: torch.dtype, in_dim: int, out_dim: int, vocab: int = 0,
                    copies: int = 16) -> bool:
    """qgemm against torch's 4-bit kernel at 8 rows of the engine's activations,
    over `copies` 4-bit weights of one of the model's shapes and (`vocab`) an
    8-bit lm_head: more than the caches hold, as in a step, which streams its
    weights from memory. (One weight timed alone stays in cache, and there the
    two were within 0-19% of each other on a host where ours took 0.8x the
    step time.)"""
    if qgemm.load() is None:
        return False
    x = torch.randn(8, in_dim, dtype=dtype)
    layers: dict[bool, list[Dense]] = {True: [], False: []}
    for _ in range(copies):
        weight = torch.randn(out_dim, in_dim)
        levels, scales_zeros, _ = quantize_int4(weight)
        for flag, found in layers.items():
            found.append(Int4(weight, None, dtype, levels, scales_zeros, Kernels(qgemm=flag)))
    if vocab:
        weight = torch.randn(vocab, in_dim)
        levels, scale, _ = quantize_int8(weight)
        for flag, found in layers.items():
            found.append(Int8(weight, None, dtype, levels, scale, Kernels(qgemm=flag)))

    def run(found: list[Dense]) -> None:
        for layer in found:
            layer.small(x)

    ours_s, theirs_s = best_times([lambda: run(layers[True]), lambda: run(layers[False])],
                                  reps=8)
    return ours_s < 0.9 * theirs_s


def choose_kernels(device: torch.device, dtype: torch.dtype, spec,
                   quantized: bool = True, activations: str = "auto") -> Kernels:
    """`quantized`: whether a 4-bit path may run at all (else qgemm is not built);
    `activations` (auto | exact | int8): whether qgemm_vnni.c may round them."""
    if activations not in ("auto", "exact", "int8"):
        raise ConfigError(f"unknown activations {activations!r}: one of auto, exact, int8")
    int8 = device.type == "cpu" and quantized and qgemm_vnni.takes(dtype)
    if activations == "int8" and not int8:
        raise ConfigError("activations int8 needs 4- or 8-bit weights, a C compiler and a CPU "
                          "with AVX2 (fp32 or bf16 models) or avx512_vnni (bf16 models)")
    if device.type != "cpu":
        return Kernels()
    shape = (spec.hidden_size, 2 * spec.intermediate_size)  # gate_up: the largest per layer
    onednn = torch.backends.mkldnn.is_available() and onednn_is_faster(dtype, *shape)
    amx = quantized and dtype == torch.bfloat16 and qgemm_amx.load() is not None
    if int8 and activations != "exact":
        # every batch: VNNI 0.25-0.78x oneDNN bf16's time on an AMD Zen 4, AVX2
        # 0.2-0.75x oneDNN fp32's on a Zen 3 (linear.Kernels); the projections
        # that int8 is coarse for (model.LlamaModel) take the fine kernels up to
        # linear.FINE_ROWS rows and int8 beyond, so that layers.c runs every step.
        # Beside AMX (auto): int8 up to linear.VNNI_BESIDE_AMX rows, the tiles on
        # bf16 beyond, up to linear.TILE_ROWS
        tiles = amx and activations == "auto"
        return Kernels(onednn=onednn, vnni=True, amx=tiles, dense_tiles=tiles)
    if amx:
        # Intel AMX: 0.34-0.78x oneDNN's time from 1 to 128 rows (linear.Kernels)
        return Kernels(onednn=onednn, amx=True, dense_tiles=True)
    return Kernels(onednn=onednn,
                   qgemm=quantized and qgemm_is_faster(dtype, *shape, spec.vocab_size))
