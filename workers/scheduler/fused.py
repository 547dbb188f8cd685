# The elementwise parts of a decoder layer, as torch ops (any device) or as one
# pass each through ops.c on the CPU, where a decode step of a few rows spends
# more time dispatching torch's small ops than computing them. Both round alike.

from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path

import torch
import torch.nn.functional as F

from workers.scheduler import native

SOURCE = Path(__file__).with_name("ops.c")


class TorchOps:
    def add_rms_norm(self, h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> torch.Tensor:
        """h += delta in place (unless None); returns rms_norm(h) * weight."""
        if delta is not None:
            h += delta
        return rms_norm(h, weight, eps)

    def rope_(self, x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
              sin: torch.Tensor) -> None:
        """Rotary embedding in place on x [rows, heads, dim]."""
        c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
        x1, x2 = x.chunk(2, dim=-1)
        x.copy_(x * c + torch.cat([-x2, x1], dim=-1) * s)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


class NativeOps(TorchOps):
    """ops.c, for CPU tensors in bf16 or fp32 (others go to torch)."""

    def __init__(self, lib: ctypes.CDLL):
        self.lib = lib

    @staticmethod
    def takes(*tensors: torch.Tensor) -> bool:
        return all(t.device.type == "cpu" and t.dtype in (torch.bfloat16, torch.float32)
                   and t.dtype == tensors[0].dtype and t.is_contiguous() for t in tensors)

    def add_rms_norm(self, h, delta, weight, eps):
        if not self.takes(h, weight, *([] if delta is None else [delta])):
            return super().add_rms_norm(h, delta, weight, eps)
        out = torch.empty_like(h)
        self.lib.add_rms_norm(h.data_ptr(), None if delta is None else delta.data_ptr(),
                              weight.data_ptr(), out.data_ptr(), h.shape[0], h.shape[1], eps,
                              int(h.dtype == torch.bfloat16))
        return out

    def rope_(self, x, positions, cos, sin):
        if not (self.takes(cos, sin) and x.dtype == cos.dtype and x.stride(2) == 1
                and x.stride(1) == x.shape[2] and positions.dtype == torch.long):
            return super().rope_(x, positions, cos, sin)
        self.lib.rope(x.data_ptr(), x.stride(0), x.shape[0], x.shape[1], x.shape[2],
                      positions.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                      int(x.dtype == torch.bfloat16))
        return None

    def silu_mul(self, gate_up):
        if not self.takes(gate_up):
            return super().silu_mul(gate_up)
        rows, n = gate_up.shape[0], gate_up.shape[1] // 2
        out = gate_up.new_empty(rows, n)
        self.lib.silu_mul(gate_up.data_ptr(), out.data_ptr(), rows, n,
                          int(gate_up.dtype == torch.bfloat16))
        return out


@cache
def load() -> ctypes.CDLL | None:
    lib = native.load(SOURCE)
    if lib is None:
        return None
    pointer, i32, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    lib.add_rms_norm.argtypes = [pointer, pointer, pointer, pointer, i32, i32, ctypes.c_float,
                                 i32]
    lib.rope.argtypes = [pointer, i64, i32, i32, i32, pointer, pointer, pointer, i32]
    lib.silu_mul.argtypes = [pointer, pointer, i32, i32, i32]
    for kernel in (lib.add_rms_norm, lib.rope, lib.silu_mul):
        kernel.restype = None
    return lib


def build() -> Path:
    return native.build(SOURCE)


def choose_ops(device: torch.device) -> TorchOps:
    lib = load() if device.type == "cpu" else None
    return TorchOps() if lib is None else NativeOps(lib)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalize in fp32 whatever the dtype: a bf16 RMSNorm over this model's
    residual stream turns "Paris" into nonsense (measured), as transformers knows."""
    if x.dtype == torch.float32:  # one fused op: the five it replaced cost ~1.5x as much
        return F.rms_norm(x, weight.shape, weight, eps)
    # normalized in fp32, rounded, then scaled in x's dtype, as transformers does
    return F.rms_norm(x.float(), weight.shape, eps=eps).to(x.dtype) * weight
