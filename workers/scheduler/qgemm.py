# Our AVX2 weight-only 4- and 8-bit matmuls (qgemm.c, built by native.py),
# called on fp32 activations. Where they cannot be built, `load()` says None and
# the projections keep torch's own 4-bit kernel.

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch

from workers.scheduler import native

SOURCE = Path(__file__).with_name("qgemm.c")


@dataclass(frozen=True)
class Packed:
    """One weight in the kernel's layout: [out, in / 32, 16 or 32] bytes, and fp32
    scales (and, 4-bit, minimums) [out, in / 32]."""
    bits: int
    q: torch.Tensor
    scale: torch.Tensor
    low: torch.Tensor | None


def pack_q4(levels: torch.Tensor, scales_zeros: torch.Tensor) -> Packed:
    """From quantize_int4's levels [out, in] and its [in / 32, out, 2] scales and
    zeros (w = (level - 8) * scale + zero)."""
    out_dim, in_dim = levels.shape
    q = levels.to(torch.uint8).reshape(out_dim, in_dim // 32, 2, 16)
    scale, zero = scales_zeros[..., 0].t().float(), scales_zeros[..., 1].t().float()
    return Packed(4, (q[:, :, 0] | (q[:, :, 1] << 4)).contiguous(), scale.contiguous(),
                  (zero - 8 * scale).contiguous())


def pack_q8(levels: torch.Tensor, scale: torch.Tensor) -> Packed:
    """From quantize_int8's levels [out, in] and scales [out, in / 32, 1]."""
    out_dim, in_dim = levels.shape
    return Packed(8, levels.to(torch.int8).reshape(out_dim, in_dim // 32, 32).contiguous(),
                  scale.reshape(out_dim, in_dim // 32).float().contiguous(), None)


def matmul(x: torch.Tensor, w: Packed) -> torch.Tensor:
    """x [rows, in] (any float dtype) @ w.T -> fp32 [rows, out]."""
    lib = load()
    x = x.float().contiguous()
    rows, in_dim = x.shape
    out = torch.empty(rows, w.q.shape[0])
    kernel = lib.q4_gemm if w.bits == 4 else lib.q8_gemm
    kernel(x.data_ptr(), rows, in_dim, w.q.data_ptr(), w.scale.data_ptr(),
           None if w.low is None else w.low.data_ptr(), out.data_ptr(), out.shape[1])
    return out


@cache
def load() -> ctypes.CDLL | None:
    lib = native.load(SOURCE)
    if lib is None:
        return None
    pointer, i32 = ctypes.c_void_p, ctypes.c_int
    for kernel in (lib.q4_gemm, lib.q8_gemm):
        kernel.argtypes = [pointer, i32, i32, pointer, pointer, pointer, pointer, i32]
        kernel.restype = None
    return lib


def build() -> Path:
    return native.build(SOURCE)
