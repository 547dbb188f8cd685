"""qgemm_vnni.c: the checkpoint's 4- and 8-bit weights on int8 activations (and,
in its fine kernels, 14-bit ones). The kernel's answer is held to the same sum
computed here in fp64 (activations rounded per row and group of 32 as the
kernel rounds them), and to the exact bf16 matmul within the rounding of the
activations; and to the choice of kernels that `--activations` makes."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from pipeline.errors import ConfigError
from workers.scheduler import qgemm_vnni
from workers.scheduler.calibrate import choose_kernels
from workers.scheduler.linear import Int4, Int8, Kernels, make_linear
from workers.scheduler.model import read_spec

needs_vnni = pytest.mark.skipif(qgemm_vnni.load() is None,
                                reason="no avx512_vnni CPU or no C compiler")


@pytest.fixture(scope="module")
def checkpoint(model_files):
    path = next(model_files.path.glob("*.safetensors"))
    with safe_open(str(path), framework="pt") as f:
        return {name: f.get_tensor(name) for name in (
            "model.layers.7.mlp.down_proj.weight", "model.embed_tokens.weight")}


def int8_groups(x: torch.Tensor, top: float = 127.0) -> torch.Tensor:
    """x rounded as the kernel rounds it: per row and group of 32, to
    round(x * (top / max|x|)) levels of max|x| / top (fp32 steps, ties to even);
    top 127 for int8, 127 * 128 for the fine kernels."""
    rows, in_dim = x.shape
    groups = x.float().reshape(rows, in_dim // 32, 32)
    amax = groups.abs().amax(-1, keepdim=True)
    # tensor / tensor: correctly rounded (127.0 / tensor may be off by an ulp)
    inverse = torch.where(amax > 0, torch.full_like(amax, top) / amax, torch.zeros_like(amax))
    levels = torch.round(groups * inverse)
    return (levels.double() * (amax / top).double()).reshape(rows, in_dim)


def relative_error(mine: torch.Tensor, theirs: torch.Tensor) -> float:
    return ((mine.double() - theirs.double()).norm() / theirs.double().norm()).item()


@needs_vnni
def test_vnni_sums_int8_activations_exactly(checkpoint):
    """Every row-block shape (1-12 rows, blocks split evenly past 12), 4- and
    8-bit, fp32 and bf16 answers."""
    generator = torch.Generator().manual_seed(0)
    down = checkpoint["model.layers.7.mlp.down_proj.weight"]  # Q4_1
    embed = checkpoint["model.embed_tokens.weight"][:1024]  # Q8_0
    for weight, kind in ((down, Int4), (embed, Int8)):
        linear = make_linear(weight, None, torch.bfloat16, "lossless", Kernels(vnni=True))
        assert type(linear) is kind and linear.vnni is not None
        exact = weight.double().t()
        for rows in (1, 2, 5, 12, 13, 16, 25, 64):
            x = torch.randn(rows, weight.shape[1], generator=generator).bfloat16()
            x[0, :32] = 0.0  # a group of zeros: scale 0, no NaN
            out = qgemm_vnni.matmul(x.float(), linear.vnni)
            assert out.shape == (rows, weight.shape[0]) and out.dtype == torch.float32
            # integer dots are exact; what is left is fp32 rounding of the scaled sums
            assert relative_error(out, int8_groups(x) @ exact) < 1e-5
            # int8 activations move the answer by ~0.5% from the exact bf16 one
            assert relative_error(out, x.double() @ exact) < 2e-2
            rounded = qgemm_vnni.matmul(x, linear.vnni)  # bf16 in, bf16 out
            assert rounded.dtype == torch.bfloat16 and torch.equal(rounded, out.bfloat16())


@needs_vnni
def test_fine_kernels_sum_14_bit_activations_exactly(checkpoint):
    """The fine kernels' two int8 parts of each 14-bit level add up exactly:
    the answer is the fp64 sum over x rounded to 14 bits, and within a
    twentieth of int8's distance of the exact one."""
    generator = torch.Generator().manual_seed(1)
    down = checkpoint["model.layers.7.mlp.down_proj.weight"]  # Q4_1
    embed = checkpoint["model.embed_tokens.weight"][:1024]  # Q8_0
    for weight, kind in ((down, Int4), (embed, Int8)):
        linear = make_linear(weight, None, torch.bfloat16, "lossless",
                             Kernels(vnni=True, fine=True))
        assert type(linear) is kind and linear.vnni is not None
        exact = weight.double().t()
        for rows in (1, 3, 12, 17, 64):
            x = torch.randn(rows, weight.shape[1], generator=generator).bfloat16()
            x[0, :32] = 0.0
            x[-1, 32:64] *= 1000.0  # a group with one large scale among small ones
            out = qgemm_vnni.matmul(x.float(), linear.vnni)
            assert relative_error(out, int8_groups(x, 127.0 * 128) @ exact) < 1e-5
            fine_error = relative_error(out, x.double() @ exact)
            assert fine_error < 1e-3
            assert fine_error < relative_error(int8_groups(x) @ exact, x.double() @ exact) / 20


@needs_vnni
def test_fine_weights_serve_up_to_64_rows_then_dense(checkpoint):
    down = checkpoint["model.layers.7.mlp.down_proj.weight"]
    linear = make_linear(down, None, torch.bfloat16, "lossless",
                         Kernels(onednn=True, vnni=True, fine=True))
    assert linear.vnni is not None and linear.small_batch == 64
    assert linear.onednn_weight is not None  # prefills past 64 rows run oneDNN's bf16
    x = torch.randn(65, down.shape[1]).bfloat16()
    assert relative_error(linear(x), x.double() @ down.double().t()) < 1e-2


@needs_vnni
def test_vnni_weights_serve_every_batch_without_a_dense_copy(checkpoint):
    down = checkpoint["model.layers.7.mlp.down_proj.weight"]
    linear = make_linear(down, None, torch.bfloat16, "lossless", Kernels(onednn=True, vnni=True))
    assert linear.onednn_weight is None and linear.weight_t is None
    x = torch.randn(600, down.shape[1]).bfloat16()  # a prefill's rows
    assert relative_error(linear(x), x.double() @ down.double().t()) < 2e-2
    # fp32 models keep exact activations: the vnni flag does not apply to them
    fp32 = make_linear(down, None, torch.float32, "lossless", Kernels(onednn=True, vnni=True))
    assert fp32.vnni is None and fp32.onednn_weight is not None


def test_activations_option_chooses_the_kernels(model_files):
    spec, cpu = read_spec(model_files.path), torch.device("cpu")
    with pytest.raises(ConfigError):
        choose_kernels(cpu, torch.bfloat16, spec, True, "int4")
    assert not choose_kernels(cpu, torch.bfloat16, spec, True, "exact").vnni
    assert not choose_kernels(cpu, torch.bfloat16, spec, False, "auto").vnni  # no 4-bit weights
    if qgemm_vnni.load() is None:
        with pytest.raises(ConfigError):
            choose_kernels(cpu, torch.bfloat16, spec, True, "int8")
    else:
        assert choose_kernels(cpu, torch.bfloat16, spec, True, "int8").vnni
    with pytest.raises(ConfigError):  # int8 activations need a bf16 model
        choose_kernels(cpu, torch.float32, spec, True, "int8")
