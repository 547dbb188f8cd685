"""The projections: 4- and 8-bit weights reproduce a checkpoint that was 4- or
8-bit already (SmolLM2's GGUF is Q4_1 with a Q8_0 embedding), a dense
checkpoint stays dense unless asked, and big batches take the dense matmul."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open

from pipeline.errors import ConfigError
from workers.scheduler import fused, qgemm, qgemm_amx, qgemm_vnni
from workers.scheduler.calibrate import onednn_takes
from workers.scheduler.engine import resolve_dtype, resolve_quantization
from workers.scheduler.fused import NativeOps
from workers.scheduler.linear import (
    ONEDNN_ROWS,
    PLAIN,
    TILE_ROWS,
    VNNI_BESIDE_AMX,
    Dense,
    Int4,
    Int8,
    Kernels,
    make_linear,
    quantize_int4,
    quantize_int8,
)


@pytest.fixture(scope="module")
def checkpoint(model_files):
    path = next(model_files.path.glob("*.safetensors"))
    with safe_open(str(path), framework="pt") as f:
        return {name: f.get_tensor(name) for name in (
            "model.layers.0.self_attn.q_proj.weight", "model.layers.7.mlp.down_proj.weight",
            "model.layers.7.mlp.gate_proj.weight", "model.layers.7.mlp.up_proj.weight",
            "model.embed_tokens.weight")}


def relative_error(mine: torch.Tensor, theirs: torch.Tensor) -> float:
    return ((mine.float() - theirs).norm() / theirs.norm()).item()


def test_q4_1_weights_requantize_exactly(checkpoint):
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.7.mlp.down_proj.weight"):
        weight = checkpoint[name]
        levels, scales_zeros, error = quantize_int4(weight)
        assert error < 1e-3  # every weight sits on its group's 16-level grid
        scale, zero = scales_zeros[..., 0].t(), scales_zeros[..., 1].t()  # [out, groups]
        groups = (levels.float().reshape(*scale.shape, -1) - 8) * scale[..., None]
        rebuilt = (groups + zero[..., None]).reshape(weight.shape)
        assert (rebuilt - weight).abs().max().item() < 1e-5 * weight.abs().max().item()


def test_q8_0_embedding_requantizes_exactly_and_not_as_4_bit(checkpoint):
    weight = checkpoint["model.embed_tokens.weight"]
    assert quantize_int4(weight)[2] > 0.1
    levels, scale, error = quantize_int8(weight)
    assert error < 1e-3
    rebuilt = (levels.float().reshape(*scale.shape[:2], -1) * scale).reshape(weight.shape)
    assert (rebuilt - weight).abs().max().item() < 1e-5 * weight.abs().max().item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_lossless_mode_picks_the_checkpoints_own_width(checkpoint, dtype):
    generator = torch.Generator().manual_seed(0)
    for name, kind in (("model.layers.7.mlp.down_proj.weight", Int4),
                       ("model.embed_tokens.weight", Int8)):
        weight = checkpoint[name]
        linear = make_linear(weight, None, dtype, "lossless")
        assert type(linear) is kind
        for rows in (1, PLAIN.small_batch(dtype), PLAIN.small_batch(dtype) + 1):
            x = torch.randn(rows, weight.shape[1], generator=generator).to(dtype)
            out = linear(x)
            assert out.dtype == dtype and out.shape == (rows, weight.shape[0])
            # bf16 activations in the kernel: bf16-sized error, not quantization-sized
            assert relative_error(out, x.float() @ weight.t()) < 1e-2


def test_dense_checkpoints_stay_dense_unless_int4_is_asked():
    generator = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(64, 128, generator=generator), torch.randn(64, generator=generator)
    assert type(make_linear(weight, bias, torch.bfloat16, "lossless")) is Dense
    assert type(make_linear(weight, bias, torch.bfloat16, "none")) is Dense
    forced = make_linear(weight, bias, torch.bfloat16, "int4")
    assert type(forced) is Int4
    x = torch.randn(4, 128, generator=generator)
    exact = x @ weight.t() + bias
    error = relative_error(forced(x.bfloat16()), exact)
    assert 1e-3 < error < 0.1  # 4 bits of a gaussian weight: lossy, but close
    assert relative_error(forced(torch.cat([x] * 16).bfloat16())[:4], exact) < 1e-2  # dense


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch without oneDNN")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_onednn_dense_matches_the_plain_matmul(checkpoint, dtype):
    if not onednn_takes(dtype):
        pytest.skip(f"oneDNN packs no {dtype} weights on this CPU")
    generator = torch.Generator().manual_seed(0)
    weight = checkpoint["model.layers.0.self_attn.q_proj.weight"]
    bias = torch.randn(weight.shape[0], generator=generator)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2  # bf16 outputs: 8 bits of mantissa
    for b in (None, bias):
        plain = Dense(weight, b, dtype)
        onednn = Dense(weight, b, dtype, Kernels(onednn=True))
        for rows in (1, 70):
            x = torch.randn(rows, 2 * weight.shape[1], generator=generator)[:, ::2]  # strided
            out = onednn(x.to(dtype))
            assert out.dtype == dtype
            assert relative_error(out.float(), plain(x.to(dtype)).float()) < tolerance
    quantized = make_linear(weight, None, torch.float32, "lossless", Kernels(onednn=True))
    assert type(quantized) is Int4 and quantized.small_batch < PLAIN.small_batch(torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_onednn_rows_are_padded_to_a_few_kernels(checkpoint, dtype):
    """Serving's steps come in every row count, and oneDNN builds a kernel for
    each new one: rows are padded to a multiple of ONEDNN_ROWS, so a row's
    answer is the one it gets in the full multiple."""
    if not onednn_takes(dtype):
        pytest.skip(f"oneDNN packs no {dtype} weights on this CPU")
    weight = checkpoint["model.layers.0.self_attn.q_proj.weight"]
    onednn = Dense(weight, None, dtype, Kernels(onednn=True))
    x = torch.randn(2 * ONEDNN_ROWS, weight.shape[1]).to(dtype)
    full = onednn(x)
    for rows in (ONEDNN_ROWS + 1, 2 * ONEDNN_ROWS - 1):
        out = onednn(x[:rows])
        assert out.shape == (rows, weight.shape[0]) and out.is_contiguous()
        assert torch.equal(out, full[:rows])


needs_qgemm = pytest.mark.skipif(qgemm.load() is None, reason="no AVX2 CPU or no C compiler")


@needs_qgemm
def test_qgemm_is_exact_on_4_and_8_bit_weights(checkpoint):
    """fp32 products of the exact dequantized weight, for every tile shape the
    kernel has (1-3 rows, blocks of 4 and of 8, and what is left over)."""
    generator = torch.Generator().manual_seed(0)
    down = checkpoint["model.layers.7.mlp.down_proj.weight"]
    embed = checkpoint["model.embed_tokens.weight"][:1024]
    for weight, quantize, pack in ((down, quantize_int4, qgemm.pack_q4),
                                   (embed, quantize_int8, qgemm.pack_q8)):
        packed = pack(*quantize(weight)[:2])
        for rows in (1, 2, 3, 4, 7, 8, 13, 64):
            x = torch.randn(rows, weight.shape[1], generator=generator)
            out = qgemm.matmul(x, packed)
            assert out.shape == (rows, weight.shape[0])
            assert relative_error(out, x @ weight.float().t()) < 1e-5


@pytest.mark.skipif(qgemm.load_bf16() is None, reason="no avx512_bf16 CPU or no C compiler")
def test_qgemm_bf16_is_exact_on_bf16_activations(checkpoint):
    """The blocked kernels: fp32 sums of bf16 activations times the exact weight,
    at every tile shape (1-3 rows, blocks of 4, what is left over)."""
    generator = torch.Generator().manual_seed(0)
    down = checkpoint["model.layers.7.mlp.down_proj.weight"]
    embed = checkpoint["model.embed_tokens.weight"][:1024]
    for weight, quantize, pack in ((down, quantize_int4, qgemm.pack_q4),
                                   (embed, quantize_int8, qgemm.pack_q8)):
        packed = pack(*quantize(weight)[:2], blocked=True)
        for rows in (1, 2, 3, 4, 7, 13):
            # fp32 holding bf16 values: the kernel reads them exactly, answers in fp32
            x = torch.randn(rows, weight.shape[1], generator=generator).bfloat16().float()
            out = qgemm.matmul(x, packed)
            assert out.shape == (rows, weight.shape[0]) and out.dtype == torch.float32
            # levels read as 128 + q: the sum loses a few of fp32's 24 bits, not bf16's 8
            assert relative_error(out, x @ weight.float().t()) < 1e-5
            rounded = qgemm.matmul(x.bfloat16(), packed)  # bf16 in, bf16 out
            assert rounded.dtype == torch.bfloat16 and torch.equal(rounded, out.bfloat16())
    linear = make_linear(down, None, torch.bfloat16, "lossless", Kernels(qgemm=True))
    assert linear.qgemm.blocked and linear.small_batch == 12
    x = torch.randn(5, down.shape[1], generator=generator).bfloat16()
    assert relative_error(linear(x).float(), x.float() @ down.float().t()) < 1e-2


@pytest.mark.skipif(qgemm_amx.load() is None, reason="no AMX CPU or no C compiler")
def test_qgemm_amx_computes_on_the_dense_bf16_weight(checkpoint):
    """The AMX tiles: fp32 sums of bf16 activations times the weight rounded to
    bf16 (the dense bf16 path's), for 1 to 4 row blocks of 16, full or not, and
    more than one pass of 64 rows."""
    generator = torch.Generator().manual_seed(0)
    down = checkpoint["model.layers.7.mlp.down_proj.weight"]
    embed = checkpoint["model.embed_tokens.weight"][:1024]
    for weight, kind in ((down, Int4), (embed, Int8)):  # Q4_1, Q8_0
        linear = make_linear(weight, None, torch.bfloat16, "lossless", Kernels(amx=True))
        assert type(linear) is kind and linear.tiled is not None
        assert linear.small_batch == TILE_ROWS
        dense = weight.bfloat16().float().t()
        for rows in (1, 5, 16, 17, 40, 64, 100):
            x = torch.randn(rows, weight.shape[1], generator=generator).bfloat16()
            out = qgemm_amx.matmul(x.float(), linear.tiled)
            assert out.shape == (rows, weight.shape[0]) and out.dtype == torch.float32
            # a weight may round to the neighbouring bf16 (fp32 fma against the
            # checkpoint's two roundings): far below bf16 activations' own error
            assert relative_error(out, x.float() @ dense) < 1e-4
            rounded = qgemm_amx.matmul(x, linear.tiled)  # bf16 in, bf16 out
            assert rounded.dtype == torch.bfloat16 and torch.equal(rounded, out.bfloat16())
        x = torch.randn(64, weight.shape[1], generator=generator).bfloat16()
        assert relative_error(linear(x), x.float() @ dense) < 1e-2  # through Int4/Int8


@pytest.mark.skipif(qgemm_amx.load() is None, reason="no AMX CPU or no C compiler")
def test_the_tiles_mlp_activation_is_silu_mul_of_their_gate_up_bit_for_bit(checkpoint):
    """layers.c's MLP on the tiles: silu(gate) * up made from the tiles' sums
    (tiled_gemm_silu) is ops.c's silu_mul of their bf16 gate_up, for 1 to 4 row
    blocks, full or not, and more than one pass of 64 rows."""
    generator = torch.Generator().manual_seed(0)
    gate_up = torch.cat([checkpoint[f"model.layers.7.mlp.{name}_proj.weight"]
                         for name in ("gate", "up")])
    linear = make_linear(gate_up, None, torch.bfloat16, "lossless", Kernels(amx=True))
    ops = NativeOps(fused.load(), torch.bfloat16)
    for rows in (1, 5, 16, 17, 40, 64, 100):
        x = torch.randn(rows, gate_up.shape[1], generator=generator).bfloat16()
        act = qgemm_amx.silu_matmul(x, linear.tiled)
        assert act.shape == (rows, gate_up.shape[0] // 2)
        assert torch.equal(act, ops.silu_mul(qgemm_amx.matmul(x, linear.tiled)))


@pytest.mark.skipif(qgemm_amx.load() is None, reason="no AMX CPU or no C compiler")
def test_dense_tiles_serve_the_batches_past_the_4bit_copy(checkpoint):
    """Past TILE_ROWS a projection runs the dense bf16 matmul on AMX's tiles
    (no oneDNN copy): fp32 sums of the bf16 activations and weight, for row
    counts that fill 32-row blocks or leave 1 to 31 rows over."""
    generator = torch.Generator().manual_seed(0)
    down = checkpoint["model.layers.7.mlp.down_proj.weight"]
    linear = make_linear(down, None, torch.bfloat16, "lossless",
                         Kernels(amx=True, onednn=True, dense_tiles=True))
    assert linear.tiles_weight is not None and linear.onednn_weight is None
    dense = down.bfloat16().float().t()
    for rows in (1, 16, 17, 33, TILE_ROWS + 1, 512):
        x = torch.randn(rows, down.shape[1], generator=generator).bfloat16()
        out = qgemm_amx.dense_matmul(x.float(), linear.tiles_weight, down.shape[0])
        assert out.shape == (rows, down.shape[0]) and out.dtype == torch.float32
        assert relative_error(out, x.float() @ dense) < 1e-5  # fp32 sums, summed apart
        rounded = qgemm_amx.dense_matmul(x, linear.tiles_weight, down.shape[0])
        assert torch.equal(rounded, out.bfloat16())  # bf16 out: the fp32 sums rounded
    x = torch.randn(TILE_ROWS + 7, down.shape[1], generator=generator).bfloat16()
    assert torch.equal(linear(x), qgemm_amx.dense_matmul(x, linear.tiles_weight, down.shape[0]))


@pytest.mark.skipif(qgemm_amx.load() is None, reason="no AMX CPU or no C compiler")
def test_greedy_on_the_tiles_is_the_argmax_of_their_logits(checkpoint):
    """The lm_head's fused argmax: each row's largest output, the first of
    equal ones (a weight whose rows repeat makes ties), where the tiles serve
    the rows, and where the 8-bit VNNI rows beside them do (qgemm_vnni.argmax,
    past any fine rows); None past both (the dense copy's rows) or with a bias."""
    generator = torch.Generator().manual_seed(0)
    embed = checkpoint["model.embed_tokens.weight"][:4096]
    kernels = Kernels(amx=True, vnni=True)
    for weight in (embed, torch.cat([embed[:48], embed[:48], embed[:32]])):
        linear = make_linear(weight, None, torch.bfloat16, "lossless", kernels)
        for rows in (VNNI_BESIDE_AMX + 1, 16, 33, 64, 100, TILE_ROWS):
            x = torch.randn(rows, weight.shape[1], generator=generator).bfloat16()
            picks = linear.greedy(x)
            assert picks.dtype == torch.long
            assert torch.equal(picks, linear.logits(x).argmax(-1))
        x = torch.randn(VNNI_BESIDE_AMX, weight.shape[1], generator=generator).bfloat16()
        assert torch.equal(linear.greedy(x), linear.logits(x).argmax(-1))
        assert linear.greedy(torch.cat([x] * 20)) is None
    biased = make_linear(embed, torch.ones(embed.shape[0]), torch.bfloat16, "lossless", kernels)
    assert biased.greedy(torch.randn(16, embed.shape[1]).bfloat16()) is None


@needs_qgemm
def test_qgemm_kernels_serve_small_batches_in_fp32(checkpoint):
    generator = torch.Generator().manual_seed(0)
    kernels = Kernels(onednn=True, qgemm=True)
    weight = checkpoint["model.layers.0.self_attn.q_proj.weight"]
    bias = torch.randn(weight.shape[0], generator=generator)
    linear = make_linear(weight, bias, torch.float32, "lossless", kernels)
    assert type(linear) is Int4 and linear.small_batch == kernels.small_batch(torch.float32)
    for rows in (1, linear.small_batch, linear.small_batch + 1):
        x = torch.randn(rows, weight.shape[1], generator=generator)
        assert relative_error(linear(x), x @ weight.t() + bias) < 1e-5  # fp32, not bf16


def test_quantization_modes_resolve_by_device_and_dtype():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_quantization("auto", cpu, "auto") == "lossless"
    assert resolve_quantization("auto", cpu, "bfloat16") == "lossless"
    assert resolve_quantization("auto", cpu, "float32") == "none"  # fp32 numerics throughout
    assert resolve_quantization("auto", cpu, "float32", fp32_kernel=True) == "lossless"
    assert resolve_quantization("int4", cpu, "float32") == "int4"
    assert resolve_quantization("auto", cuda, "auto") == "none"
    with pytest.raises(ConfigError):
        resolve_quantization("int4", cuda, "auto")
    with pytest.raises(ConfigError):
        resolve_quantization("int3", cpu, "auto")
    assert resolve_dtype("auto", cpu) in (torch.bfloat16, torch.float32)
    if qgemm_vnni.load() is not None or qgemm_amx.load() is not None:
        # our kernels take bf16: no timing decides (calibrate.cpu_dtype)
        assert all(resolve_dtype("auto", cpu) == torch.bfloat16 for _ in range(3))
    assert resolve_dtype("auto", cpu, quantized=False) in (torch.bfloat16, torch.float32)


def test_qgemm_without_a_compiler_leaves_torchs_kernel(tmp_path):
    """A host with no C compiler (or a failing one) serves on torch's kernels."""
    script = ("import torch; from workers.scheduler import qgemm, qgemm_amx, qgemm_vnni, "
              "calibrate, fused, layers, paged; print(qgemm.load() is None, "
              "calibrate.qgemm_is_faster(torch.bfloat16, 576, 1536), paged.load() is None, "
              "qgemm_amx.load() is None, qgemm_vnni.library()[0] is None, "
              "qgemm_vnni.takes(torch.float32), layers.load() is None, "
              "type(fused.choose_ops(torch.device('cpu'), torch.float32)).__name__)")
    env = {**os.environ, "CC": "/bin/false", "XDG_CACHE_HOME": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=120, check=True)
    assert done.stdout.split() == ["True", "False", "True", "True", "True", "False", "True",
                                   "TorchOps"]
    assert not list(tmp_path.rglob("*.so"))  # no half-written library left behind


@needs_qgemm
def test_qgemm_builds_once_per_source_into_the_cache(tmp_path):
    script = "from workers.scheduler import qgemm; print(qgemm.build())"
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path)}
    paths = [subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                            text=True, timeout=120, check=True).stdout.strip()
             for _ in range(2)]
    assert paths[0] == paths[1] and paths[0].startswith(str(tmp_path))
    assert len(list(tmp_path.rglob("*.so"))) == 1
