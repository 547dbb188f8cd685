"""Engine steps with one of layers.c's kernels swapped, paired in one engine:
the checkout's build against a build of another source file (`--variant`), or
against a no-op (`--without`: the kernel's share of a step; the answers go
wrong, the timing stands). An element kernel (attend, norm, rope, silu), or
`matmul`: every layer projection on the variant's functions of the same names
(its file named as the source it varies: qgemm_amx.c, qgemm_vnni.c or
qgemm_avx2.c; the lm_head keeps the engine's build). Decode steps alternate between the
two step by step, and whole waves' prefills wave by wave (where layers.c runs
them: on AMX, VNNI and AVX2 hosts), on the serving bench's prompts: the
shared host's speed moves by a quarter within minutes, which served runs
minutes apart cannot resolve below ~10% (round Y in
`bench/HISTORY.md`: a change this measured at 0.96x, served pairs ranged
0.94-1.38x). Beside AMX's tiles a layer's gate_up makes silu itself
(qgemm_amx.c's tiled_gemm_silu, steps of 11-64 rows), so there `--kernel silu`
swaps silu in prefill and in steps of 10 rows or fewer, and a qgemm_amx.c
variant's tiled_gemm_silu pairs with the engine's; `--kernel mlp --without`
pairs that kernel against tiled_gemm with silu apart (the same answers).
Run: .venv/bin/python bench/kernel_pairs.py --kernel attend --variant /tmp/paged_int8.c
     .venv/bin/python bench/kernel_pairs.py --kernel matmul --variant /tmp/x/qgemm_amx.c
     .venv/bin/python bench/kernel_pairs.py --kernel silu --without [--waves 6 --rows 64]
A variant file is compiled as the engine compiles its own source (same flags;
it includes the headers beside it, so keep it in workers/scheduler/ or copy
kernels.h next to it). A matmul variant runs on the engine's packed weights:
one that lays its weights out otherwise reads them wrongly, and its timing
misleads too (round AB in bench/HISTORY.md: 1.011x read so, 1.017x on copies
in its own layout)."""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import tempfile
import time
from pathlib import Path

from pipeline.bench import make_prompts
from pipeline.config import SchedulerConfig
from pipeline.messages import Sampling
from pipeline.models import DEFAULT_MODEL, resolve_model
from pipeline.tokenizer import Tokenizer
from workers.scheduler import fused, native, paged, qgemm_amx, qgemm_vnni
from workers.scheduler.engine import Engine, EngineRequest
from workers.scheduler.layers import address

NOTHING = "void nothing(void) {}\n"  # called with a kernel's arguments, which it ignores
PROJECTIONS = ("qkv", "o", "gate_up", "down")
# a matmul source's name: (its functions' signatures, its flags, the engine's build)
MATMULS = {
    "qgemm_amx.c": (qgemm_amx.SIGNATURES, qgemm_amx.FLAGS, qgemm_amx.load),
    "qgemm_vnni.c": (qgemm_vnni.signatures("vnni"), qgemm_vnni.FLAGS, qgemm_vnni.load),
    "qgemm_avx2.c": (qgemm_vnni.signatures("avx2"), qgemm_vnni.FLAGS_AVX2,
                     qgemm_vnni.load_avx2),
}


def nothing() -> tuple[int, object]:
    """A no-op's address, and its library (which must stay loaded while in use)."""
    scratch = Path(tempfile.gettempdir()) / "kernel_pairs_nothing.c"
    scratch.write_text(NOTHING)
    lib = ctypes.CDLL(str(native.build(scratch)))
    return address(lib.nothing), lib


def variant_address(engine: Engine, kernel: str, source: Path | None) -> tuple[int, object]:
    """The function to pair against the engine's own `kernel` (a field of layers.c's
    Model): `source` built with the engine's flags for it, or a no-op; and its
    library, which must stay loaded while the pointer is in use."""
    if source is None:
        return nothing()
    if kernel == "attend":
        int8 = hasattr(engine.attention.kernel, "int8")  # paged.InPlace on an 8-bit cache
        name, signatures = ("paged_decode_int8", paged.INT8_SIGNATURES) if int8 else (
            "paged_decode", paged.SIGNATURES)
        flags = paged.INT8_FLAGS if int8 else wide_flags()
    else:
        name = {"norm": "add_rms_norm", "rope": "rope", "silu": "silu_mul"}[kernel]
        signatures, flags = fused.SIGNATURES, wide_flags()
    lib = native.load(source, signatures, flags, frozenset())  # the engine runs it here
    if lib is None:
        sys.exit(f"{source} did not build (see the log above)")
    return address(getattr(lib, name)), lib


def wide_flags() -> tuple[str, ...]:
    """The flags native.load_best builds ops.c and paged_attention.c with here."""
    return native.AVX512 if native.NEEDS_AVX512 <= native.cpu_flags() else ()


def one_wave(engine: Engine, tokenizer: Tokenizer, rows: int, seed: int, swap,
             prefill_side: str) -> dict:
    """`rows` fresh prompts: their prefill on one side, then each full decode step
    on the side that has run fewer."""
    sampling = Sampling(max_tokens=64, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(make_prompts(rows, 24, seed)):
        engine.add(EngineRequest(f"{seed}-{i}", tokenizer.encode(prompt), [], sampling))
    swap(prefill_side)
    started = time.perf_counter()
    while engine.batcher.waiting or not all(s.is_decoding for s in engine.batcher.running):
        engine.step()
    prefill_ms = 1000 * (time.perf_counter() - started)
    steps: dict[str, list[float]] = {"engine's": [], "other": []}
    while engine.has_work():
        full = len(engine.batcher.running) == rows
        side = "other" if len(steps["other"]) < len(steps["engine's"]) else "engine's"
        swap(side)
        started = time.perf_counter()
        engine.step()
        if full:
            steps[side].append(1000 * (time.perf_counter() - started))
    swap("engine's")
    return {"prefill_side": prefill_side, "prefill_ms": prefill_ms, "steps": steps}


def matmul_swaps(engine: Engine, source: Path | None) -> tuple[list, object]:
    """(a layer's Proj, "fn", the engine's function, the other) for every projection
    of every regime whose function the variant replaces (all of them for a
    no-op); and the variant's library, which must stay loaded while in use."""
    if source is None:
        other, lib = nothing()
        replace = None
    else:
        if source.name not in MATMULS:
            sys.exit(f"--kernel matmul: name the file as one of {', '.join(MATMULS)}")
        signatures, flags, own_build = MATMULS[source.name]
        own_lib, lib = own_build(), native.load(source, signatures, flags, frozenset())
        if own_lib is None or lib is None:
            sys.exit(f"{source}: the engine runs no such build here, or it did not build")
        replace = {address(getattr(own_lib, name)): address(getattr(lib, name))
                   for name in signatures}
    projections = [getattr(layer, name) for _, layers in engine.model.driver.regimes
                   for layer in layers for name in PROJECTIONS]
    swaps = [(proj, "fn", proj.fn, other if replace is None else replace.get(proj.fn))
             for proj in projections]
    return [swap for swap in swaps if swap[3] is not None], lib


def mlp_swaps(engine: Engine) -> list:
    """(holder, field, the engine's, the other) taking silu out of every layer's
    gate_up that makes it (qgemm_amx.c's tiled_gemm_silu, beside AMX's tiles)
    back to tiled_gemm and silu's own pass: the same answers either way."""
    tiles = qgemm_amx.load()
    if tiles is None:
        return []
    layers = [layer for _, regime in engine.model.driver.regimes for layer in regime
              if layer.gate_up_silu]
    return [swap for layer in layers
            for swap in ((layer.gate_up, "fn", layer.gate_up.fn, address(tiles.tiled_gemm)),
                         (layer, "gate_up_silu", 1, 0))]


def run(engine: Engine, tokenizer: Tokenizer, kernel: str, source: Path | None, waves: int,
        rows: int) -> list[dict]:
    """The waves, the engine's own kernels put back at the end."""
    if kernel == "matmul":
        swaps, _lib = matmul_swaps(engine, source)
        if not swaps:
            sys.exit(f"{source}: no layer projection here runs on its functions")
    elif kernel == "mlp":
        swaps = mlp_swaps(engine)
        if not swaps:
            sys.exit("no layer here makes silu in its gate_up (AMX's tiles only)")
    else:
        model = engine.model.driver.model
        other, _lib = variant_address(engine, kernel, source)
        swaps = [(model, kernel, getattr(model, kernel), other)]

    def swap(side: str) -> None:
        for holder, field, own, theirs in swaps:
            setattr(holder, field, own if side == "engine's" else theirs)

    try:
        return [one_wave(engine, tokenizer, rows, 7000 + wave, swap,
                         "other" if wave % 2 else "engine's") for wave in range(waves)]
    finally:
        swap("engine's")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kernel", choices=("attend", "norm", "rope", "silu", "matmul", "mlp"),
                        required=True)
    side = parser.add_mutually_exclusive_group(required=True)
    side.add_argument("--variant", type=Path, help="a C source to build and pair against")
    side.add_argument("--without", action="store_true", help="pair against a no-op")
    parser.add_argument("--waves", type=int, default=6)
    parser.add_argument("--rows", type=int, default=64, help="requests a wave, so decode rows")
    args = parser.parse_args()
    if args.waves < 2:
        parser.error("--waves must be 2 or more: prefills alternate wave by wave")
    if args.kernel == "mlp" and not args.without:
        parser.error("--kernel mlp pairs the tiles' silu against silu apart: give --without")
    model = resolve_model(DEFAULT_MODEL)
    engine = Engine(model.path, SchedulerConfig(max_running_requests=max(64, args.rows)))
    if engine.model.driver is None:
        sys.exit("this host runs no layers.c driver (layers.Driver.build): nothing to swap")
    name = "without it" if args.without else str(args.variant)
    waves = run(engine, Tokenizer(model.path), args.kernel, args.variant, args.waves, args.rows)
    ratios = []
    for number, wave in enumerate(waves):
        ours, theirs = (statistics.median(wave["steps"][s]) for s in ("engine's", "other"))
        ratios.append(theirs / ours)
        print(f"wave {number + 1}: {args.rows}-row decode steps {ours:.2f} ms (engine's "
              f"{args.kernel}), {theirs:.2f} ({name}): {theirs / ours:.3f}x; prefill "
              f"{wave['prefill_ms']:.0f} ms on the {wave['prefill_side']} side")
    own_ms, other_ms = (statistics.median(w["prefill_ms"] for w in waves
                                          if w["prefill_side"] == side)
                        for side in ("engine's", "other"))
    print(f"decode steps, {name} / engine's: median {statistics.median(ratios):.3f}x "
          f"({min(ratios):.3f}-{max(ratios):.3f}); prefill median {other_ms:.0f} ms against "
          f"{own_ms:.0f} (waves apart, on prompts of their own)")


if __name__ == "__main__":
    main()
