# Attention read in place from the paged KV cache (paged_attention.c, built by
# native.py), for decodes and prefills alike. Where it cannot be built,
# `load()` says None and the torch backend gathers keys and values instead.

from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path

import torch

from workers.scheduler import native

SOURCE = Path(__file__).with_name("paged_attention.c")
INT8_SOURCE = Path(__file__).with_name("paged_int8.c")
INT8_FLAGS = (*native.AVX512, "-mavx512vnni")


P, I32, I64 = native.P, native.I32, native.I64
CACHE_BF16 = 2  # paged_decode's `bf16` mode: q, k, v and out fp32, the cache bf16
SIGNATURES = {"paged_decode": [P, I64, P, I64, P, I64, I32, I32, P, I32, I32, I32, I32, P, P, I64,
                               P, I32, P, I32, native.F32, P]}
INT8_SIGNATURES = {"paged_decode_int8": SIGNATURES["paged_decode"]}


class Int8Cache(ctypes.Structure):
    """paged_int8.c's view of a layer's 8-bit keys or values."""
    _fields_ = [("levels", ctypes.c_void_p), ("scales", ctypes.c_void_p)]


@cache
def load() -> ctypes.CDLL | None:
    """On a bf16 cache the AVX-512 build takes AVX-512's bf16 dot product
    (attention_avx512.h)."""
    return native.load_best(SOURCE, SIGNATURES)


@cache
def load_int8() -> ctypes.CDLL | None:
    """The kernel over an 8-bit cache: paged_int8.c where the CPU has AVX-512
    VNNI, else paged_attention.c's AVX2 loop over the same cache."""
    return native.load(INT8_SOURCE, INT8_SIGNATURES, INT8_FLAGS,
                       native.NEEDS_AVX512 | {"avx512_vnni"}) or load_int8_avx2()


@cache
def load_int8_avx2() -> ctypes.CDLL | None:
    """paged_attention.c's AVX2 build, for its paged_decode_int8."""
    return native.load(SOURCE, INT8_SIGNATURES)


def build(flags: tuple[str, ...] = ()) -> Path:
    return native.build(SOURCE, flags)


def rows_of(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x [rows, heads, dim] in `dtype` with heads and dims packed (rows may be apart)."""
    if x.dtype != dtype:
        x = x.to(dtype)
    return x if x.stride(2) == 1 and x.stride(1) == x.shape[2] else x.contiguous()


class InPlace:
    """The kernel bound to one KV cache ([kv_heads, slots, dim] a layer, bf16,
    fp32 or 8-bit levels): the caches' pointers are taken once, a step's
    tables once a step, so each layer's call does little in Python (30 of
    them a step)."""

    def __init__(self, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor],
                 lib: ctypes.CDLL | None = None,
                 scales: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None):
        """`lib`: a build of the kernel other than load()'s (load_int8()'s for
        an 8-bit cache). `scales`: an 8-bit cache's (KVCache.k_scale, v_scale),
        read through an Int8Cache a layer (self.k, self.v: their addresses)."""
        self.kv_heads, self.slots, self.dim = k_caches[0].shape
        self.step_tensors: tuple = ()
        self.step_args: tuple = ()
        self.int8: list | None = None
        if scales is None:
            self.kernel = (lib or load()).paged_decode
            self.dtype = k_caches[0].dtype
            self.k, self.v = [t.data_ptr() for t in k_caches], [t.data_ptr() for t in v_caches]
            return
        self.kernel = (lib or load_int8()).paged_decode_int8
        self.dtype = torch.bfloat16
        self.int8 = [[Int8Cache(t.data_ptr(), s.data_ptr()) for t, s in zip(caches, group,
                                                                            strict=True)]
                     for caches, group in ((k_caches, scales[0]), (v_caches, scales[1]))]
        self.k, self.v = ([ctypes.addressof(c) for c in caches] for caches in self.int8)

    def prepare(self, slots: torch.Tensor, tables: torch.Tensor, lengths: torch.Tensor,
                block_size: int) -> None:
        """slots int64 [rows] of every new token; tables int32 [batch, width] and
        lengths int32 [batch] of the query rows (the first `batch` rows)."""
        self.step_tensors = (slots, tables, lengths)  # alive while the kernel reads them
        self.step_args = (slots.data_ptr(), len(lengths), tables.data_ptr(), tables.shape[1],
                          lengths.data_ptr(), block_size)

    def mode(self, dtype: torch.dtype) -> int | None:
        """The kernel's `bf16` argument for q, k, v and out in `dtype`
        (paged_attention.c's modes; the 8-bit kernels take fp32 or bf16), or
        None where they go through a copy."""
        if self.int8 is not None and dtype in (torch.float32, torch.bfloat16):
            return int(dtype == torch.bfloat16)
        if dtype == self.dtype:
            return int(dtype == torch.bfloat16)
        if dtype == torch.float32 and self.dtype == torch.bfloat16 and self.int8 is None:
            return CACHE_BF16
        return None

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 scale: float, out: torch.Tensor) -> None:
        """k and v [rows, kv_heads, dim] of every token written to their slots,
        then the query rows of q [rows, heads, dim] attended into out
        [rows, heads * dim]. fp32 ones on a bf16 cache go in as they are; other
        dtypes than the cache's go through a copy."""
        mode = self.mode(out.dtype)
        if mode is None:
            staged = torch.empty(out.shape, dtype=self.dtype)
            self(layer, q, k, v, scale, staged)
            batch = self.step_args[1]
            out[:batch] = staged[:batch]
            return
        q, k, v = rows_of(q, out.dtype), rows_of(k, out.dtype), rows_of(v, out.dtype)
        slots, batch, tables, width, lengths, block_size = self.step_args
        self.kernel(q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(),
                    v.stride(0), mode, q.shape[0], slots, batch,
                    q.shape[1], self.kv_heads, self.dim, self.k[layer], self.v[layer],
                    self.slots, tables, width, lengths, block_size, scale, out.data_ptr())
