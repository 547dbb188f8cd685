"""How near the AVX2 matmuls (qgemm_avx2.c, CPUs without VNNI) run to their own
tile's speed: one thread, the kernel's time a unit (a row, a group of 32 inputs
and 16 outputs) on each of SmolLM2-135M's layer projections and its lm_head at
64 rows, weights streaming as in a step, against the kernel's own 4-row tile
with its weights, activations and outputs in L1 (bench/avx2_bound.c, appended
to a copy of the kernel's source). A ratio near 1: the tile's instructions are
what is left (round AI in bench/HISTORY.md: an AMD Zen 3).
Run: .venv/bin/python bench/avx2_bound.py [--rows 64 --layers 30]"""

from __future__ import annotations

import ctypes
import shutil
import tempfile
from pathlib import Path

import torch
from vnni_bound import (  # beside this script: bench/ is on the path
    packed,
    parse_args,
    step_weights,
    unit_ns,
)

from workers.scheduler import native, qgemm_vnni

KERNELS = Path(qgemm_vnni.__file__).parent


def build_tile(folder: Path) -> ctypes.CDLL:
    """The kernel's source with the harness appended, built as the kernel is."""
    shutil.copy(KERNELS / "kernels.h", folder)
    source = folder / "avx2_bound.c"
    source.write_text((KERNELS / "qgemm_avx2.c").read_text()
                      + Path(__file__).with_name("avx2_bound.c").read_text())
    lib = ctypes.CDLL(str(native.build(source, qgemm_vnni.FLAGS_AVX2)))
    lib.tile_seconds.argtypes = [ctypes.c_long, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                                 ctypes.c_int]
    lib.tile_seconds.restype = ctypes.c_double
    return lib


def tile_ns(lib: ctypes.CDLL, in_dim: int, bits: int) -> float:
    """ns a unit of the tile alone (best of 5)."""
    generator = torch.Generator().manual_seed(in_dim)
    w = packed(16, in_dim, bits, generator, "avx2")
    x = torch.randn(4, in_dim, generator=generator)
    reps = 2_000_000 // in_dim
    best = min(lib.tile_seconds(reps, in_dim, x.data_ptr(), w.q.data_ptr(), bits)
               for _ in range(5))
    return best / (reps * 4 * (in_dim // 32)) * 1e9


def kernel_ns(out_dim: int, in_dim: int, bits: int, rows: int, copies: int) -> float:
    """ns a unit of the kernel over `copies` distinct weights (best of 5 passes)."""
    generator = torch.Generator().manual_seed(out_dim + in_dim)
    weights = [packed(out_dim, in_dim, bits, generator, "avx2") for _ in range(copies)]
    x = torch.randn(rows, in_dim, generator=generator)
    out = torch.empty(rows, out_dim)
    kernel = getattr(qgemm_vnni.load_avx2(), f"q{bits}_gemm_avx2")
    return unit_ns(lambda w: kernel(x.data_ptr(), rows, in_dim, w.q.data_ptr(), out.data_ptr(),
                                    0, out_dim), weights, rows)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv, __doc__)
    if qgemm_vnni.load_avx2() is None:
        raise SystemExit("no AVX2, FMA and F16C here, or no compiler: nothing to measure")
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as folder:
        lib = build_tile(Path(folder))
    print("| weight | bits | ns a unit | its tile in L1 | kernel / tile |")
    print("|---|---:|---:|---:|---:|")
    for name, out_dim, in_dim, bits, copies in step_weights(args.layers):
        ns, alone = kernel_ns(out_dim, in_dim, bits, args.rows, copies), tile_ns(lib, in_dim, bits)
        print(f"| {name} {out_dim}x{in_dim} | {bits} | {ns:.3f} | {alone:.3f} | "
              f"{ns / alone:.2f}x |")


if __name__ == "__main__":
    main()
