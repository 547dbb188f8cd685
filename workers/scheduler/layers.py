# All decoder layers of a step in one C call (layers.c), where every kernel a
# layer needs at the step's row count is one of ours: a model on the CPU whose
# projections run qgemm's bf16 kernel, the int8 blocks (qgemm_vnni.c on a
# bf16 model, qgemm_avx2.c on a bf16 or fp32 one) or AMX's tiles (and on an
# Intel CPU with AMX both: int8 up to 10 rows, the tiles to 64), with ops.c and
# the in-place attention kernel. A step of a few rows otherwise spends about a
# third of its time in Python between ~300 kernel calls. `Driver.build` says
# None where that does not hold, and the forward pass stays in Python.
# A step of many rows runs as groups of whole sequences, each group its own chain
# of layers that one thread at a time advances (`row_groups`, layers.c's
# decode_layers_grouped), so no thread waits for the other between kernels;
# except beside AMX's tiles, whose matmuls cost less a row the more rows share
# them (one dequantization serves up to 64).

from __future__ import annotations

import ctypes
import itertools
import sys
from functools import cache
from pathlib import Path

import torch

from workers.scheduler import fused, native, paged, qgemm_amx
from workers.scheduler.linear import Dense

SOURCE = Path(__file__).with_name("layers.c")
P = native.P


class Proj(ctypes.Structure):
    _fields_ = [("fn", P), ("w", P)]


class Layer(ctypes.Structure):
    _fields_ = [("qkv", Proj), ("o", Proj), ("gate_up", Proj), ("down", Proj),
                ("input_norm", P), ("post_norm", P), ("k_cache", P), ("v_cache", P),
                ("gate_up_silu", ctypes.c_int)]


class Model(ctypes.Structure):
    _fields_ = [("norm", P), ("rope", P), ("silu", P), ("attend", P), ("embed", P),
                ("final_norm", P), ("hidden", ctypes.c_int), ("inter", ctypes.c_int),
                ("heads", ctypes.c_int), ("kv_heads", ctypes.c_int), ("dim", ctypes.c_int),
                ("eps", ctypes.c_float),
                ("scale", ctypes.c_float), ("cache_slots", ctypes.c_int64),
                ("bf16", ctypes.c_int), ("attend_mode", ctypes.c_int)]


class Step(ctypes.Structure):
    _fields_ = [("slots", P), ("tables", P), ("width", ctypes.c_int), ("lengths", P),
                ("block_size", ctypes.c_int)]


# Groups of MIN_GROUP_ROWS rows or more (a tile of the int8 matmuls at least), 2 a
# thread: fewer rows run each kernel on every thread. Grouped, every group reads
# every weight; on 2 cores (AMD Zen 4, paired steps) a decode step took 1.10-1.14x
# the time at 16 rows (weights streamed), 1.04-1.06x at 32, 0.97-1.03x at 48, and at
# 64 0.95-1.0x with the host quiet, 0.92-0.95x beside a process busy 0.5 ms in every 3.
# There, 4 groups at 64 rows took 0.94-1.0x (6: 0.95-1.0x); on an AMD Zen 5, 4 groups
# of 16 took 0.94-1.02x the time of 6 of ~11, quiet or busy (26 paired rounds, median
# 0.97): each group streams every weight once, and with 2 groups a thread one thread
# still runs the other's next layer while the OS holds that one.
MIN_GROUP_ROWS, MIN_GROUPS, MAX_GROUPS = 10, 2, 2  # the last two per thread


def row_groups(sequence_rows: list[int], threads: int) -> list[int] | None:
    """Where groups of whole sequences start (then the step's row count), near
    equal in rows; None where the step has too few rows to group, or one
    sequence holds over half of them (a long prompt: its rows attend together)."""
    rows = sum(sequence_rows)
    groups = min(MAX_GROUPS * threads, rows // MIN_GROUP_ROWS)
    if threads < 2 or groups < MIN_GROUPS * threads or max(sequence_rows) * 2 > rows:
        return None
    starts, first, last = [], 0, -1
    for n in sequence_rows:  # a sequence joins the group its middle row falls in
        group = min(groups - 1, int((first + n / 2) * groups / rows))
        if group != last:
            starts.append(first)
            last = group
        first += n
    starts.append(rows)
    return starts if max(b - a for a, b in itertools.pairwise(starts)) * 2 <= rows else None


def address(function) -> int:
    return ctypes.cast(function, ctypes.c_void_p).value


def kernels_of(linear: Dense, dtype: torch.dtype) -> list[tuple[int, int, int]]:
    """(function, weight, rows it serves up to) for each kernel of layers.c's
    matmul signature the projection runs on activations of `dtype`, fewest
    rows first; none where a bias or torch's kernels come in. (VNNI's,
    qgemm's bf16 and AMX's kernels read x in bf16, AVX2's in y's dtype.)"""
    if linear.bias is not None:
        return []
    found = []
    packed = linear.vnni or (linear.qgemm if linear.qgemm and linear.qgemm.blocked else None)
    rows = linear.vnni_rows if linear.vnni is not None else linear.small_batch
    for blocks, reach in ((linear.vnni_fine, linear.fine_rows), (packed, rows)):
        if blocks is not None and (dtype == torch.bfloat16
                                   or getattr(blocks, "same_dtype", False)):
            found.append((address(blocks.kernel), blocks.q.data_ptr(), reach))
    if linear.tiled is not None and dtype == torch.bfloat16:
        tiles = qgemm_amx.load()
        found.append((address(tiles.tiled_gemm), ctypes.addressof(linear.tiled.parts),
                      linear.small_batch))
    if linear.tiles_weight is not None:  # bf16: the dense tiles serve every row count
        found.append((address(qgemm_amx.load().dense_gemm_amx), linear.tiles_weight.data_ptr(),
                      sys.maxsize))
    return found


def silu_on_tiles(layer: Layer, inter: int) -> None:
    """Where AMX's tiles run the layer's gate_up, their kernel that writes the
    activation itself (qgemm_amx.c's tiled_gemm_silu, the same bits): silu's
    own pass read gate_up's rows back, half of each made on the other core
    (64-row decode steps 0.986x the time, paired step by step; Intel Xeon)."""
    tiles = qgemm_amx.load()
    if tiles is not None and layer.gate_up.fn == address(tiles.tiled_gemm) and inter % 16 == 0:
        layer.gate_up.fn = address(tiles.tiled_gemm_silu)
        layer.gate_up_silu = 1


class Driver:
    """`regimes`: (rows up to, the layers' kernels for them), fewest rows first."""

    def __init__(self, lib: ctypes.CDLL, model, attention, regimes: list[tuple[int, ctypes.Array]],
                 grouped: bool = True):
        self.run, self.attention, self.regimes = lib.decode_layers, attention, regimes
        self.run_grouped = lib.decode_layers_grouped
        self.grouped = grouped  # False: every step layer by layer (bench/grouped_steps.py)
        self.max_rows = regimes[-1][0]
        self.cos, self.sin, self.dtype = model.cos, model.sin, model.dtype
        ops, spec, kernel = model.ops, model.spec, attention.kernel
        self.model = Model(address(ops.norm), address(ops.rope), address(ops.silu),
                           address(kernel.kernel), model.embed.data_ptr(),
                           model.norm.data_ptr(), spec.hidden_size, spec.intermediate_size,
                           spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.rms_eps,
                           attention.scale, kernel.slots, model.dtype == torch.bfloat16,
                           kernel.mode(model.dtype))

    @classmethod
    def build(cls, model, attention) -> Driver | None:
        """The driver for `model` (model.LlamaModel) on `attention`'s cache
        (attention.TorchAttention), or None where a part is not one of ours.
        Each regime's kernels serve every row count above the last regime's."""
        lib = load()
        if (lib is None or model.dtype not in (torch.bfloat16, torch.float32)
                or model.spec.qk_norm or not isinstance(model.ops, fused.NativeOps)
                or getattr(attention, "kernel", None) is None
                or attention.kernel.mode(model.dtype) is None):
            return None
        names = ("qkv", "o", "gate_up", "down")
        found = [[kernels_of(getattr(layer, n), model.dtype) for n in names]
                 for layer in model.layers]
        bounds = sorted({rows for layer in found for kernels in layer for _, _, rows in kernels})
        regimes = []
        for bound in bounds:  # the first kernel of each projection that reaches `bound`
            chosen = [[next((k for k in kernels if k[2] >= bound), None) for kernels in layer]
                      for layer in found]
            if any(None in layer for layer in chosen):
                break
            layers = [Layer(*(Proj(fn, w) for fn, w, _ in kernels), layer.input_norm.data_ptr(),
                            layer.post_norm.data_ptr(), attention.kernel.k[index],
                            attention.kernel.v[index])
                      for index, (layer, kernels) in enumerate(zip(model.layers, chosen,
                                                                   strict=True))]
            for made in layers:
                silu_on_tiles(made, model.spec.intermediate_size)
            regimes.append((bound, (Layer * len(layers))(*layers)))
        # A group of ~10 rows on the tiles dequantizes every weight for 10 rows,
        # not 64: grouped, 64-row decode steps took 1.23-1.37x the time of steps
        # layer by layer, 48-row ones 1.14-1.25x (bench/grouped_steps.py, Intel Xeon).
        tiles = any(getattr(layer, n).tiled is not None for layer in model.layers for n in names)
        return cls(lib, model, attention, regimes, grouped=not tiles) if regimes else None

    def takes(self, rows: int, attend) -> bool:
        return rows <= self.max_rows and attend is self.attention

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The tokens' embeddings through every layer and the final norm
        [rows, hidden], as LlamaModel._layers gives them; the attention's step
        arguments are this step's (attention.prepare). The embeddings are taken
        and the final norm made inside the layers' region, each group its own
        rows: as torch ops apart, each was a parallel region of its own whose
        start waited for the OpenMP thread the OS had lent to the tier."""
        rows = input_ids.shape[0]
        layers = next(layers for bound, layers in self.regimes if rows <= bound)
        slots, _rows, tables, width, lengths, block_size = self.attention.kernel.step_args
        step = Step(slots, tables, width, lengths, block_size)
        h, out = (torch.empty(rows, self.model.hidden, dtype=self.dtype) for _ in range(2))
        args = (ctypes.byref(self.model), layers, len(layers), ctypes.byref(step), rows,
                input_ids.data_ptr(), positions.data_ptr(), self.cos.data_ptr(),
                self.sin.data_ptr(), h.data_ptr(), out.data_ptr())
        starts = (row_groups(self.attention.meta.sequence_rows, torch.get_num_threads())
                  if self.grouped else None)
        if starts is None:
            self.run(*args)
        else:
            self.run_grouped(*args, (ctypes.c_int32 * len(starts))(*starts), len(starts) - 1)
        return out


@cache
def load() -> ctypes.CDLL | None:
    if fused.load() is None or paged.load() is None:
        return None
    I32 = native.I32
    return native.load(SOURCE, {"decode_layers": [P, P, I32, P, I32, P, P, P, P, P, P],
                                "decode_layers_grouped": [P, P, I32, P, I32, P, P, P, P, P, P,
                                                          P, I32]})


def build() -> Path:
    return native.build(SOURCE)
