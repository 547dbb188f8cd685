"""What this machine's matmuls allow for SmolLM2-135M, with nothing else running:
peak GFLOP/s per dtype, and the time of one step's projections (30 layers of
qkv, o, gate_up, down, plus the lm_head) at 1, 16 and 64 rows, weights hot in
cache: fp32 through MKL and through oneDNN, bf16 through torch's matmul and
oneDNN (only on a CPU with a bf16 matmul: elsewhere it is emulated, ~150x
slower), 4-bit through torch's kernel and through ours (qgemm on fp32
activations, on bf16 where the CPU has avx512_bf16, and on AMX tiles where it
has amx_bf16; on int8 activations where it has avx512_vnni, or AVX2 alone). Any engine step
is slower than its row here.
Run: .venv/bin/python bench/ceilings.py [--threads N]"""

from __future__ import annotations

import argparse
import time

import torch

from pipeline.models import DEFAULT_MODEL, resolve_model
from workers.scheduler import qgemm, qgemm_amx, qgemm_vnni
from workers.scheduler.calibrate import cpu_has_bf16
from workers.scheduler.linear import Dense, Int4, Int8, Kernels, quantize_int4, quantize_int8
from workers.scheduler.model import read_spec

SPEC = read_spec(resolve_model(DEFAULT_MODEL).path)
HIDDEN, INTER = SPEC.hidden_size, SPEC.intermediate_size
LAYERS, VOCAB = SPEC.num_layers, SPEC.vocab_size
SHAPES = list(SPEC.projections().values())
PARAMS = LAYERS * sum(o * i for o, i in SHAPES) + VOCAB * HIDDEN


def best_ms(fn, reps: int = 5) -> float:
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times) * 1000


def peak_gflops(dtype: torch.dtype, n: int = 2048) -> float:
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    return 2 * n**3 / best_ms(lambda: a @ b) / 1e6


def step_ms(rows: int, kind: str) -> float:
    """One step's projections; each distinct shape once, scaled by its count."""
    generator = torch.Generator().manual_seed(0)
    total = 0.0
    for (out_dim, in_dim), count in [*((s, LAYERS) for s in SHAPES), ((VOCAB, HIDDEN), 1)]:
        weight = torch.randn(out_dim, in_dim, generator=generator) * 0.02
        x = torch.randn(rows, in_dim, generator=generator)
        if kind.startswith("4-bit"):
            int8 = "vnni" in kind or "avx2" in kind
            kernels = Kernels(qgemm="qgemm" in kind, amx="amx" in kind, vnni=int8)
            dtype = (torch.float32 if kind in ("4-bit torch", "4-bit qgemm", "4-bit avx2 int8")
                     else torch.bfloat16)
            if out_dim == VOCAB:  # the lm_head is 8-bit (Q8_0)
                levels, scale, _ = quantize_int8(weight)
                layer = Int8(weight, None, dtype, levels, scale, kernels)
            else:
                levels, scales_zeros, _ = quantize_int4(weight)
                layer = Int4(weight, None, dtype, levels, scales_zeros, kernels)
            layer.small_batch = rows
            xd = x.to(dtype)
            total += count * best_ms(lambda layer=layer, xd=xd: layer(xd))
        elif kind.endswith("onednn"):
            dtype = torch.bfloat16 if kind.startswith("bf16") else torch.float32
            dense, xd = Dense(weight, None, dtype, Kernels(onednn=True)), x.to(dtype)
            total += count * best_ms(lambda dense=dense, xd=xd: dense(xd))
        else:
            dtype = torch.float32 if kind == "fp32" else torch.bfloat16
            w, xd = weight.t().contiguous().to(dtype), x.to(dtype)
            total += count * best_ms(lambda w=w, xd=xd: xd @ w)
    return total


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"threads {torch.get_num_threads()}; {PARAMS / 1e6:.1f}M projection parameters")
    bf16 = cpu_has_bf16()
    for dtype in (torch.float32, torch.bfloat16) if bf16 else (torch.float32,):
        peak = peak_gflops(dtype)
        print(f"peak {str(dtype)[6:]:>8}: {peak:6.0f} GFLOP/s -> 64 rows of projections "
              f"in >= {64 * 2 * PARAMS / peak / 1e6:.0f} ms")
    kinds = ["fp32", "fp32 onednn", *(["bf16", "bf16 onednn"] if bf16 else []), "4-bit torch",
             *(["4-bit qgemm"] if qgemm.load() is not None else []),
             *(["4-bit qgemm bf16"] if qgemm.load_bf16() is not None else []),
             *(["4-bit amx"] if qgemm_amx.load() is not None else []),
             *(["4-bit vnni"] if qgemm_vnni.load() is not None else []),
             *(["4-bit avx2 int8"] if qgemm_vnni.library()[1] == "avx2"
               and qgemm_vnni.load_avx2() is not None else [])]
    with torch.inference_mode():
        for rows in (1, 16, 64):
            line = ", ".join(f"{kind} {step_ms(rows, kind):6.1f} ms" for kind in kinds)
            print(f"{rows:3d} rows: {line}")


if __name__ == "__main__":
    main()
