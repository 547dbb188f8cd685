# Decode attention read in place from the paged KV cache (paged_attention.c,
# built by native.py). Where it cannot be built, `load()` says None and the
# torch backend gathers each step's keys and values instead.

from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path

import torch

from workers.scheduler import native

SOURCE = Path(__file__).with_name("paged_attention.c")


@cache
def load() -> ctypes.CDLL | None:
    lib = native.load(SOURCE)
    if lib is None:
        return None
    pointer, i32, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    lib.paged_decode.argtypes = [pointer, i64, pointer, i64, pointer, i64, i32, i32, pointer,
                                 i32, i32, i32, i32, pointer, pointer, i64, pointer, i32,
                                 pointer, i32, ctypes.c_float, pointer]
    lib.paged_decode.restype = None
    return lib


def build() -> Path:
    return native.build(SOURCE)


def rows_of(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x [rows, heads, dim] in `dtype` with heads and dims packed (rows may be apart)."""
    x = x.to(dtype)
    return x if x.stride(2) == 1 and x.stride(1) == x.shape[2] else x.contiguous()


def step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
         k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
         lengths: torch.Tensor, block_size: int, scale: float, out: torch.Tensor) -> None:
    """One layer: k and v [rows, kv_heads, dim] of every token written to `slots`
    of the caches [kv_heads, slots, dim], then the first len(lengths) rows of
    q [rows, heads, dim] attended through `tables` (int32 [batch, width]) into
    out [rows, heads * dim]. The kernel reads and writes the caches' dtype, bf16
    or fp32 (other outputs through a copy)."""
    if out.dtype != k_cache.dtype:
        staged = torch.empty(out.shape, dtype=k_cache.dtype)
        step(q, k, v, slots, k_cache, v_cache, tables, lengths, block_size, scale, staged)
        out[:len(lengths)] = staged[:len(lengths)]
        return
    dtype = out.dtype
    q, k, v = rows_of(q, dtype), rows_of(k, dtype), rows_of(v, dtype)
    kv_heads, cache_slots, dim = k_cache.shape
    load().paged_decode(
        q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0),
        int(dtype == torch.bfloat16), q.shape[0], slots.data_ptr(), len(lengths), q.shape[1],
        kv_heads, dim, k_cache.data_ptr(), v_cache.data_ptr(), cache_slots, tables.data_ptr(),
        tables.shape[1], lengths.data_ptr(), block_size, scale, out.data_ptr())
