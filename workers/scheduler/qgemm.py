# Our weight-only 4- and 8-bit matmuls, built by native.py: qgemm.c (AVX2, fp32
# activations) and qgemm_bf16.c (AVX-512 bf16 dot products, bf16 activations).
# Where they cannot be built, `load()` says None and the projections keep
# torch's own 4-bit kernel.

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch

from workers.scheduler import native

SOURCE = Path(__file__).with_name("qgemm.c")
# bf16 activations on AVX-512 with its bf16 dot product
SOURCE_BF16 = Path(__file__).with_name("qgemm_bf16.c")
FLAGS_BF16 = ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16")
NEEDS_BF16 = frozenset({"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_bf16"})


@dataclass(frozen=True)
class Packed:
    """One weight in a kernel's layout. qgemm.c: q [out, in / 32, 16 or 32] bytes,
    fp32 scales (and, 4-bit, minimums) [out, in / 32]. qgemm_bf16.c (`blocked`):
    q [out / 4, in / 32, block] bytes, each block the levels of 4 outputs' group,
    their scales and (4-bit) minimums, as that file lays them out; scale and low
    unused."""
    bits: int
    q: torch.Tensor
    scale: torch.Tensor | None
    low: torch.Tensor | None
    blocked: bool = False
    kernel: Callable | None = None  # blocked: the bf16 kernel, bound once for the hot path
    out_dim: int = 0


def _blocked(bits: int, q: torch.Tensor) -> Packed:
    kernel = getattr(load_bf16(), f"q{bits}_gemm_bf16")
    return Packed(bits, q, None, None, True, kernel, q.shape[0] * 4)


def pack_q4(levels: torch.Tensor, scales_zeros: torch.Tensor, blocked: bool = False) -> Packed:
    """From quantize_int4's levels [out, in] and its [in / 32, out, 2] scales and
    zeros (w = (level - 8) * scale + zero)."""
    out_dim, in_dim = levels.shape
    groups = in_dim // 32
    q = levels.to(torch.uint8).reshape(out_dim, groups, 32)
    scale, zero = scales_zeros[..., 0].t().float(), scales_zeros[..., 1].t().float()
    low = zero - 8 * scale
    if blocked:  # outputs 2i and 2i + 1 share bytes; levels read as 128 + q
        pairs = q.reshape(out_dim // 2, 2, groups, 32)
        pairs = (pairs[:, 0] | (pairs[:, 1] << 4)).reshape(out_dim // 4, 2, groups, 32)
        pairs = pairs.transpose(1, 2).reshape(out_dim // 4, groups, 64)
        return _blocked(4, _blocks(pairs, scale, low - 128 * scale))
    q = q.reshape(out_dim, groups, 2, 16)
    return Packed(4, (q[:, :, 0] | (q[:, :, 1] << 4)).contiguous(), scale.contiguous(),
                  low.contiguous())


def pack_q8(levels: torch.Tensor, scale: torch.Tensor, blocked: bool = False) -> Packed:
    """From quantize_int8's levels [out, in] and scales [out, in / 32, 1]."""
    out_dim, in_dim = levels.shape
    q = levels.to(torch.int8).reshape(out_dim, in_dim // 32, 32).view(torch.uint8)
    scale = scale.reshape(out_dim, in_dim // 32).float()
    if blocked:
        quads = q.reshape(out_dim // 4, 4, in_dim // 32, 32).transpose(1, 2)
        return _blocked(8, _blocks(quads.reshape(out_dim // 4, in_dim // 32, 128), scale))
    return Packed(8, q.contiguous(), scale.contiguous(), None)


def _blocks(levels: torch.Tensor, *per_group: torch.Tensor) -> torch.Tensor:
    """levels [out / 4, groups, bytes] (4 outputs' already) and fp32 [out, groups]
    -> [out / 4, groups, block]."""
    blocks, groups, _ = levels.shape
    floats = [t.reshape(blocks, 4, groups).transpose(1, 2).contiguous().view(torch.uint8)
              for t in per_group]
    return torch.cat([levels, *floats], dim=-1).contiguous()


def blocked_for(dtype: torch.dtype) -> bool:
    """Whether activations of `dtype` run on the bf16 kernels (blocked weights)."""
    return dtype == torch.bfloat16 and load_bf16() is not None


def matmul(x: torch.Tensor, w: Packed) -> torch.Tensor:
    """x [rows, in] (any float dtype) @ w.T -> [rows, out]: a blocked weight takes
    x in bf16 and gives x's dtype if bf16 or fp32 (else fp32); others compute and
    give fp32."""
    if w.blocked:  # the hot path of a decode step: ~120 calls each
        x, dtype = bf16_rows(x)
        rows, in_dim = x.shape
        out = torch.empty(rows, w.out_dim, dtype=dtype)
        w.kernel(x.data_ptr(), rows, in_dim, w.q.data_ptr(), out.data_ptr(),
                 dtype == torch.bfloat16, w.out_dim)
        return out
    lib, x = load(), x.float().contiguous()
    rows, in_dim = x.shape
    out = torch.empty(rows, w.q.shape[0])
    kernel = lib.q4_gemm if w.bits == 4 else lib.q8_gemm
    kernel(x.data_ptr(), rows, in_dim, w.q.data_ptr(), w.scale.data_ptr(),
           None if w.low is None else w.low.data_ptr(), out.data_ptr(), out.shape[1])
    return out


def bf16_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.dtype]:
    """x as a bf16 kernel reads it (contiguous bf16), and the dtype its answer
    takes: x's if bf16 or fp32, else fp32."""
    dtype = x.dtype if x.dtype in (torch.bfloat16, torch.float32) else torch.float32
    if x.dtype != torch.bfloat16 or not x.is_contiguous():
        x = x.to(torch.bfloat16).contiguous()
    return x, dtype


@cache
def load() -> ctypes.CDLL | None:
    P, I32 = native.P, native.I32
    fp32 = [P, I32, I32, P, P, P, P, I32]  # x, rows, in, q, scale, low, y, out
    return native.load(SOURCE, {"q4_gemm": fp32, "q8_gemm": fp32})


@cache
def load_bf16() -> ctypes.CDLL | None:
    """The kernels for bf16 activations, where the CPU has avx512_bf16."""
    if load() is None:  # the fp32 ones serve everything else
        return None
    P, I32 = native.P, native.I32
    bf16 = [P, I32, I32, P, P, I32, I32]  # x, rows, in, blocked weight, y, y is bf16, out
    return native.load(SOURCE_BF16, {"q4_gemm_bf16": bf16, "q8_gemm_bf16": bf16}, FLAGS_BF16,
                       NEEDS_BF16)


def build() -> Path:
    return native.build(SOURCE)


def build_bf16() -> Path:
    return native.build(SOURCE_BF16, FLAGS_BF16)
