"""ops.c against the torch ops it replaces, in bf16 and fp32."""

import pytest
import torch

from workers.scheduler import fused, native
from workers.scheduler.fused import NativeOps, TorchOps

pytestmark = pytest.mark.skipif(fused.load() is None, reason="no AVX2 CPU or no C compiler")
DTYPES = [torch.float32, torch.bfloat16]
ULP = {torch.float32: 1e-5, torch.bfloat16: 2 ** -7}  # relative: a rounding or two


def close(mine: torch.Tensor, theirs: torch.Tensor, dtype: torch.dtype,
          floor: float = 1e-2) -> bool:
    """Within two roundings of each other, relative to |theirs| or `floor`."""
    assert mine.dtype == theirs.dtype == dtype and mine.shape == theirs.shape
    error = (mine.float() - theirs.float()).abs() / theirs.float().abs().clamp(min=floor)
    return error.max().item() <= 2 * ULP[dtype]


def randn(*shape, dtype, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def implementations(dtype: torch.dtype) -> tuple[NativeOps, TorchOps]:
    return NativeOps(fused.load(), dtype), TorchOps()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 33])
def test_add_rms_norm_updates_the_residual_and_normalizes(dtype, rows):
    ops = implementations(dtype)
    h, delta, weight = randn(rows, 576, dtype=dtype), randn(rows, 576, dtype=dtype, seed=1), \
        randn(576, dtype=dtype, seed=2)
    outputs, residuals = [], []
    for impl in ops:
        residual = h.clone()
        outputs.append(impl.add_rms_norm(residual, delta, weight, 1e-5))
        residuals.append(residual)
    assert torch.equal(*residuals)  # one rounding of the same sum
    assert close(*outputs, dtype)
    assert close(ops[0].add_rms_norm(h.clone(), None, weight, 1e-5),
                 ops[1].add_rms_norm(h.clone(), None, weight, 1e-5), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_turns_q_and_k_in_place_within_the_qkv_rows(dtype):
    ops = implementations(dtype)
    cos, sin = randn(100, 64, dtype=dtype, seed=1), randn(100, 64, dtype=dtype, seed=2)
    cos, sin = torch.cat([cos[:, :32]] * 2, -1), torch.cat([sin[:, :32]] * 2, -1)  # as tables are
    positions = torch.tensor([0, 7, 99, 3, 3])
    turned = []
    for impl in ops:
        qkv = randn(5, 15 * 64, dtype=dtype)
        qk = qkv[:, :12 * 64].view(5, 12, 64)  # rows 15 heads apart, v untouched
        impl.rope_(qk, positions, cos, sin)
        turned.append(qkv)
    assert torch.equal(turned[0][:, 12 * 64:], randn(5, 15 * 64, dtype=dtype)[:, 12 * 64:])
    # torch rounds a cos and b sin before their sum, ours once after: near a
    # cancellation the two differ by a rounding of the terms, not of the result
    assert close(*turned, dtype, floor=4.0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 20])
def test_silu_mul_matches_torch_over_a_wide_range(dtype, rows):
    ops = implementations(dtype)
    gate_up = 8 * randn(rows, 2 * 1539, dtype=dtype)  # not a multiple of 8: the tail too
    assert close(*(impl.silu_mul(gate_up) for impl in ops), dtype)


@pytest.mark.skipif(not native.NEEDS_AVX512 <= native.cpu_flags() or fused.load() is None,
                    reason="no AVX-512 CPU or no C compiler")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_avx512_build_matches_the_avx2_one(dtype):
    """The same e^x steps 16 lanes at a time: silu is bit for bit; the norm's
    sum of squares may add in another order."""
    generator = torch.Generator().manual_seed(0)
    wide, narrow = (NativeOps(lib, dtype) for lib in (
        fused.load(), native.load(fused.SOURCE, fused.SIGNATURES)))
    gate_up = (8 * torch.randn(64, 2 * 1536 + 6, generator=generator)).to(dtype)  # and a tail
    assert torch.equal(wide.silu_mul(gate_up), narrow.silu_mul(gate_up))
    h, delta = (torch.randn(64, 576, generator=generator).to(dtype) for _ in range(2))
    weight = torch.rand(576, generator=generator).to(dtype)
    outs = [ops.add_rms_norm(h.clone(), delta, weight, 1e-5) for ops in (wide, narrow)]
    assert (outs[0].float() - outs[1].float()).abs().max().item() <= 2e-2


@pytest.mark.parametrize("width", [7, 16, 49152 + 5])  # a tail only, one vector, vectors + tail
def test_argmax_rows_is_torchs_argmax_in_either_build(width):
    """The first of equal maxima, with ties and -inf rows, in the AVX-512 build
    (where the CPU has it) and the AVX2 one."""
    generator = torch.Generator().manual_seed(0)
    logits = torch.randint(0, 30, (9, width), generator=generator).float()  # many ties
    logits[1] = float("-inf")
    logits[2, -1] = 100.0  # the best in the tail
    logits[3] = 0.0
    for lib in {fused.load(), native.load(fused.SOURCE, fused.SIGNATURES)}:
        out = torch.empty(9, dtype=torch.long)
        lib.argmax_rows(logits.data_ptr(), 9, width, out.data_ptr())
        assert torch.equal(out, logits.argmax(-1))
