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


def packed(out_dim: int, in_dim: int, bits: int, generator: torch.Generator,
           on: str = "vnni") -> qgemm_vnni.Blocked:
    """A random 4- or 8-bit weight in the layout of the `on` kernel."""
    scale = torch.rand(out_dim, in_dim // 32, generator=generator) * 0.01
    if bits == 4:
        levels = torch.randint(0, 16, (out_dim, in_dim), generator=generator)
        return qgemm_vnni.pack_q4(levels, scale, -8 * scale, on=on)
    levels = torch.randint(-127, 128, (out_dim, in_dim), generator=generator)
    return qgemm_vnni.pack_q8(levels, scale, on=on)


def unit_ns(run, weights: list, rows: int) -> float:
    """ns a unit of `run` (one matmul of `rows` rows) over each of `weights` in
    turn, distinct as a step's layers are (best of 5 passes)."""

    def one_pass() -> float:
        start = time.perf_counter()
        for w in weights:
            run(w)
        return time.perf_counter() - start

    one_pass()
    units = rows * (weights[0].q.shape[1]) * (weights[0].out_dim // 16) * len(weights)
    return min(one_pass() for _ in range(5)) / units * 1e9


def step_weights(layers: int, lm_head: str = "lm_head") -> list[tuple[str, int, int, int, int]]:
    """SmolLM2-135M's projections (`layers` copies each) and its lm_head (one):
    name, out and in dims, bits, copies."""
    spec = read_spec(resolve_model(DEFAULT_MODEL).path)
    found = [(name, *shape, 4, layers) for name, shape in spec.projections().items()]
    return found + [(lm_head, spec.vocab_size, spec.hidden_size, 8, 1)]


def kernel_ns(out_dim: int, in_dim: int, bits: int, rows: int, copies: int) -> float:
    """ns a unit of our kernel over `copies` distinct weights (best of 5 passes)."""
    generator = torch.Generator().manual_seed(out_dim + in_dim)
    weights = [packed(out_dim, in_dim, bits, generator) for _ in range(copies)]
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

    return unit_ns(run, weights, rows)


def parse_args(argv: list[str] | None, doc: str) -> argparse.Namespace:
    """--rows and --layers, as each bound script takes them."""
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--layers", type=int, default=30,
                        help="distinct weights a projection, streaming as in a step")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv, __doc__)
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
    for name, out_dim, in_dim, bits, copies in step_weights(args.layers, "lm_head (argmax)"):
        ns = kernel_ns(out_dim, in_dim, bits, args.rows, copies)
        print(f"| {name} {out_dim}x{in_dim} | {bits} | {ns:.3f} | {ns / alone[bits]:.2f}x |")


if __name__ == "__main__":
    main()
