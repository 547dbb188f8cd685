# The 4- and 8-bit matmul on Intel AMX tiles (qgemm_amx.c), for bf16
# activations: it dequantizes each 16 x 32 piece of the weight once per 64 rows
# of x, so it reads 4-bit weights where oneDNN's dense bf16 matmul reads four
# times the bytes (linear.TILE_ROWS: the rows it serves); and the dense bf16
# matmul on the same tiles for the steps past it. `load()` says None without
# AMX, a compiler, or Linux's leave to use the tile registers.

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from functools import cache, cached_property
from pathlib import Path

import torch

from workers.scheduler import native, qgemm

SOURCE = Path(__file__).with_name("qgemm_amx.c")
FLAGS = ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mamx-tile", "-mamx-bf16")
NEEDS = frozenset({"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_bf16",
                   "amx_tile", "amx_bf16"})
P, I32 = native.P, native.I32
SIGNATURES = {
    "amx_init": [P],
    # x, rows, in, q, scale, low, y, y is bf16, out, bits
    "q_gemm_amx": [P, I32, I32, P, P, P, P, I32, I32, I32],
    # x, rows, in, q, scale, low, out (int64), out_dim, bits
    "q_argmax_amx": [P, I32, I32, P, P, P, P, I32, I32],
    "tiled_gemm": [P, I32, I32, P, P, I32, I32],  # x, rows, in, Parts, y, y is bf16, out
    "tiled_gemm_silu": [P, I32, I32, P, P, I32, I32],  # the same; y = silu(gate) * up
    "dense_gemm_amx": [P, I32, I32, P, P, I32, I32],  # x, rows, in, w, y, y is bf16, out
}


class Parts(ctypes.Structure):
    """A Tiled as qgemm_amx.c's tiled_gemm takes it (layers.c's signature)."""
    _fields_ = [("q", P), ("scale", P), ("low", P), ("bits", I32)]


@dataclass(frozen=True)
class Tiled:
    """One weight in the kernel's layout (qgemm_amx.c): levels [out / 16,
    groups, 16 tile rows, 16 or 32 bytes], fp32 scales and (4-bit) minimums
    [out / 16, groups, 16]."""
    bits: int
    q: torch.Tensor
    scale: torch.Tensor
    low: torch.Tensor | None
    out_dim: int

    @cached_property
    def parts(self) -> Parts:
        """The pointers tiled_gemm takes, made once (they live as long as the weight)."""
        low = None if self.low is None else self.low.data_ptr()
        return Parts(self.q.data_ptr(), self.scale.data_ptr(), low, self.bits)


def _tile_lanes(levels: torch.Tensor) -> torch.Tensor:
    """[out, in] -> [out / 16, groups, 16 rows, 32 lanes]: lane L of row r is
    output L // 2, input 2r + L % 2 of the group."""
    out_dim, in_dim = levels.shape
    lanes = levels.reshape(out_dim // 16, 16, in_dim // 32, 16, 2)  # block, n, group, r, pair
    return lanes.permute(0, 2, 3, 1, 4).reshape(out_dim // 16, in_dim // 32, 16, 32)


def _per_block(values: torch.Tensor) -> torch.Tensor:
    """fp32 [out, groups] -> [out / 16, groups, 16]."""
    out_dim, groups = values.shape
    return values.float().reshape(out_dim // 16, 16, groups).transpose(1, 2).contiguous()


def pack_q4(levels: torch.Tensor, scale: torch.Tensor, low: torch.Tensor) -> Tiled:
    """levels [out, in] in [0, 15]; w = level * scale + low, scale and low [out, in / 32]."""
    lanes = _tile_lanes(levels.to(torch.uint8))
    q = (lanes[..., :16] | (lanes[..., 16:] << 4)).contiguous()
    return Tiled(4, q, _per_block(scale), _per_block(low), levels.shape[0])


def pack_q8(levels: torch.Tensor, scale: torch.Tensor) -> Tiled:
    """levels [out, in] in [-127, 127]; w = level * scale, scale [out, in / 32]."""
    q = _tile_lanes(levels.to(torch.int8)).contiguous().view(torch.uint8)
    return Tiled(8, q, _per_block(scale), None, levels.shape[0])


def fits(out_dim: int, in_dim: int) -> bool:
    return out_dim % 16 == 0 and in_dim % 32 == 0


def _rows(x: torch.Tensor, in_dim: int) -> tuple[torch.Tensor, torch.dtype]:
    """qgemm.bf16_rows(x), refused where its width is not the weight's: the
    kernels take the width from x and would read past the weight."""
    if x.shape[-1] != in_dim:
        raise ValueError(f"x has {x.shape[-1]} columns; the weight takes {in_dim}")
    return qgemm.bf16_rows(x)


def fits_dense(out_dim: int, in_dim: int) -> bool:
    return out_dim % 32 == 0 and in_dim % 32 == 0


def pack_dense(weight: torch.Tensor) -> torch.Tensor:
    """weight [out, in] -> bf16 in the tiles' lanes, for dense_gemm_amx."""
    bits = weight.to(torch.bfloat16).contiguous().view(torch.int16)
    return _tile_lanes(bits).contiguous().view(torch.bfloat16)


def dense_matmul(x: torch.Tensor, packed: torch.Tensor, out_dim: int) -> torch.Tensor:
    """x [rows, in] @ w.T (w from pack_dense) -> [rows, out], as `matmul`."""
    x, dtype = _rows(x, 32 * packed.shape[1])
    rows, in_dim = x.shape
    out = torch.empty(rows, out_dim, dtype=dtype)
    load().dense_gemm_amx(x.data_ptr(), rows, in_dim, packed.data_ptr(), out.data_ptr(),
                          dtype == torch.bfloat16, out_dim)
    return out


def matmul(x: torch.Tensor, w: Tiled) -> torch.Tensor:
    """x [rows, in] @ w.T -> [rows, out], in x's dtype if bf16 or fp32 (else
    fp32); x is taken in bf16."""
    x, dtype = _rows(x, 32 * w.q.shape[1])
    rows, in_dim = x.shape
    out = torch.empty(rows, w.out_dim, dtype=dtype)
    load().q_gemm_amx(x.data_ptr(), rows, in_dim, w.q.data_ptr(), w.scale.data_ptr(),
                      None if w.low is None else w.low.data_ptr(), out.data_ptr(),
                      dtype == torch.bfloat16, w.out_dim, w.bits)
    return out


def silu_matmul(x: torch.Tensor, gate_up: Tiled) -> torch.Tensor:
    """silu(gate) * up [rows, out / 2] bf16 of `matmul(x, gate_up)` in bf16,
    its first half the gate and its second the up, rounded as ops.c's silu_mul
    rounds them (layers.c's MLP on the tiles)."""
    if gate_up.out_dim % 32:
        raise ValueError(f"gate_up has {gate_up.out_dim} outputs; halves of 16s are needed")
    x, _ = _rows(x, 32 * gate_up.q.shape[1])
    rows, in_dim = x.shape
    out = torch.empty(rows, gate_up.out_dim // 2, dtype=torch.bfloat16)
    load().tiled_gemm_silu(x.data_ptr(), rows, in_dim, ctypes.addressof(gate_up.parts),
                           out.data_ptr(), 1, gate_up.out_dim)
    return out


def argmax(x: torch.Tensor, w: Tiled) -> torch.Tensor:
    """The index of each row's largest output of x @ w.T (the first of equals),
    as `matmul(x, w).argmax(-1)` on its fp32 answer, which is never written."""
    x, _ = _rows(x, 32 * w.q.shape[1])
    rows, in_dim = x.shape
    out = torch.empty(rows, dtype=torch.long)
    load().q_argmax_amx(x.data_ptr(), rows, in_dim, w.q.data_ptr(), w.scale.data_ptr(),
                        None if w.low is None else w.low.data_ptr(), out.data_ptr(), w.out_dim,
                        w.bits)
    return out


@cache
def load() -> ctypes.CDLL | None:
    lib = native.load(SOURCE, SIGNATURES, FLAGS, NEEDS)
    if lib is None:
        return None
    ok = ctypes.c_int(0)
    lib.amx_init(ctypes.byref(ok))
    return lib if ok.value else None


def build() -> Path:
    return native.build(SOURCE, FLAGS)
