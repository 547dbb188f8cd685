"""Paired timing of builds of qgemm_avx2.c (the int8-activation matmul of CPUs
with AVX2 and no VNNI) on one decode step's weights at R rows: 30 layers (--layers) of
SmolLM2-135M's 4-bit projections, then its 8-bit lm_head, each build in turn
over 7 repetitions so that drift in the host's speed hits all of them; prints
each build's best time and its ratio to the first's, and stops if a build's
outputs differ from the first's. A build is a source file and, after a colon,
compiler flags joined by commas:
    .venv/bin/python bench/avx2_variants.py --rows 64 workers/scheduler/qgemm_avx2.c \
        workers/scheduler/qgemm_avx2.c:-DROWS=6 /tmp/mine.c:-DSOMETHING,-mtune=znver1
(round W in bench/HISTORY.md: the kernel runs 85% of a served C=64 step on an AMD
Zen 1, and no variant tried there beat it by more than the host's noise)."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from ceilings import (  # beside this script: bench/ is first on the path
    HIDDEN,
    INTER,
    LAYERS,
    SHAPES,
    VOCAB,
)

from workers.scheduler import native, qgemm_vnni


def build(spec: str):
    path, _, flags = spec.partition(":")
    extra = tuple(qgemm_vnni.FLAGS_AVX2) + tuple(f for f in flags.split(",") if f)
    lib = native.load(Path(path), qgemm_vnni.signatures("avx2"), extra, qgemm_vnni.NEEDS_AVX2)
    if lib is None:
        raise SystemExit(f"{spec}: no build (this CPU lacks AVX2, FMA or F16C, or no compiler)")
    return lib


def weights(layers: int) -> list[tuple[int, qgemm_vnni.Blocked]]:
    found = []
    for _ in range(layers):
        for out_dim, in_dim in SHAPES:
            levels = torch.randint(0, 16, (out_dim, in_dim))
            scale = torch.rand(out_dim, in_dim // 32) / 100
            found.append((4, qgemm_vnni.pack_q4(levels, scale, -8 * scale, on="avx2")))
    levels = torch.randint(-127, 128, (VOCAB, HIDDEN))
    found.append((8, qgemm_vnni.pack_q8(levels, torch.rand(VOCAB, HIDDEN // 32) / 100,
                                        on="avx2")))
    return found


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--layers", type=int, default=LAYERS)
    parser.add_argument("builds", nargs="+")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    libs, blocks = [build(spec) for spec in args.builds], weights(args.layers)
    x = {d: torch.randn(args.rows, d) for d in (HIDDEN, INTER)}
    y = {w.out_dim: torch.empty(args.rows, w.out_dim) for _, w in blocks}

    def run(lib, bits: int) -> None:
        for b, w in blocks:
            if b == bits:
                in_dim = w.q.shape[1] * 32  # [out / 16, groups, block]
                getattr(lib, f"q{b}_gemm_avx2")(x[in_dim].data_ptr(), args.rows, in_dim,
                                                w.q.data_ptr(), y[w.out_dim].data_ptr(), 0,
                                                w.out_dim)

    first = None
    for spec, lib in zip(args.builds, libs, strict=True):
        run(lib, 4)
        run(lib, 8)
        outputs = {n: t.clone() for n, t in y.items()}
        first = first or outputs
        for n, t in outputs.items():
            if (t - first[n]).abs().max() > 1e-3 * first[n].abs().max():
                raise SystemExit(f"{spec}: outputs of width {n} differ from the first build's")
    for bits, name in ((4, "4-bit projections"), (8, "8-bit lm_head")):
        best = [float("inf")] * len(libs)
        for _ in range(7):
            for i, lib in enumerate(libs):
                start = time.perf_counter()
                run(lib, bits)
                best[i] = min(best[i], time.perf_counter() - start)
        times = zip(args.builds, best, strict=True)
        print(f"{name} at {args.rows} rows: " + "  ".join(
            f"{spec}: {t * 1e3:.1f} ms ({t / best[0]:.2f}x)" for spec, t in times))


if __name__ == "__main__":
    main()
