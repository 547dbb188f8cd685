# Our AVX2 weight-only 4- and 8-bit matmuls (qgemm.c), compiled once per source
# version into the user's cache with the system C compiler and called through
# ctypes on fp32 activations. Where there is no compiler or no AVX2 and FMA,
# `load()` says None and the projections keep torch's own 4-bit kernel.

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch

from pipeline.models import default_cache_dir

log = logging.getLogger(__name__)
SOURCE = Path(__file__).with_name("qgemm.c")
FLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC"]


@dataclass(frozen=True)
class Packed:
    """One weight in the kernel's layout: [out, in / 32, 16 or 32] bytes, and fp32
    scales (and, 4-bit, minimums) [out, in / 32]."""
    bits: int
    q: torch.Tensor
    scale: torch.Tensor
    low: torch.Tensor | None


def pack_q4(levels: torch.Tensor, scales_zeros: torch.Tensor) -> Packed:
    """From quantize_int4's levels [out, in] and its [in / 32, out, 2] scales and
    zeros (w = (level - 8) * scale + zero)."""
    out_dim, in_dim = levels.shape
    q = levels.to(torch.uint8).reshape(out_dim, in_dim // 32, 2, 16)
    scale, zero = scales_zeros[..., 0].t().float(), scales_zeros[..., 1].t().float()
    return Packed(4, (q[:, :, 0] | (q[:, :, 1] << 4)).contiguous(), scale.contiguous(),
                  (zero - 8 * scale).contiguous())


def pack_q8(levels: torch.Tensor, scale: torch.Tensor) -> Packed:
    """From quantize_int8's levels [out, in] and scales [out, in / 32, 1]."""
    out_dim, in_dim = levels.shape
    return Packed(8, levels.to(torch.int8).reshape(out_dim, in_dim // 32, 32).contiguous(),
                  scale.reshape(out_dim, in_dim // 32).float().contiguous(), None)


def matmul(x: torch.Tensor, w: Packed) -> torch.Tensor:
    """x [rows, in] (any float dtype) @ w.T -> fp32 [rows, out]."""
    lib = load()
    x = x.float().contiguous()
    rows, in_dim = x.shape
    out = torch.empty(rows, w.q.shape[0])
    kernel = lib.q4_gemm if w.bits == 4 else lib.q8_gemm
    kernel(x.data_ptr(), rows, in_dim, w.q.data_ptr(), w.scale.data_ptr(),
           None if w.low is None else w.low.data_ptr(), out.data_ptr(), out.shape[1])
    return out


@cache
def load() -> ctypes.CDLL | None:
    from workers.scheduler.calibrate import cpu_flags

    if platform.machine() not in ("x86_64", "AMD64") or not {"avx2", "fma"} <= cpu_flags():
        return None
    try:
        lib = ctypes.CDLL(str(build()))
    except (OSError, subprocess.SubprocessError) as error:
        log.warning("no AVX2 4-bit kernel (%s): torch's own instead", error)
        return None
    pointer, i32 = ctypes.c_void_p, ctypes.c_int
    for kernel in (lib.q4_gemm, lib.q8_gemm):
        kernel.argtypes = [pointer, i32, i32, pointer, pointer, pointer, pointer, i32]
        kernel.restype = None
    return lib


def build() -> Path:
    """The shared library, compiled on first use; concurrent builders each write
    their own file and rename it into place."""
    source = SOURCE.read_bytes()
    digest = hashlib.sha256(source + " ".join(FLAGS).encode()).hexdigest()[:16]
    target = default_cache_dir().parent / "kernels" / f"qgemm-{digest}.so"
    if target.exists():
        return target
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise OSError("no C compiler on PATH")
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, scratch = tempfile.mkstemp(dir=target.parent, suffix=".so")
    os.close(fd)
    try:
        subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", scratch], check=True,
                       capture_output=True, timeout=120)
        os.replace(scratch, target)
    finally:
        if os.path.exists(scratch):
            os.unlink(scratch)
    return target
