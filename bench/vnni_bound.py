"""How near the VNNI matmuls run to their own instructions' bound: one thread,
our kernel's time a unit (a row, a group of 32 inputs and 16 outputs: 8
vpdpbusd and 2 or 3 FMAs) on each of SmolLM2-135M's layer projections and its
lm_head at 64 rows, weights streaming as in a step, against the same
instructions alone (bench/vnni_bound.c: 11 rows a weight block, nothing read
but L1). A ratio near 1: what is left is the instruction count, which the
checkpoint's format (a scale and a low a group of 32) sets.
Run: .venv/bin/python bench/vnni_bound.py [--rows 64 --layers 30]"""

from __future__ import annotations

import argparse
import ctypes
import time
from pathlib import Path

import torch

from pipeline.models import DEFAULT_MODEL, resolve_model
from workers.scheduler import native, qgemm_vnni
from workers.scheduler.model import read_spec


def bound_ns(lib: ctypes.CDLL, bits: int) -> float:
    """ns a unit of the instructions alone (best of 5, 11 rows a block)."""
    blocks = 2_000_000
    return min(lib.mix_seconds(blocks, bits) for _ in range(5)) / (blocks * 11) * 1e9


def kernel_ns(out_dim: int, in_dim: int, bits: int, rows: int, copies: int) -> float:
    """ns a unit of our kernel over `copies` distinct weights (best of 5 passes)."""
    generator = torch.Generator().manual_seed(out_dim + in_dim)
    weights = []
    for _ in range(copies):
        scale = torch.rand(out_dim, in_dim // 32, generator=generator) * 0.01
        if bits == 4:
            levels = torch.randint(0, 16, (out_dim, in_dim), generator=generator)
            weights.append(qgemm_vnni.pack_q4(levels, scale, -8 * scale, on="vnni"))
        else:
            levels = torch.randint(-127, 128, (out_dim, in_dim), generator=generator)
            weights.append(qgemm_vnni.pack_q8(levels, scale, on="vnni"))
    x = torch.randn(rows, in_dim, generator=generator).bfloat16()
    out = torch.empty(rows, out_dim)
    picks = torch.empty(rows, dtype=torch.int64)
    lib = qgemm_vnni.load()
    kernel = getattr(lib, f"q{bits}_gemm_vnni")

    def run(w: qgemm_vnni.Blocked) -> None:
        if bits == 8:  # the lm_head as greedy steps run it: each row's best kept, no logits
            lib.q8_argmax_vnni(x.data_ptr(), rows, in_dim, w.q.data_ptr(), picks.data_ptr(),
                               out_dim)
        else:  # a layer's projection, bf16 out
            kernel(x.data_ptr(), rows, in_dim, w.q.data_ptr(), out.data_ptr(), 1, out_dim)

    def one_pass() -> float:
        start = time.perf_counter()
        for w in weights:
            run(w)
        return time.perf_counter() - start

    one_pass()
    units = rows * (in_dim // 32) * (out_dim // 16) * copies
    return min(one_pass() for _ in range(5)) / units * 1e9


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--layers", type=int, default=30,
                        help="distinct weights a projection, streaming as in a step")
    args = parser.parse_args(argv)
    if qgemm_vnni.load() is None:
        raise SystemExit("no AVX-512 VNNI here: nothing to measure")
    torch.set_num_threads(1)
    lib = ctypes.CDLL(str(native.build(Path(__file__).with_name("vnni_bound.c"),
                                       qgemm_vnni.FLAGS)))
    lib.mix_seconds.argtypes, lib.mix_seconds.restype = [ctypes.c_long, ctypes.c_int], \
        ctypes.c_double
    alone = {bits: bound_ns(lib, bits) for bits in (4, 8)}
    print(f"the instructions alone: {alone[4]:.3f} ns a unit (4-bit), {alone[8]:.3f} (8-bit)")
    print("| weight | bits | ns a unit | against the instructions alone |")
    print("|---|---:|---:|---:|")
    spec = read_spec(resolve_model(DEFAULT_MODEL).path)
    rows = [(name, *shape, 4, args.layers) for name, shape in spec.projections().items()]
    rows.append(("lm_head (argmax)", spec.vocab_size, spec.hidden_size, 8, 1))
    for name, out_dim, in_dim, bits, copies in rows:
        ns = kernel_ns(out_dim, in_dim, bits, args.rows, copies)
        print(f"| {name} {out_dim}x{in_dim} | {bits} | {ns:.3f} | {ns / alone[bits]:.2f}x |")


if __name__ == "__main__":
    main()
