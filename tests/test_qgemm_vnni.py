"""qgemm_vnni.c and qgemm_avx2.c: the checkpoint's 4- and 8-bit weights on int8
activations (and, in their fine kernels, 14-bit ones). Each kernel's answer is
held to the same sum computed here in fp64 (activations rounded per row and
group of 32 as the kernel rounds them), and to the exact matmul within the
rounding of the activations; and to the choice of kernels that `--activations`
makes. The AVX2 build runs on every AVX2 host, VNNI ones too."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import pytest
import torch
from safetensors import safe_open

from pipeline.config import Config, SchedulerConfig
from pipeline.errors import ConfigError
from pipeline.tokenizer import Tokenizer
from tests.harness import load_bench_script
from workers.scheduler import qgemm_amx, qgemm_vnni
from workers.scheduler.calibrate import choose_kernels
from workers.scheduler.engine import Engine
from workers.scheduler.linear import (
    FINE_ROWS,
    TILE_ROWS,
    VNNI_BESIDE_AMX,
    Int4,
    Kernels,
    make_linear,
    quantize_int4,
    quantize_int8,
)
from workers.scheduler.loop import Scheduler
from workers.scheduler.model import read_spec

LIBRARIES = {"vnni": qgemm_vnni.load, "avx2": qgemm_vnni.load_avx2}
each_library = pytest.mark.parametrize("on", [
    pytest.param(name, marks=pytest.mark.skipif(load() is None, reason=f"no {name} build here"))
    for name, load in LIBRARIES.items()])


@pytest.fixture(scope="module")
def checkpoint(model_files):
    path = next(model_files.path.glob("*.safetensors"))
    with safe_open(str(path), framework="pt") as f:
        return {name: f.get_tensor(name) for name in (
            "model.layers.7.mlp.down_proj.weight", "model.embed_tokens.weight")}


def weights(checkpoint) -> list[tuple[torch.Tensor, int]]:
    """A Q4_1 weight and (part of) the Q8_0 embedding, with their bits."""
    return [(checkpoint["model.layers.7.mlp.down_proj.weight"], 4),
            (checkpoint["model.embed_tokens.weight"][:1024], 8)]


def blocks(weight: torch.Tensor, bits: int, fine: bool, on: str) -> qgemm_vnni.Blocked:
    if bits == 4:
        levels, scales_zeros, error = quantize_int4(weight)
        scale, zero = scales_zeros[..., 0].t(), scales_zeros[..., 1].t()
        packed = qgemm_vnni.pack_q4(levels, scale, zero - 8 * scale, fine, on)
    else:
        levels, scale, error = quantize_int8(weight)
        packed = qgemm_vnni.pack_q8(levels, scale.reshape(levels.shape[0], -1), fine, on)
    assert error < 1e-3  # the checkpoint's own levels
    return packed


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


@each_library
def test_kernels_sum_int8_activations_exactly(checkpoint, on):
    """Every row-block shape (VNNI 1-12 rows, 8-bit weights 1-16, AVX2 1-4,
    blocks split evenly past them), 4- and 8-bit, fp32 and bf16 answers."""
    generator = torch.Generator().manual_seed(0)
    for weight, bits in weights(checkpoint):
        packed = blocks(weight, bits, False, on)
        exact = weight.double().t()
        for rows in (1, 2, 3, 5, 6, 12, 13, 15, 16, 25, 64):
            x = torch.randn(rows, weight.shape[1], generator=generator).bfloat16()
            x[0, :32] = 0.0  # a group of zeros: scale 0, no NaN
            out = qgemm_vnni.matmul(x.float(), packed)
            assert out.shape == (rows, weight.shape[0]) and out.dtype == torch.float32
            # integer dots are exact; what is left is fp32 rounding of the scaled sums
            assert relative_error(out, int8_groups(x) @ exact) < 1e-5
            # int8 activations move the answer by ~0.5% from the exact one
            assert relative_error(out, x.double() @ exact) < 2e-2
            rounded = qgemm_vnni.matmul(x, packed)  # bf16 in, bf16 out
            assert rounded.dtype == torch.bfloat16 and torch.equal(rounded, out.bfloat16())


@each_library
def test_the_largest_dots_stay_exact(on):
    """Every level at its extreme against activations at +-127 levels: each group's
    dot is the largest either kernel takes (4-bit 32 * 15 * 127, 8-bit 32 * 127 *
    127; VNNI starts it at 1.5 * 2^23's float bits), of either sign."""
    out_dim, in_dim, rows = 32, 256, 3
    signs = torch.ones(rows, in_dim)
    signs[1] = -1.0
    signs[2, ::2] = -1.0  # alternating: the two halves of each group cancel
    x = (127 * signs).bfloat16()  # levels of scale 1: every sum is an exact integer
    ones = torch.ones(out_dim, in_dim // 32)
    for bits in (4, 8):
        if bits == 4:
            levels = torch.full((out_dim, in_dim), 15)
            packed = qgemm_vnni.pack_q4(levels, ones, torch.zeros_like(ones), on=on)
        else:
            levels = torch.full((out_dim, in_dim), 127)
            levels[::2] = -127  # even outputs negative
            packed = qgemm_vnni.pack_q8(levels, ones, on=on)
        weight = levels.double()
        out = qgemm_vnni.matmul(x.float(), packed).double()
        assert torch.equal(out, x.double() @ weight.t())


@contextmanager
def torch_threads(count: int) -> Iterator[None]:
    """torch's OpenMP pool (the kernels' threads) at `count`, then as it was."""
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@each_library
def test_answers_do_not_depend_on_how_threads_share_the_blocks(checkpoint, on):
    """Threads take blocks of 16 outputs by stealing (kernels.h's Span): with
    more threads than cores some are preempted and the others take their
    blocks, and with more threads than blocks some start with none. Every
    way gives the same bits as one thread."""
    generator = torch.Generator().manual_seed(3)
    for weight, bits in weights(checkpoint):
        for out_dim in (16, 48, weight.shape[0]):
            packed = blocks(weight[:out_dim], bits, bits == 4, on)
            x = torch.randn(13, weight.shape[1], generator=generator).bfloat16()
            answers = []
            for count in (1, 2, 3, 7):
                with torch_threads(count):
                    answers.append([qgemm_vnni.matmul(x, packed) for _ in range(5)])
            first = answers[0][0]
            assert all(torch.equal(a, first) for runs in answers for a in runs)


@pytest.mark.skipif(qgemm_vnni.load() is None, reason="no vnni build here")
def test_argmax_picks_the_first_largest_of_the_kernels_own_answer(checkpoint):
    """Greedy sampling's lm_head (linear.Dense.greedy): the column of each row's
    largest output, never written, equals the argmax of the kernel's fp32
    answer; every output comes twice (the weight's rows repeated), so each pick
    is a tie that the first column wins, whichever thread holds it."""
    half = checkpoint["model.embed_tokens.weight"][:2048]
    packed = blocks(torch.cat([half, half]), 8, False, "vnni")
    generator = torch.Generator().manual_seed(4)
    for count in (1, 2, 3):
        with torch_threads(count):
            for rows in (1, 5, 13, 64):
                x = torch.randn(rows, half.shape[1], generator=generator).bfloat16()
                picks = qgemm_vnni.argmax(x, packed)
                expected = qgemm_vnni.matmul(x.float(), packed).argmax(-1)
                assert torch.equal(picks, expected) and bool((picks < len(half)).all())


def test_avx2_kernel_takes_fp32_activations_as_they_are(checkpoint):
    """The AVX2 build rounds fp32 rows to int8 itself (no bf16 step between)."""
    if qgemm_vnni.load_avx2() is None:
        pytest.skip("no AVX2 build here")
    generator = torch.Generator().manual_seed(2)
    for weight, bits in weights(checkpoint):
        packed = blocks(weight, bits, False, "avx2")
        x = torch.randn(7, weight.shape[1], generator=generator)
        assert relative_error(qgemm_vnni.matmul(x, packed),
                              int8_groups(x) @ weight.double().t()) < 1e-5


def test_avx2_variants_times_builds_and_refuses_one_that_answers_otherwise(tmp_path, capsys):
    """bench/avx2_variants.py: a build with other flags is timed beside the
    shipped one; a build whose sums differ stops the run before any timing."""
    if qgemm_vnni.load_avx2() is None:
        pytest.skip("no AVX2 build here")
    variants, source = load_bench_script("avx2_variants"), str(qgemm_vnni.SOURCE_AVX2)
    variants.main(["--rows", "3", "--layers", "1", source, source + ":-DROWS=2"])
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(" at ")[0] for line in lines] == ["4-bit projections", "8-bit lm_head"]
    assert all(line.count(" ms (") == 2 and "(1.00x)" in line for line in lines)
    broken = tmp_path / "broken.c"  # beside the header it includes
    (tmp_path / "kernels.h").write_text(qgemm_vnni.SOURCE_AVX2.with_name("kernels.h").read_text())
    text = qgemm_vnni.SOURCE_AVX2.read_text()
    assert "_mm256_set1_ps(s[0])" in text
    broken.write_text(text.replace("_mm256_set1_ps(s[0])", "_mm256_set1_ps(2.0f * s[0])"))
    with pytest.raises(SystemExit, match="differ from the first build"):
        variants.main(["--rows", "3", "--layers", "1", source, str(broken)])
    assert capsys.readouterr().out == ""


def test_vnni_bound_times_each_weight_against_its_instructions_alone(capsys):
    """bench/vnni_bound.py: the instruction mix alone (bench/vnni_bound.c) and
    our kernel on every projection and the lm_head, a ratio each."""
    if qgemm_vnni.load() is None:
        pytest.skip("no VNNI build here")
    load_bench_script("vnni_bound").main(["--rows", "4", "--layers", "1"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("the instructions alone: ")
    table = [line.strip("| ").split(" | ") for line in lines[3:]]
    assert [cells[0].split()[0] for cells in table] == ["qkv", "o", "gate_up", "down", "lm_head"]
    assert all(float(cells[2]) > 0 and cells[3].endswith("x") for cells in table)


def test_avx2_bound_times_each_weight_against_its_tile_in_l1(capsys):
    """bench/avx2_bound.py: the kernel's own tile with everything in L1
    (bench/avx2_bound.c on the kernel's source) and the whole kernel on every
    projection and the lm_head, a ratio each."""
    if qgemm_vnni.load_avx2() is None:
        pytest.skip("no AVX2 build here")
    load_bench_script("avx2_bound").main(["--rows", "4", "--layers", "1"])
    table = [line.strip("| ").split(" | ") for line in capsys.readouterr().out.splitlines()[2:]]
    assert [cells[0].split()[0] for cells in table] == ["qkv", "o", "gate_up", "down", "lm_head"]
    assert all(float(cells[2]) > 0 and float(cells[3]) > 0 and cells[4].endswith("x")
               for cells in table)


@each_library
def test_fine_kernels_sum_14_bit_activations_exactly(checkpoint, on):
    """The fine kernels' two int8 parts of each 14-bit level add up exactly:
    the answer is the fp64 sum over x rounded to 14 bits, and within a
    twentieth of int8's distance of the exact one."""
    generator = torch.Generator().manual_seed(1)
    for weight, bits in weights(checkpoint):
        packed = blocks(weight, bits, True, on)
        exact = weight.double().t()
        for rows in (1, 3, 4, 12, 17, 64):
            x = torch.randn(rows, weight.shape[1], generator=generator).bfloat16()
            x[0, :32] = 0.0
            x[-1, 32:64] *= 1000.0  # a group with one large scale among small ones
            out = qgemm_vnni.matmul(x.float(), packed)
            assert relative_error(out, int8_groups(x, 127.0 * 128) @ exact) < 1e-5
            fine_error = relative_error(out, x.double() @ exact)
            assert fine_error < 1e-3
            assert fine_error < relative_error(int8_groups(x) @ exact, x.double() @ exact) / 20


def test_the_int8_path_takes_the_cpus_library(checkpoint):
    """make_linear packs for VNNI where the CPU has it, else for AVX2, which
    also takes fp32 models."""
    down = checkpoint["model.layers.7.mlp.down_proj.weight"]
    lib, suffix = qgemm_vnni.library()
    if lib is None:
        pytest.skip("no int8 kernel here")
    for dtype in (torch.bfloat16, torch.float32):
        linear = make_linear(down, None, dtype, "lossless", Kernels(vnni=True))
        assert type(linear) is Int4
        assert (linear.vnni is not None) == (dtype == torch.bfloat16 or suffix == "avx2")
        if linear.vnni is not None:
            assert linear.vnni.same_dtype == (suffix == "avx2")


@each_library
def test_fine_binds_the_same_blocks_to_their_librarys_fine_kernel(checkpoint, on):
    for weight, bits in weights(checkpoint):
        plain = blocks(weight, bits, False, on)
        fine = qgemm_vnni.fine(plain)
        assert fine.q is plain.q and fine.same_dtype == plain.same_dtype
        x = torch.randn(5, weight.shape[1])
        if on == "vnni":
            x = x.bfloat16()
        assert torch.equal(qgemm_vnni.matmul(x, fine),
                           qgemm_vnni.matmul(x, blocks(weight, bits, True, on)))


def test_fine_weights_take_14_bits_up_to_fine_rows_then_int8(checkpoint):
    """qkv's weights: the fine kernels while a step streams its weights, the
    int8 ones on the same blocks beyond (no dense copy, no second copy)."""
    lib, suffix = qgemm_vnni.library()
    if lib is None:
        pytest.skip("no int8 kernel here")
    down = checkpoint["model.layers.7.mlp.down_proj.weight"]
    dtype = torch.bfloat16 if suffix == "vnni" else torch.float32
    linear = make_linear(down, None, dtype, "lossless", Kernels(onednn=True, vnni=True, fine=True))
    assert linear.fine_rows == FINE_ROWS and linear.vnni_rows > 512
    assert linear.onednn_weight is None and linear.weight_t is None
    assert linear.vnni_fine.q is linear.vnni.q
    for rows in (1, FINE_ROWS, FINE_ROWS + 1, 600):
        x = torch.randn(rows, down.shape[1]).to(dtype)
        fine = rows <= FINE_ROWS
        out = linear(x)
        assert torch.equal(out, qgemm_vnni.matmul(x, linear.vnni_fine if fine else linear.vnni))
        exact = x.double() @ down.double().t()
        assert relative_error(out, exact) < (1e-2 if fine else 2e-2)
    x = torch.randn(FINE_ROWS, down.shape[1]).to(dtype)  # 14 bits: far closer than int8
    exact = x.double() @ down.double().t()
    assert (relative_error(qgemm_vnni.matmul(x, linear.vnni_fine), exact)
            < relative_error(qgemm_vnni.matmul(x, linear.vnni), exact))


def test_int8_weights_serve_every_batch_without_a_dense_copy(checkpoint):
    lib, suffix = qgemm_vnni.library()
    if lib is None:
        pytest.skip("no int8 kernel here")
    down = checkpoint["model.layers.7.mlp.down_proj.weight"]
    dtype = torch.bfloat16 if suffix == "vnni" else torch.float32
    linear = make_linear(down, None, dtype, "lossless", Kernels(onednn=suffix == "vnni",
                                                                vnni=True))
    assert linear.onednn_weight is None and linear.weight_t is None
    x = torch.randn(600, down.shape[1]).to(dtype)  # a prefill's rows
    assert relative_error(linear(x), x.double() @ down.double().t()) < 2e-2
    if suffix == "vnni":  # VNNI's kernels take bf16 models only
        fp32 = make_linear(down, None, torch.float32, "lossless", Kernels(onednn=True, vnni=True))
        assert fp32.vnni is None and fp32.onednn_weight is not None


@pytest.mark.skipif(qgemm_amx.load() is None or qgemm_vnni.load() is None,
                    reason="no CPU with both AMX and VNNI here")
def test_beside_amx_int8_serves_small_batches_and_the_tiles_the_rest(checkpoint):
    """An Intel CPU with AMX: int8 activations up to VNNI_BESIDE_AMX rows, the
    tiles on bf16 from there to 64, the dense matmul beyond."""
    for fine in (False, True):
        for weight, _bits in weights(checkpoint):
            linear = make_linear(weight, None, torch.bfloat16, "lossless",
                                 Kernels(onednn=True, amx=True, vnni=True, fine=fine))
            assert linear.vnni is not None and linear.tiled is not None
            assert linear.vnni_rows == VNNI_BESIDE_AMX and linear.small_batch == TILE_ROWS
            assert linear.onednn_weight is not None
            for rows in (1, VNNI_BESIDE_AMX, VNNI_BESIDE_AMX + 1, 64, TILE_ROWS, TILE_ROWS + 1):
                x = torch.randn(rows, weight.shape[1]).bfloat16()
                out = linear(x)
                if rows <= VNNI_BESIDE_AMX:  # qkv's fine kernel up to its rows, where asked
                    blocks = linear.vnni_fine if rows <= linear.fine_rows else linear.vnni
                    assert torch.equal(out, qgemm_vnni.matmul(x, blocks))
                elif rows <= TILE_ROWS:
                    assert torch.equal(out, qgemm_amx.matmul(x, linear.tiled))
                assert relative_error(out, x.double() @ weight.double().t()) < 2e-2


def test_activations_option_chooses_the_kernels(model_files):
    spec, cpu = read_spec(model_files.path), torch.device("cpu")
    with pytest.raises(ConfigError):
        choose_kernels(cpu, torch.bfloat16, spec, True, "int4")
    assert not choose_kernels(cpu, torch.bfloat16, spec, True, "exact").vnni
    assert not choose_kernels(cpu, torch.bfloat16, spec, False, "auto").vnni  # no 4-bit weights
    for dtype in (torch.bfloat16, torch.float32):
        if qgemm_vnni.takes(dtype):
            # int8 by name: on every row, AMX's tiles or not
            assert choose_kernels(cpu, dtype, spec, True, "int8").vnni
            assert not choose_kernels(cpu, dtype, spec, True, "int8").amx
            auto = choose_kernels(cpu, dtype, spec, True, "auto")
            amx = dtype == torch.bfloat16 and qgemm_amx.load() is not None
            assert auto.vnni and auto.amx == amx
        else:  # VNNI takes bf16 models only; without AVX2 or a compiler, none
            with pytest.raises(ConfigError):
                choose_kernels(cpu, dtype, spec, True, "int8")


def test_pipeline_status_names_the_kernels_the_engine_chose(model_files):
    """A scheduler's liveness info (what `pipeline status` shows) says which
    4-bit kernels and activations its engine runs."""
    engine = Engine(model_files.path, SchedulerConfig())
    config = Config(model=str(model_files.path))
    with ThreadPoolExecutor(1) as thread:
        info = Scheduler(config, engine, Tokenizer(model_files.path), thread).info()
    kernels, (_, suffix) = engine.kernels, qgemm_vnni.library()
    if kernels.vnni:
        assert info["4bit_matmul"] == suffix + ("+amx" if kernels.amx else "")
        assert info["activations"] == ("int8" if not kernels.amx
                                       else f"int8 up to {VNNI_BESIDE_AMX} rows")
    else:
        assert info["activations"] == "exact"
        assert info["4bit_matmul"] in ("amx", "qgemm", "torch")
    assert info["dtype"] == str(engine.dtype).removeprefix("torch.")
    assert (info["device"], info["attention"], info["cuda_graphs"]) == ("cpu", "torch", 0)
