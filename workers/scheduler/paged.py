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
    lib.paged_decode.argtypes = [pointer, i32, i32, i32, i32, pointer, pointer, i64, pointer,
                                 i32, pointer, i32, ctypes.c_float, pointer]
    lib.paged_decode.restype = None
    return lib


def build() -> Path:
    return native.build(SOURCE)


def decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
           tables: torch.Tensor, lengths: torch.Tensor, block_size: int,
           scale: float) -> torch.Tensor:
    """q [batch, heads, dim]; caches fp32 [kv_heads, slots, dim]; tables int32
    [batch, width] and lengths int32 [batch] -> fp32 [batch, heads * dim]."""
    q = q.float().contiguous()
    batch, heads, dim = q.shape
    kv_heads, slots, _ = k_cache.shape
    out = torch.empty(batch, heads * dim)
    load().paged_decode(q.data_ptr(), batch, heads, kv_heads, dim, k_cache.data_ptr(),
                        v_cache.data_ptr(), slots, tables.data_ptr(), tables.shape[1],
                        lengths.data_ptr(), block_size, scale, out.data_ptr())
    return out
