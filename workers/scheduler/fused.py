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
    """ops.c on CPU tensors of one dtype, bf16 or fp32, as the forward pass hands
    them over: contiguous, except q and k, which are rows of the qkv output. A
    decode step calls these ~150 times, so they check little (~3 us a call
    against ~9 for a version that checked devices and dtypes)."""

    def __init__(self, lib: ctypes.CDLL, dtype: torch.dtype):
        self.dtype, self.bf16 = dtype, int(dtype == torch.bfloat16)
        self.norm, self.rope, self.silu = lib.add_rms_norm, lib.rope, lib.silu_mul

    def add_rms_norm(self, h, delta, weight, eps):
        out = torch.empty_like(h)
        if delta is not None and not delta.is_contiguous():
            delta = delta.contiguous()
        self.norm(h.data_ptr(), None if delta is None else delta.data_ptr(), weight.data_ptr(),
                  out.data_ptr(), h.shape[0], h.shape[1], eps, self.bf16)
        return out

    def rope_(self, x, positions, cos, sin):
        rows, heads, dim = x.shape
        if x.stride(1) != dim or x.stride(2) != 1:
            return super().rope_(x, positions, cos, sin)
        self.rope(x.data_ptr(), x.stride(0), rows, heads, dim, positions.data_ptr(),
                  cos.data_ptr(), sin.data_ptr(), self.bf16)
        return None

    def silu_mul(self, gate_up):
        rows, n = gate_up.shape[0], gate_up.shape[1] // 2
        out = gate_up.new_empty(rows, n)
        self.silu(gate_up.contiguous().data_ptr(), out.data_ptr(), rows, n, self.bf16)
        return out


P, I32, I64, F32 = native.P, native.I32, native.I64, native.F32
SIGNATURES = {"add_rms_norm": [P, P, P, P, I32, I32, F32, I32], "argmax_rows": [P, I32, I32, P],
              "rope": [P, I64, I32, I32, I32, P, P, P, I32], "silu_mul": [P, P, I32, I32, I32]}


@cache
def load() -> ctypes.CDLL | None:
    return native.load_best(SOURCE, SIGNATURES)


def build(flags: tuple[str, ...] = ()) -> Path:
    return native.build(SOURCE, flags)


def choose_ops(device: torch.device, dtype: torch.dtype) -> TorchOps:
    native_dtype = device.type == "cpu" and dtype in (torch.bfloat16, torch.float32)
    lib = load() if native_dtype else None
    return TorchOps() if lib is None else NativeOps(lib, dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalize in fp32 whatever the dtype: a bf16 RMSNorm over this model's
    residual stream turns "Paris" into nonsense (measured), as transformers knows."""
    if x.dtype == torch.float32:  # one fused op: the five it replaced cost ~1.5x as much
        return F.rms_norm(x, weight.shape, weight, eps)
    # normalized in fp32, rounded, then scaled in x's dtype, as transformers does
    return F.rms_norm(x.float(), weight.shape, eps=eps).to(x.dtype) * weight
