"""layers.c: all decoder layers of a step in one C call give bit for bit the
logits of the Python forward pass over the same kernels, for a prefill and
for decode steps; steps it does not take stay in Python."""

from __future__ import annotations

import itertools
import sys

import pytest
import torch

from pipeline.config import SchedulerConfig
from pipeline.messages import Sampling
from pipeline.tokenizer import Tokenizer
from tests.harness import load_bench_script
from workers.scheduler.engine import Engine, EngineRequest
from workers.scheduler.layers import Driver, row_groups


def all_logits(engine: Engine, plan) -> torch.Tensor:
    """Logits of every row of `plan` (the forward pass Engine.run makes)."""
    tables = [engine.allocator.block_table(c.seq.request_id) for c in plan.chunks]
    engine.attention.prepare(plan, tables, engine.device)
    with torch.inference_mode():
        return engine.model.forward(torch.tensor(plan.input_ids()),
                                    torch.tensor(plan.positions()),
                                    torch.arange(plan.num_tokens), engine.attention)


def assert_driver_matches_python(engine: Engine, plan) -> None:
    """The plan's logits through the driver equal the Python forward's; then the
    step runs (each forward writes the step's keys and values to the same slots)."""
    driver, engine.model.driver = engine.model.driver, None
    python = all_logits(engine, plan)
    engine.model.driver = driver
    assert torch.equal(all_logits(engine, plan), python)
    engine.postprocess(plan, engine.run(plan))


def make_engine(model_files, dtype: str, max_batch_tokens: int = 12) -> Engine:
    engine = Engine(model_files.path, SchedulerConfig(dtype=dtype,
                                                      max_batch_tokens=max_batch_tokens))
    if engine.model.driver is None:
        pytest.skip("some kernel of a layer is not ours on this host (layers.Driver.build)")
    return engine


@pytest.fixture(scope="module")
def engine(model_files):
    return make_engine(model_files, "bfloat16")


@pytest.mark.parametrize("dtype", ["bfloat16", "auto"])  # auto: fp32 on an AVX2-only CPU
def test_one_call_gives_the_python_forwards_logits(model_files, dtype):
    engine = make_engine(model_files, dtype)
    driver = engine.model.driver
    sampling = Sampling(max_tokens=8, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(([1, 2, 3, 4, 5], [9, 8, 7, 6, 5, 4, 3])):
        engine.add(EngineRequest(str(i), prompt, [], sampling))
    for _ in range(4):  # a prefill of 12 tokens, then decode steps of 2 rows
        plan = engine.batcher.schedule()
        assert plan.num_tokens <= driver.max_rows
        assert_driver_matches_python(engine, plan)
    while engine.has_work():
        engine.step()


def test_each_regime_of_kernels_gives_the_python_forwards_logits(model_files):
    """Where the driver has regimes (on an Intel CPU with AMX: int8 up to 10
    rows, the tiles to 64), a step in each runs its own kernels, the same as
    the Python forward's at that row count."""
    engine = make_engine(model_files, "bfloat16", max_batch_tokens=64)
    driver = engine.model.driver
    if len(driver.regimes) < 2:
        pytest.skip("one regime of kernels on this host")
    sampling = Sampling(max_tokens=3, temperature=0.0, ignore_eos=True)
    bounds = [bound for bound, _ in driver.regimes]
    for i in range(bounds[0] + 4):  # a prefill past the first regime, then its decodes
        engine.add(EngineRequest(str(i), [5 + i, 7, 11], [], sampling))
    seen = set()
    while engine.has_work():
        plan = engine.batcher.schedule()
        seen.add(next(b for b in bounds if plan.num_tokens <= b))
        assert_driver_matches_python(engine, plan)
    assert bounds[1] in seen


def test_a_prefill_of_many_rows_runs_in_one_call(model_files):
    """On int8 activations every projection serves every row count (qkv's fine
    kernels up to linear.FINE_ROWS, int8 beyond); beside AMX, the dense bf16
    tiles serve past the 4-bit ones: so prefill chunks run in layers.c."""
    engine = make_engine(model_files, "bfloat16", max_batch_tokens=200)
    if engine.model.driver.max_rows < 200:
        pytest.skip("the driver's kernels stop short of 200 rows on this host")
    sampling = Sampling(max_tokens=2, temperature=0.0, ignore_eos=True)
    for i in range(5):
        engine.add(EngineRequest(str(i), [3 + i] * 40, [], sampling))
    plan = engine.batcher.schedule()
    assert plan.num_tokens == 200
    assert_driver_matches_python(engine, plan)


def test_row_groups_keep_sequences_whole_and_near_equal():
    assert row_groups([1] * 64, threads=2) == [0, 16, 32, 48, 64]  # 2 a thread
    assert row_groups([1] * 48, threads=2) == [0, 12, 24, 36, 48]  # 10 rows a group at least
    assert row_groups([1] * 39, threads=2) is None  # under 2 groups a thread
    assert row_groups([1] * 64, threads=1) is None and row_groups([1] * 64, threads=4) is None
    assert len(row_groups([1] * 512, threads=4)) == 9
    prefill = [30, 1, 1, 40, 25, 28, 33, 20, 9, 50]  # a mixed step: every cut between sequences
    starts = row_groups(prefill, threads=2)
    assert set(starts) <= {0, *itertools.accumulate(prefill)} and starts[-1] == sum(prefill)
    assert len(starts) == 5  # 4 groups, none over twice their mean
    assert max(b - a for a, b in itertools.pairwise(starts)) <= 2 * sum(prefill) / 4
    assert row_groups([300, 100, 112], threads=2) is None  # a long prompt's rows attend together


def test_grouped_steps_give_the_python_forwards_logits(model_files):
    """A decode step of 48 rows and a prefill of 5 prompts, each run as groups of
    whole sequences on their own chains of layers: the same logits, bit for bit."""
    if torch.get_num_threads() < 2:
        pytest.skip("one thread: steps are not grouped")
    engine = make_engine(model_files, "bfloat16", max_batch_tokens=400)
    engine.model.driver.grouped = True  # beside AMX's tiles only a choice; checked anyway
    sampling = Sampling(max_tokens=2, temperature=0.0, ignore_eos=True)
    for i in range(48):
        engine.add(EngineRequest(str(i), [5 + i, 7, 11, 13][:1 + i % 4], [], sampling))
    plans = [engine.batcher.schedule()]  # the prefill of all 48
    assert_driver_matches_python(engine, plans[0])
    plans.append(engine.batcher.schedule())  # then a decode step of 48 rows
    assert plans[1].num_tokens == 48 and row_groups([1] * 48, torch.get_num_threads())
    assert_driver_matches_python(engine, plans[1])
    for i in range(5):  # a prefill of 5 prompts as groups of whole prompts
        engine.add(EngineRequest(f"p{i}", [3 + i] * (30 + i), [], sampling))
    while engine.batcher.running:
        engine.step()
    plan = engine.batcher.schedule()
    assert [c.num_tokens for c in plan.chunks] == [30, 31, 32, 33, 34]
    assert row_groups([30, 31, 32, 33, 34], torch.get_num_threads()) is not None
    assert_driver_matches_python(engine, plan)


def test_steps_beside_amx_tiles_run_layer_by_layer(engine):
    """Grouped steps run each group's matmuls on its own rows; the tiles'
    cost a row falls with rows (one dequantization serves up to 64). Where
    the tiles run an MLP's gate_up, their kernel makes its activation too."""
    tiles = engine.kernels.amx
    assert tiles == any(layer.gate_up.tiled is not None for layer in engine.model.layers)
    assert engine.model.driver.grouped is not tiles
    fused = [bool(layer.gate_up_silu) for _, layers in engine.model.driver.regimes
             for layer in layers]
    assert any(fused) == tiles and not all(fused)  # int8's few rows: silu apart


def test_wider_steps_and_fp32_models_stay_in_python(engine, model_files):
    driver = engine.model.driver
    if driver.max_rows < sys.maxsize:
        assert not driver.takes(driver.max_rows + 1, engine.attention)
    fp32 = Engine(model_files.path, SchedulerConfig(dtype="float32"))
    assert fp32.model.driver is None and Driver.build(fp32.model, fp32.attention) is None


@pytest.mark.parametrize("kernel", ["silu", "matmul", "mlp"])
def test_kernel_pairs_times_both_sides_and_puts_the_engines_kernels_back(engine, model_files,
                                                                         kernel):
    """bench/kernel_pairs.py swaps one of the driver's kernels (or every layer
    projection's) for a no-op step by step, or (mlp, beside AMX's tiles) the
    tiles' silu for silu apart: both sides get decode steps, prefills
    alternate wave by wave, and afterwards the engine answers as it did
    before (its own kernels are back)."""
    if kernel == "mlp":
        if not engine.kernels.amx:
            pytest.skip("only AMX's tiles make silu in gate_up")
        engine = make_engine(model_files, "bfloat16", max_batch_tokens=512)  # 12 rows at once
    pairs = load_bench_script("kernel_pairs")
    sampling = Sampling(max_tokens=6, temperature=0.0, ignore_eos=True)

    def answer(name: str) -> list[int]:
        engine.add(EngineRequest(name, [5, 9, 2, 7], [], sampling))
        tokens = []
        while engine.has_work():
            tokens += [t for result in engine.step() for t in result.new_ids]
        return tokens

    before = answer("before")
    rows = 12 if kernel == "mlp" else 4  # the tiles' steps: 11 rows up
    waves = pairs.run(engine, Tokenizer(model_files.path), kernel, None, waves=2, rows=rows)
    assert [wave["prefill_side"] for wave in waves] == ["engine's", "other"]
    assert all(wave["steps"]["engine's"] and wave["steps"]["other"] for wave in waves)
    assert answer("after") == before
    if kernel == "mlp":
        layers = [layer for _, regime in engine.model.driver.regimes for layer in regime]
        assert any(layer.gate_up_silu for layer in layers)
