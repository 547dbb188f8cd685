# All decoder layers of a step in one C call (layers.c), where every kernel a
# layer needs at the step's row count is one of ours: a model on the CPU whose
# projections run qgemm's bf16 kernel or the int8 blocks (qgemm_vnni.c on a
# bf16 model, qgemm_avx2.c on a bf16 or fp32 one), with ops.c and the in-place
# attention kernel. A step of a few rows otherwise spends about a
# third of its time in Python between ~300 kernel calls. `Driver.build` says
# None where that does not hold, and the forward pass stays in Python.

from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path

import torch

from workers.scheduler import fused, native, paged
from workers.scheduler.linear import Dense

SOURCE = Path(__file__).with_name("layers.c")
P = native.P


class Proj(ctypes.Structure):
    _fields_ = [("fn", P), ("w", P)]


class Layer(ctypes.Structure):
    _fields_ = [("qkv", Proj), ("o", Proj), ("gate_up", Proj), ("down", Proj),
                ("input_norm", P), ("post_norm", P), ("k_cache", P), ("v_cache", P)]


class Model(ctypes.Structure):
    _fields_ = [("norm", P), ("rope", P), ("silu", P), ("attend", P),
                ("hidden", ctypes.c_int), ("inter", ctypes.c_int), ("heads", ctypes.c_int),
                ("kv_heads", ctypes.c_int), ("dim", ctypes.c_int), ("eps", ctypes.c_float),
                ("scale", ctypes.c_float), ("cache_slots", ctypes.c_int64),
                ("bf16", ctypes.c_int)]


class Step(ctypes.Structure):
    _fields_ = [("slots", P), ("batch", ctypes.c_int), ("tables", P), ("width", ctypes.c_int),
                ("lengths", P), ("block_size", ctypes.c_int)]


def address(function) -> int:
    return ctypes.cast(function, ctypes.c_void_p).value


def kernel_of(linear: Dense, dtype: torch.dtype) -> tuple[int, int, int] | None:
    """(function, weight, rows it serves up to) where the projection runs a
    kernel of layers.c's matmul signature on activations of `dtype`; None
    elsewhere. (VNNI's and qgemm's bf16 kernels read x in bf16, AVX2's in y's
    dtype.)"""
    if linear.bias is not None:
        return None
    packed = linear.vnni or (linear.qgemm if linear.qgemm and linear.qgemm.blocked else None)
    if packed is None:
        return None
    if dtype != torch.bfloat16 and not getattr(packed, "same_dtype", False):
        return None
    return (address(packed.kernel), packed.q.data_ptr(),
            linear.vnni_rows if linear.vnni is not None else linear.small_batch)


class Driver:
    def __init__(self, lib: ctypes.CDLL, model, attention, layers: list[Layer], max_rows: int):
        self.run, self.max_rows, self.attention = lib.decode_layers, max_rows, attention
        self.layers = (Layer * len(layers))(*layers)
        self.cos, self.sin = model.cos, model.sin
        ops, spec, kernel = model.ops, model.spec, attention.kernel
        self.model = Model(address(ops.norm), address(ops.rope), address(ops.silu),
                           address(kernel.kernel), spec.hidden_size, spec.intermediate_size,
                           spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.rms_eps,
                           attention.scale, kernel.slots, model.dtype == torch.bfloat16)

    @classmethod
    def build(cls, model, attention) -> Driver | None:
        """The driver for `model` (model.LlamaModel) on `attention`'s cache
        (attention.TorchAttention), or None where a part is not one of ours."""
        lib = load()
        if (lib is None or model.dtype not in (torch.bfloat16, torch.float32)
                or model.spec.qk_norm or not isinstance(model.ops, fused.NativeOps)
                or getattr(attention, "kernel", None) is None
                or attention.kernel.dtype != model.dtype):
            return None
        layers, max_rows = [], 1 << 30
        for index, layer in enumerate(model.layers):
            projections = [kernel_of(p, model.dtype)
                           for p in (layer.qkv, layer.o, layer.gate_up, layer.down)]
            if None in projections:
                return None
            max_rows = min([max_rows] + [rows for _, _, rows in projections])
            layers.append(Layer(*(Proj(fn, w) for fn, w, _ in projections),
                                layer.input_norm.data_ptr(), layer.post_norm.data_ptr(),
                                attention.kernel.k[index], attention.kernel.v[index]))
        return cls(lib, model, attention, layers, max_rows)

    def takes(self, rows: int, attend) -> bool:
        return rows <= self.max_rows and attend is self.attention

    def __call__(self, h: torch.Tensor, positions: torch.Tensor) -> None:
        """All layers on the residual stream h [rows, hidden] (in place);
        the attention's step arguments are this step's (attention.prepare)."""
        slots, batch, tables, width, lengths, block_size = self.attention.kernel.step_args
        step = Step(slots, batch, tables, width, lengths, block_size)
        self.run(ctypes.byref(self.model), self.layers, len(self.layers), ctypes.byref(step),
                 h.shape[0], positions.data_ptr(), self.cos.data_ptr(), self.sin.data_ptr(),
                 h.data_ptr())


@cache
def load() -> ctypes.CDLL | None:
    if fused.load() is None or paged.load() is None:
        return None
    I32 = native.I32
    return native.load(SOURCE, {"decode_layers": [P, P, I32, P, I32, P, P, P, P]})


def build() -> Path:
    return native.build(SOURCE)
