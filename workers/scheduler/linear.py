# The projections of the forward pass. `Dense` is a plain matmul, through BLAS
# or through oneDNN on a weight packed once for its kernel. `Int4` also
# keeps a 4-bit copy of the weight (groups of 32 along the input, each with a
# scale and a minimum: GGUF's Q4_1 layout) that small batches read instead. A
# decode step of a few rows is bound by reading weights, and 4 bits are a
# quarter of bf16's bytes; a big batch is bound by compute, where the dense
# matmul wins.

from __future__ import annotations

import torch

GROUP = 32
# rows up to which the 4-bit kernel beats the dense matmul, by the dense dtype.
# Measured as whole engine steps on SmolLM2, one thread, on a host where fp32
# matmul is 1.7x bf16's: beside fp32, 4-bit steps take 33/60/109/188 ms at
# 4/8/16/24 rows, dense ones 69/99/120/143 ms. (A lone matmul whose weight stays
# in cache says ~6 rows: wrong, a step streams every weight from memory.)
# Beside fp32 through oneDNN, on an AMD host: 12 rows (4-bit 0.95x at 12, 1.08x at 16).
SMALL_BATCH = {torch.bfloat16: 32, torch.float32: 16}
SMALL_BATCH_ONEDNN = 12
LOSSLESS = 1e-3  # of a group's scale: the weight was 4- or 8-bit to begin with


class Dense:
    """`small(x)` (subclasses) runs batches up to `small_batch` rows from a
    narrower copy of the weight, in bf16: the 4-bit kernel is fast with bf16
    activations only (fp32: 40x slower, measured)."""

    small_batch = -1  # no narrower copy: every batch is dense

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype,
                 onednn: bool = False):
        """`weight` as stored, [out, in]. `onednn`: oneDNN's layout (CPU only);
        otherwise kept transposed so a projection is `x @ w`."""
        self.bias = None if bias is None else bias.to(dtype)
        self.onednn_weight = self.weight_t = None
        if onednn:
            self.onednn_weight = torch.ops.mkldnn._reorder_linear_weight(
                weight.to(dtype).contiguous(), 64)  # the row count it packs for: a hint only
        else:
            self.weight_t = weight.to(dtype).t().contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= self.small_batch:
            out = self.small(x.to(torch.bfloat16)).to(x.dtype)
            return out if self.bias is None else out + self.bias
        if self.onednn_weight is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.onednn_weight, self.bias,
                                                      "none", [], "")
        if self.bias is None:
            return x @ self.weight_t
        return torch.addmm(self.bias, x, self.weight_t)

    def small(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class Int4(Dense):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype,
                 levels: torch.Tensor, scales_zeros: torch.Tensor, onednn: bool = False):
        super().__init__(weight, bias, dtype, onednn)
        self.small_batch = SMALL_BATCH_ONEDNN if onednn else SMALL_BATCH.get(dtype, -1)
        self.packed = torch._convert_weight_to_int4pack_for_cpu(levels, 2)
        self.scales_zeros = scales_zeros.to(torch.bfloat16)

    def small(self, x: torch.Tensor) -> torch.Tensor:
        return torch._weight_int4pack_mm_for_cpu(x, self.packed, GROUP, self.scales_zeros)


class Int8(Dense):
    """8-bit levels in groups of 32 with a scale each (GGUF's Q8_0), split into
    high and low nibbles so the 4-bit kernel runs them: w = scale * (16 * hi +
    lo - 128) with hi, lo in [0, 15] is exact, and reads half of bf16's bytes."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype,
                 levels: torch.Tensor, scale: torch.Tensor, onednn: bool = False):
        super().__init__(weight, bias, dtype, onednn)
        self.small_batch = SMALL_BATCH_ONEDNN if onednn else SMALL_BATCH.get(dtype, -1)
        unsigned = levels + 128
        self.high = torch._convert_weight_to_int4pack_for_cpu(unsigned >> 4, 2)
        self.low = torch._convert_weight_to_int4pack_for_cpu(unsigned & 15, 2)
        # the kernel's (level - 8) * s + z: high gives 16 scale hi - 128 scale, low scale lo
        self.high_sz = torch.cat([16 * scale, torch.zeros_like(scale)], dim=-1).transpose(
            0, 1).contiguous().to(torch.bfloat16)
        self.low_sz = torch.cat([scale, 8 * scale], dim=-1).transpose(0, 1).contiguous().to(
            torch.bfloat16)

    def small(self, x: torch.Tensor) -> torch.Tensor:
        return (torch._weight_int4pack_mm_for_cpu(x, self.high, GROUP, self.high_sz)
                + torch._weight_int4pack_mm_for_cpu(x, self.low, GROUP, self.low_sz))


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
    return weight.dim() == 2 and weight.shape[1] % GROUP == 0 and weight.shape[0] % 16 == 0


def make_linear(weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype,
                mode: str, onednn: bool = False) -> Dense:
    """mode "lossless": 4 or 8 bits for small batches where the weight is exactly
    that already (a Q4_1 or Q8_0 GGUF); "int4": 4 bits whatever it loses;
    "none": dense. `onednn`: dense matmuls through oneDNN."""
    if mode == "none" or not can_int4(weight):
        return Dense(weight, bias, dtype, onednn)
    levels, scales_zeros, error = quantize_int4(weight)
    if mode == "int4" or error <= LOSSLESS:
        return Int4(weight, bias, dtype, levels, scales_zeros, onednn)
    levels, scale, error = quantize_int8(weight)
    if error <= LOSSLESS:
        return Int8(weight, bias, dtype, levels, scale, onednn)
    return Dense(weight, bias, dtype, onednn)
