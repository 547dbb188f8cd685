# The 4- and 8-bit matmul on int8 activations (qgemm_vnni.c), for CPUs with
# AVX-512 VNNI and no AMX: x is rounded to 8 bits per row and group of 32, as
# llama.cpp runs a Q4_1 / Q8_0 GGUF, and each group's integer dot product is
# exact. On an AMD Zen 4 it took 0.25-0.3x oneDNN's dense bf16 time at 1 row,
# 0.5-0.65x at 16, 0.7x at 64 and 0.72-0.78x at 128-512 (all 30 layers'
# projections, streamed). The fine kernels round x to 14 bits instead (two
# int8 parts), for projections whose errors int8 would let through: they move
# the answer less than rounding it to bf16 does. On CPUs with AVX2 and no VNNI,
# qgemm_avx2.c runs the same blocks (vpmaddubsw + vpmaddwd for vpdpbusd) on
# fp32 or bf16 activations. `library()` says None without either or a compiler.

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import cache
from pathlib import Path

import torch

from workers.scheduler import native, qgemm

SOURCE = Path(__file__).with_name("qgemm_vnni.c")
SOURCE_AVX2 = Path(__file__).with_name("qgemm_avx2.c")
FLAGS_AVX2 = ("-mf16c",)
NEEDS_AVX2 = frozenset({"avx2", "fma", "f16c"})
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
    same_dtype: bool = False  # the kernel reads x in y's dtype (AVX2), not always bf16 (VNNI)


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
            fine: bool = False, on: str | None = None) -> Blocked:
    """levels [out, in] in [0, 15]; w = level * scale + low, scale and low [out, in / 32].
    Parts j and j + 4 share bytes (low and high nibbles). `fine`: 14-bit x;
    `on`: "vnni" or "avx2" (else this CPU's library())."""
    parts = _lanes(levels.to(torch.uint8))
    q = (parts[:, :, :4] | (parts[:, :, 4:] << 4)).flatten(2)
    return _bound(4, torch.cat([q, _per_block(scale), _per_block(low)], dim=-1),
                  levels.shape[0], fine, on)


def pack_q8(levels: torch.Tensor, scale: torch.Tensor, fine: bool = False,
            on: str | None = None) -> Blocked:
    """levels [out, in] in [-127, 127]; w = level * scale, scale [out, in / 32].
    Stored unsigned, level + 128, with low = -128 scale. `fine`: 14-bit x."""
    q = _lanes((levels + 128).to(torch.uint8)).flatten(2)
    return _bound(8, torch.cat([q, _per_block(scale), _per_block(-128 * scale)], dim=-1),
                  levels.shape[0], fine, on)


def _kernel(bits: int, suffix: str, fine: bool) -> Callable:
    """The matmul of library `suffix` ("vnni" or "avx2") for `bits`-bit blocks."""
    lib = {"vnni": load, "avx2": load_avx2}[suffix]()
    return getattr(lib, f"q{bits}_gemm_{suffix}" + ("_fine" if fine else ""))


def _bound(bits: int, q: torch.Tensor, out_dim: int, fine: bool, on: str | None) -> Blocked:
    """The blocks with the kernel they run on: `on`'s, else this CPU's."""
    suffix = library()[1] if on is None else on
    return Blocked(bits, q.contiguous(), out_dim, _kernel(bits, suffix, fine), suffix == "avx2")


def fine(w: Blocked) -> Blocked:
    """The same blocks (shared, not copied) on the fine kernel of their library."""
    return replace(w, kernel=_kernel(w.bits, "avx2" if w.same_dtype else "vnni", True))


def fits(out_dim: int, in_dim: int) -> bool:
    return out_dim % LANES == 0 and in_dim % 32 == 0


def matmul(x: torch.Tensor, w: Blocked) -> torch.Tensor:
    """x [rows, in] @ w.T -> [rows, out], in x's dtype if bf16 or fp32 (else
    fp32); x is taken in bf16 (VNNI) or as it is (AVX2) and rounded to int8 (or
    14 bits) by the kernel."""
    if w.same_dtype:
        dtype = x.dtype if x.dtype in (torch.bfloat16, torch.float32) else torch.float32
        x = x.to(dtype).contiguous()
    else:
        x, dtype = qgemm.bf16_rows(x)
    rows, in_dim = x.shape
    out = torch.empty(rows, w.out_dim, dtype=dtype)
    w.kernel(x.data_ptr(), rows, in_dim, w.q.data_ptr(), out.data_ptr(),
             dtype == torch.bfloat16, w.out_dim)
    return out


def argmax(x: torch.Tensor, w: Blocked) -> torch.Tensor:
    """`matmul(x, w).argmax(-1)` (its fp32 answer; the first of equals) for an
    8-bit weight on the VNNI kernel, whose answer is never written: greedy
    sampling's lm_head (64 x 49152 fp32 logits: 12.6 MB written and read again)."""
    x, _ = qgemm.bf16_rows(x)
    rows, in_dim = x.shape
    out = torch.empty(rows, dtype=torch.int64)
    load().q8_argmax_vnni(x.data_ptr(), rows, in_dim, w.q.data_ptr(), out.data_ptr(), w.out_dim)
    return out


def takes_argmax(w: Blocked) -> bool:
    """Whether `argmax` runs `w`: 8 bits on the VNNI kernels (not AVX2's)."""
    return w.bits == 8 and not w.same_dtype


def signatures(suffix: str) -> dict[str, list]:
    """The exported functions of the `suffix` build (vnni or avx2), by name."""
    P, I32 = native.P, native.I32
    signature = [P, I32, I32, P, P, I32, I32]  # x, rows, in, weight, y, y (AVX2: x too) bf16, out
    found = {f"q{bits}_gemm_{suffix}{fine}": signature
             for bits in (4, 8) for fine in ("", "_fine")}
    if suffix == "vnni":
        found["q8_argmax_vnni"] = [P, I32, I32, P, P, I32]  # x, rows, in, weight, out, out dim
    return found


@cache
def load() -> ctypes.CDLL | None:
    """The VNNI build, where the CPU has it."""
    return native.load(SOURCE, signatures("vnni"), FLAGS, NEEDS)


@cache
def load_avx2() -> ctypes.CDLL | None:
    return native.load(SOURCE_AVX2, signatures("avx2"), FLAGS_AVX2, NEEDS_AVX2)


def library() -> tuple[ctypes.CDLL | None, str]:
    """The kernels this CPU runs the blocks on: VNNI's, else AVX2's."""
    lib = load()
    return (lib, "vnni") if lib is not None else (load_avx2(), "avx2")


def takes(dtype: torch.dtype) -> bool:
    """Whether a model of `dtype` can run its 4- and 8-bit weights here: VNNI
    takes bf16 activations (it is chosen with avx512_bf16); AVX2 fp32 or bf16."""
    lib, suffix = library()
    return lib is not None and (dtype == torch.bfloat16 or suffix == "avx2")


def build() -> Path:
    return native.build(SOURCE, FLAGS)


def build_avx2() -> Path:
    return native.build(SOURCE_AVX2, FLAGS_AVX2)
