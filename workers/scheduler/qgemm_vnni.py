# The 4- and 8-bit matmul on int8 activations (qgemm_vnni.c), for CPUs with
# AVX-512 VNNI and no AMX: x is rounded to 8 bits per row and group of 32, as
# llama.cpp runs a Q4_1 / Q8_0 GGUF, and each group's integer dot product is
# exact. On an AMD Zen 4 it took 0.25-0.3x oneDNN's dense bf16 time at 1 row,
# 0.5-0.65x at 16, 0.7x at 64 and 0.72-0.78x at 128-512 (all 30 layers'
# projections, streamed). The fine kernels round x to 14 bits instead (two
# int8 parts), for projections whose errors int8 would let through: they move
# the answer less than rounding it to bf16 does. `load()` says None without
# VNNI or a compiler.

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch

from workers.scheduler import native, qgemm

SOURCE = Path(__file__).with_name("qgemm_vnni.c")
FLAGS = ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mavx512vnni")
NEEDS = frozenset({"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_bf16",
                   "avx512_vnni"})
LANES = 16  # outputs per block: one zmm lane each


@dataclass(frozen=True)
class Blocked:
    """One weight in the kernel's layout (qgemm_vnni.c): [out / 16, groups,
    block] bytes, a block the 16 outputs' levels for a group, then their fp16
    scales and lows (exact for a GGUF, whose are fp16; else rounded, 2^-11 of
    a scale at most)."""
    bits: int
    q: torch.Tensor
    out_dim: int
    kernel: Callable  # q4_gemm_vnni, q8_gemm_vnni or a fine one, bound once for the hot path


def _per_block(values: torch.Tensor) -> torch.Tensor:
    """[out, groups] -> the bytes of fp16 [out / 16, groups, 16]."""
    out_dim, groups = values.shape
    per = values.half().reshape(out_dim // LANES, LANES, groups).transpose(1, 2)
    return per.contiguous().view(torch.uint8)


def _lanes(levels: torch.Tensor) -> torch.Tensor:
    """uint8 [out, in] -> [out / 16, groups, 8 parts, 16 lanes, 4 bytes]: part j
    of a group holds its inputs 4j..4j+3, an output a lane."""
    out_dim, in_dim = levels.shape
    lanes = levels.reshape(out_dim // LANES, LANES, in_dim // 32, 8, 4)
    return lanes.permute(0, 2, 3, 1, 4)


def pack_q4(levels: torch.Tensor, scale: torch.Tensor, low: torch.Tensor,
            fine: bool = False) -> Blocked:
    """levels [out, in] in [0, 15]; w = level * scale + low, scale and low [out, in / 32].
    Parts j and j + 4 share bytes (low and high nibbles). `fine`: 14-bit x."""
    parts = _lanes(levels.to(torch.uint8))
    q = (parts[:, :, :4] | (parts[:, :, 4:] << 4)).flatten(2)
    lib = load()
    return Blocked(4, torch.cat([q, _per_block(scale), _per_block(low)], dim=-1).contiguous(),
                   levels.shape[0], lib.q4_gemm_vnni_fine if fine else lib.q4_gemm_vnni)


def pack_q8(levels: torch.Tensor, scale: torch.Tensor, fine: bool = False) -> Blocked:
    """levels [out, in] in [-127, 127]; w = level * scale, scale [out, in / 32].
    Stored unsigned, level + 128, with low = -128 scale. `fine`: 14-bit x."""
    q = _lanes((levels + 128).to(torch.uint8)).flatten(2)
    lib = load()
    return Blocked(8, torch.cat([q, _per_block(scale), _per_block(-128 * scale)],
                                dim=-1).contiguous(), levels.shape[0],
                   lib.q8_gemm_vnni_fine if fine else lib.q8_gemm_vnni)


def fits(out_dim: int, in_dim: int) -> bool:
    return out_dim % LANES == 0 and in_dim % 32 == 0


def matmul(x: torch.Tensor, w: Blocked) -> torch.Tensor:
    """x [rows, in] @ w.T -> [rows, out], in x's dtype if bf16 or fp32 (else
    fp32); x is taken in bf16 and rounded to int8 (or 14 bits) by the kernel."""
    x, dtype = qgemm.bf16_rows(x)
    rows, in_dim = x.shape
    out = torch.empty(rows, w.out_dim, dtype=dtype)
    w.kernel(x.data_ptr(), rows, in_dim, w.q.data_ptr(), out.data_ptr(),
             dtype == torch.bfloat16, w.out_dim)
    return out


@cache
def load() -> ctypes.CDLL | None:
    P, I32 = native.P, native.I32
    signature = [P, I32, I32, P, P, I32, I32]  # x, rows, in, weight, y, y is bf16, out
    names = ("q4_gemm_vnni", "q8_gemm_vnni", "q4_gemm_vnni_fine", "q8_gemm_vnni_fine")
    return native.load(SOURCE, {name: signature for name in names}, FLAGS, NEEDS)


def build() -> Path:
    return native.build(SOURCE, FLAGS)
