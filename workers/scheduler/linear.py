# The projections of the forward pass. `Dense` is a plain matmul, through BLAS
# or through oneDNN on a weight packed once for its kernel. `Int4` also
# keeps a 4-bit copy of the weight (groups of 32 along the input, each with a
# scale and a minimum: GGUF's Q4_1 layout) that small batches read instead. A
# decode step of a few rows is bound by reading weights, and 4 bits are a
# quarter of bf16's bytes; a big batch is bound by compute, where the dense
# matmul wins. The 4-bit matmul is torch's kernel or ours (qgemm.py: AVX2 on
# fp32 activations, AVX-512 bf16 on bf16 ones; qgemm_amx.py on AMX tiles;
# qgemm_vnni.py on int8 activations, which serves batches of any size).

from __future__ import annotations

import sys
from dataclasses import dataclass, replace

import torch

from workers.scheduler import qgemm, qgemm_amx, qgemm_vnni

GROUP = 32
# rows a fine-activation weight (qkv) takes its fine kernels for; int8 beyond.
# Up to here a step streams its weights, so 14 bits cost little; beyond, the
# step is compute bound. Paired engine steps with qkv on int8 against qkv on the
# fine kernels (AMD Zen 4, one process): 1.0x at 1 row, 0.98x at 4, 0.95x at 8,
# 0.94x at 16, 0.93x at 32, 0.90x at 64
FINE_ROWS = 4
# oneDNN builds a kernel for each new row count (~5 ms for a 3072 x 576 bf16
# weight, measured: 4-5x the matmul at 500 rows) and keeps it, and serving's steps
# come in every count: its batches are padded to a multiple of this, a few kernels
# in all. torch's own bf16 matmul on a CPU runs on oneDNN too: unpadded, the 4
# projections at every count from 193 to 512 rows grew a process by 1.1 GiB, and
# by 0.6 more on a second pass through the same counts; padded, by 38 MiB (Intel Xeon)
ONEDNN_ROWS = 32
# rows AMX's tiles serve (in passes of 64, each dequantizing the weight again),
# the dense matmul beyond: engine steps through layers.c against oneDNN's in
# Python (Intel Xeon with AMX; the tiles' dequantization overlapped): 0.70x the
# time at 96 rows, 0.72x at 128, 0.69-0.90x at 160, 0.80-0.92x at 192, 0.89-1.06x
# at 256; the projections alone 0.60x at 64, 0.78x at 128, 1.09x at 192-512
TILE_ROWS = 192
# rows int8 activations serve beside the AMX tiles, which take over up to TILE_ROWS:
# paired engine steps, both through layers.c (Intel Xeon with AMX), the tiles'
# time over int8's 1.36x at 4 rows, 1.16x at 6-8, 1.05x at 10, 0.97x at 12,
# 0.82x at 16 (with the tiles' steps in Python it was 16, for 0.85x there)
VNNI_BESIDE_AMX = 10
LOSSLESS = 1e-3  # of a group's scale: the weight was 4- or 8-bit to begin with


@dataclass(frozen=True)
class Kernels:
    """Which matmuls run; the engine times the candidates on the host at hand."""
    onednn: bool = False  # dense through oneDNN on a packed weight rather than torch's matmul
    qgemm: bool = False  # 4- and 8-bit through qgemm.c rather than torch's kernel
    amx: bool = False  # 4- and 8-bit on bf16 activations through qgemm_amx.c
    vnni: bool = False  # 4- and 8-bit on int8 activations through qgemm_vnni.c
    # (with amx too: up to VNNI_BESIDE_AMX rows, the tiles beyond)
    fine: bool = False  # with vnni: its fine kernels (14-bit activations) up to FINE_ROWS
    # bf16 batches past the narrow copy's reach on AMX's tiles (qgemm_amx.c's
    # dense_gemm_amx) rather than oneDNN's matmul; layers.c then runs every step
    dense_tiles: bool = False

    def small_batch(self, dtype: torch.dtype) -> int:
        """Rows up to which the 4-bit path beats the dense matmul, measured as
        whole engine steps on SmolLM2 (a lone matmul whose weight stays in cache
        misleads: a step streams every weight from memory).
        - torch's kernel beside MKL fp32, on a host where fp32 is 1.7x bf16: 16
          rows (4-bit 33/60/109 ms at 4/8/16 rows, dense 69/99/120); beside bf16, 32.
        - torch's kernel beside oneDNN fp32 (AMD, AVX2): 12 (0.95x at 12, 1.08x at 16);
          beside oneDNN bf16 (AMD Zen 5, avx512_bf16): 10 (0.63x at 1 row, 0.93x
          at 8, 1.14x at 12).
        - qgemm beside oneDNN fp32 (same host): 40 (its step time 0.72x oneDNN's
          at 8 and 16 rows, 0.85x at 24, 0.91x at 32, 1.01x at 48, 1.09x at 64).
        - qgemm_bf16.c beside oneDNN bf16 (Zen 5): 12 (0.98x at 12 rows, 1.15x at
          16; against torch's 4-bit kernel 0.89x at 1 row, 0.84x at 4, 0.79x at 8).
        - qgemm_amx.c beside oneDNN bf16 (Intel Xeon with AMX): TILE_ROWS (all 30
          layers' weights, streamed: 0.34x oneDNN's time at 1 row, 0.46x at 16,
          0.55x at 32, 0.69x at 64 before its dequantization overlapped the tiles;
          after, 0.60x at 64 and 0.78x at 128 rows).
        - qgemm_vnni.c beside oneDNN bf16 (AMD Zen 4): every batch (0.25-0.3x at
          1 row, 0.5-0.65x at 16, 0.7x at 64, 0.72-0.78x at 128-512), so the
          weight keeps no dense copy.
        - its fine kernels (qkv) serve up to FINE_ROWS, the int8 ones beyond:
          every batch too (the fine ones beside oneDNN bf16, AMD Zen 5: 0.33x at
          1 row, 0.77x at 16, 1.14x at 64, 1.3-1.5x at 128-512).
        - qgemm_vnni.c beside qgemm_amx.c (Intel Xeon with AMX): the tiles'
          TILE_ROWS, of which int8 serves the first VNNI_BESIDE_AMX rows."""
        if self.amx and dtype == torch.bfloat16:
            return TILE_ROWS
        if self.vnni and qgemm_vnni.takes(dtype):
            return sys.maxsize
        if self.qgemm:
            return 40 if dtype == torch.float32 else 12
        if self.onednn:
            return 12 if dtype == torch.float32 else 10
        return {torch.bfloat16: 32, torch.float32: 16}.get(dtype, -1)

    def names(self) -> dict[str, str]:
        """The 4-bit matmul and activations `pipeline status` shows."""
        if self.vnni:  # vnni | avx2; beside AMX's tiles, whose rows keep exact activations
            suffix = qgemm_vnni.library()[1]
            if self.amx:
                return {"4bit_matmul": suffix + "+amx",
                        "activations": f"int8 up to {VNNI_BESIDE_AMX} rows"}
            return {"4bit_matmul": suffix, "activations": "int8"}
        matmul = "amx" if self.amx else "qgemm" if self.qgemm else "torch"
        return {"4bit_matmul": matmul, "activations": "exact"}


PLAIN = Kernels()  # torch's own matmuls


class Dense:
    """`small(x)` (subclasses) runs batches up to `small_batch` rows from a
    narrower copy of the weight."""

    small_batch = -1  # no narrower copy: every batch is dense
    vnni_rows = -1  # rows the int8 blocks serve, where the weight has them
    fine_rows = -1  # rows of those the fine kernels take (14-bit activations), where set
    qgemm: qgemm.Packed | None = None  # the narrow copy in one of our kernels' layouts
    tiled: qgemm_amx.Tiled | None = None
    vnni: qgemm_vnni.Blocked | None = None
    vnni_fine: qgemm_vnni.Blocked | None = None  # the same blocks on the fine kernels
    tiles_weight: torch.Tensor | None = None  # the dense copy in AMX's lanes (qgemm_amx)

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype,
                 kernels: Kernels = PLAIN, dense: bool = True):
        """`weight` as stored, [out, in]: in oneDNN's layout, or kept transposed
        so a projection is `x @ w`; no dense copy unless `dense` (a narrow copy
        that serves every batch)."""
        self.bias = None if bias is None else bias.to(dtype)
        self.onednn_weight = self.weight_t = None
        if not dense:
            return
        if uses_dense_tiles(kernels, dtype, weight):
            self.tiles_weight = qgemm_amx.pack_dense(weight)
        elif kernels.onednn:
            self.onednn_weight = torch.ops.mkldnn._reorder_linear_weight(
                weight.to(dtype).contiguous(), 64)  # the row count it packs for: a hint only
        else:
            self.weight_t = weight.to(dtype).t().contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= self.small_batch:
            out = self.small(x).to(x.dtype)
            return out if self.bias is None else out + self.bias
        if self.tiles_weight is not None:  # any row count: no kernel is built for it
            out = qgemm_amx.dense_matmul(x, self.tiles_weight, 16 * self.tiles_weight.shape[0])
            return out if self.bias is None else out + self.bias
        rows = x.shape[0]
        # oneDNN's, ours or under torch's bf16 matmul, keeps a kernel per row count;
        # torch's fp32 matmul runs on MKL's sgemm, which keeps nothing
        if self.onednn_weight is not None or (x.is_cpu and x.dtype != torch.float32):
            padded = -(-rows // ONEDNN_ROWS) * ONEDNN_ROWS
            if padded != rows:
                x = torch.cat([x, x.new_zeros(padded - rows, x.shape[1])])
        if self.onednn_weight is not None:
            out = torch.ops.mkldnn._linear_pointwise(x, self.onednn_weight, self.bias,
                                                     "none", [], "")
        elif self.bias is None:
            out = x @ self.weight_t
        else:
            out = torch.addmm(self.bias, x, self.weight_t)
        return out[:rows]

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """fp32 x @ w.T, for the lm_head: the small batches' kernels write fp32
        themselves (64 x 49152 logits: no bf16 rounding, no conversion pass)."""
        if x.shape[0] <= self.small_batch:
            out = self.small(x.float())
            return out.float() if self.bias is None else out.float() + self.bias
        return self(x).float()

    def greedy(self, x: torch.Tensor) -> torch.Tensor | None:
        """argmax(logits(x), -1) where AMX's tiles or the 8-bit VNNI kernel serve
        x's rows: the largest output of each row found as the kernel makes them,
        the logits never written; else None (the caller takes `logits`)."""
        rows = x.shape[0]
        if self.bias is not None:
            return None
        if self.tiled is not None and self.vnni_rows < rows <= self.small_batch:
            return qgemm_amx.argmax(x, self.tiled)
        if (self.vnni is not None and qgemm_vnni.takes_argmax(self.vnni)
                and self.fine_rows < rows <= self.vnni_rows):
            return qgemm_vnni.argmax(x, self.vnni)
        return None

    @staticmethod
    def keeps_dense(kernels: Kernels, dtype: torch.dtype, weight: torch.Tensor) -> bool:
        """Whether batches past the narrow copy's reach need a dense copy."""
        return not uses_vnni(kernels, dtype, weight) or uses_amx(kernels, dtype, weight)

    def _small_kernels(self, kernels: Kernels, dtype: torch.dtype,
                       weight: torch.Tensor) -> Kernels:
        """The kernels this weight's narrow copy runs on (AMX only where it
        fits), and the batch they serve up to."""
        self.qgemm = self.tiled = self.vnni = self.vnni_fine = None
        kernels = replace(kernels, amx=uses_amx(kernels, dtype, weight),
                          vnni=uses_vnni(kernels, dtype, weight))
        self.small_batch = kernels.small_batch(dtype)
        self.vnni_rows = (-1 if not kernels.vnni else VNNI_BESIDE_AMX if kernels.amx
                          else self.small_batch)
        self.fine_rows = min(FINE_ROWS, self.vnni_rows) if kernels.fine else -1
        return kernels

    def _with_vnni(self, blocked: qgemm_vnni.Blocked) -> None:
        self.vnni = blocked
        if self.fine_rows > 0:
            self.vnni_fine = qgemm_vnni.fine(blocked)

    def small(self, x: torch.Tensor) -> torch.Tensor:
        if self.vnni_fine is not None and x.shape[0] <= self.fine_rows:
            return qgemm_vnni.matmul(x, self.vnni_fine)
        if self.vnni is not None and x.shape[0] <= self.vnni_rows:
            return qgemm_vnni.matmul(x, self.vnni)
        if self.tiled is not None:
            return qgemm_amx.matmul(x, self.tiled)
        if self.qgemm is not None:
            return qgemm.matmul(x, self.qgemm)
        return self.small_torch(x)

    def small_torch(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class Int4(Dense):
    """torch's 4-bit kernel is fast with bf16 activations only (fp32: 40x
    slower, measured); qgemm takes fp32."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype,
                 levels: torch.Tensor, scales_zeros: torch.Tensor,
                 kernels: Kernels = PLAIN):
        super().__init__(weight, bias, dtype, kernels, self.keeps_dense(kernels, dtype, weight))
        kernels = self._small_kernels(kernels, dtype, weight)
        scale, zero = scales_zeros[..., 0].t(), scales_zeros[..., 1].t()
        if kernels.vnni or kernels.amx:  # either or both (int8 up to VNNI_BESIDE_AMX rows)
            if kernels.vnni:
                self._with_vnni(qgemm_vnni.pack_q4(levels, scale, zero - 8 * scale))
            if kernels.amx:
                self.tiled = qgemm_amx.pack_q4(levels, scale, zero - 8 * scale)
        elif kernels.qgemm:
            self.qgemm = qgemm.pack_q4(levels, scales_zeros, qgemm.blocked_for(dtype))
        else:
            self.packed = torch._convert_weight_to_int4pack_for_cpu(levels, 2)
            self.scales_zeros = scales_zeros.to(torch.bfloat16)

    def small_torch(self, x: torch.Tensor) -> torch.Tensor:
        return torch._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), self.packed, GROUP,
                                                 self.scales_zeros)


class Int8(Dense):
    """8-bit levels in groups of 32 with a scale each (GGUF's Q8_0). qgemm runs
    them as they are; for torch's 4-bit kernel they are split into high and low
    nibbles: w = scale * (16 * hi + lo - 128) with hi, lo in [0, 15] is exact,
    and reads half of bf16's bytes."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype,
                 levels: torch.Tensor, scale: torch.Tensor, kernels: Kernels = PLAIN):
        super().__init__(weight, bias, dtype, kernels, self.keeps_dense(kernels, dtype, weight))
        kernels = self._small_kernels(kernels, dtype, weight)
        if kernels.vnni:
            self._with_vnni(qgemm_vnni.pack_q8(levels, scale.reshape(levels.shape[0], -1)))
        if kernels.amx:
            self.tiled = qgemm_amx.pack_q8(levels, scale.reshape(levels.shape[0], -1))
        if kernels.vnni or kernels.amx:
            return
        if kernels.qgemm:
            self.qgemm = qgemm.pack_q8(levels, scale, qgemm.blocked_for(dtype))
            return
        unsigned = levels + 128
        self.high = torch._convert_weight_to_int4pack_for_cpu(unsigned >> 4, 2)
        self.low = torch._convert_weight_to_int4pack_for_cpu(unsigned & 15, 2)
        # the kernel's (level - 8) * s + z: high gives 16 scale hi - 128 scale, low scale lo
        self.high_sz = torch.cat([16 * scale, torch.zeros_like(scale)], dim=-1).transpose(
            0, 1).contiguous().to(torch.bfloat16)
        self.low_sz = torch.cat([scale, 8 * scale], dim=-1).transpose(0, 1).contiguous().to(
            torch.bfloat16)

    def small_torch(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(torch.bfloat16)
        return (torch._weight_int4pack_mm_for_cpu(x, self.high, GROUP, self.high_sz)
                + torch._weight_int4pack_mm_for_cpu(x, self.low, GROUP, self.low_sz))


def uses_amx(kernels: Kernels, dtype: torch.dtype, weight: torch.Tensor) -> bool:
    return (kernels.amx and dtype == torch.bfloat16
            and qgemm_amx.fits(*weight.shape) and qgemm_amx.load() is not None)


def uses_dense_tiles(kernels: Kernels, dtype: torch.dtype, weight: torch.Tensor) -> bool:
    return (kernels.dense_tiles and dtype == torch.bfloat16
            and qgemm_amx.fits_dense(*weight.shape) and qgemm_amx.load() is not None)


def uses_vnni(kernels: Kernels, dtype: torch.dtype, weight: torch.Tensor) -> bool:
    return kernels.vnni and qgemm_vnni.fits(*weight.shape) and qgemm_vnni.takes(dtype)


def on_grid(exact: torch.Tensor, low: int, high: int) -> tuple[torch.Tensor, float]:
    """Nearest integer levels in [low, high], and the worst distance to them."""
    levels = exact.round().clamp(low, high)
    return levels, (exact - levels).abs().max().item()


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float]:
    """[out, in] -> levels (int32 in [-127, 127], [out, in]), scales
    ([out, in / GROUP, 1]) and the worst error as a fraction of its group's scale."""
    out_dim, in_dim = weight.shape
    groups = weight.float().reshape(out_dim, in_dim // GROUP, GROUP)
    scale = (groups.abs().amax(-1, keepdim=True) / 127).clamp(min=1e-12)
    levels, error = on_grid(groups / scale, -127, 127)
    return levels.to(torch.int32).reshape(out_dim, in_dim), scale, error


def quantize_int4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float]:
    """[out, in] -> levels (int32 in [0, 15], [out, in]), scales and zeros
    ([in / GROUP, out, 2], the kernel's layout: w = (level - 8) * scale + zero)
    and the worst error as a fraction of its group's scale."""
    out_dim, in_dim = weight.shape
    groups = weight.float().reshape(out_dim, in_dim // GROUP, GROUP)
    low = groups.amin(-1, keepdim=True)
    scale = ((groups.amax(-1, keepdim=True) - low) / 15).clamp(min=1e-12)
    levels, error = on_grid((groups - low) / scale, 0, 15)
    scales_zeros = torch.cat([scale, low + 8 * scale], dim=-1).transpose(0, 1).contiguous()
    return levels.to(torch.int32).reshape(out_dim, in_dim), scales_zeros, error


def can_int4(weight: torch.Tensor) -> bool:
    """Shapes both 4-bit kernels take."""
    return weight.dim() == 2 and weight.shape[1] % GROUP == 0 and weight.shape[0] % 16 == 0


def make_linear(weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype,
                mode: str, kernels: Kernels = PLAIN) -> Dense:
    """mode "lossless": 4 or 8 bits for small batches where the weight is exactly
    that already (a Q4_1 or Q8_0 GGUF); "int4": 4 bits whatever it loses;
    "none": dense."""
    if mode == "none" or not can_int4(weight):
        return Dense(weight, bias, dtype, kernels)
    levels, scales_zeros, error = quantize_int4(weight)
    if mode == "int4" or error <= LOSSLESS:
        return Int4(weight, bias, dtype, levels, scales_zeros, kernels)
    levels, scale, error = quantize_int8(weight)
    if error <= LOSSLESS:
        return Int8(weight, bias, dtype, levels, scale, kernels)
    return Dense(weight, bias, dtype, kernels)
