# Our C kernels (workers/scheduler/*.c), compiled once per source version into
# the user's cache with the system C compiler and loaded through ctypes.
# They link torch's own OpenMP runtime, so they share its thread pool. Where
# there is no compiler or no AVX2 and FMA, `load` says None and the caller
# keeps torch's ops.

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

from pipeline.models import default_cache_dir

log = logging.getLogger(__name__)
P, I32, I64, F32 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float  # for signatures
FLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC"]
# a second build of a kernel with 16-lane paths, where the CPU has them (load_best)
AVX512 = ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16")
NEEDS_AVX512 = frozenset({"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_bf16"})


def cpu_flags() -> set[str]:
    try:
        return set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return set()


def load(source: Path, signatures: dict[str, list], flags: tuple[str, ...] = (),
         needs: frozenset[str] = frozenset({"avx2", "fma"})) -> ctypes.CDLL | None:
    """The library with each function of `signatures` (name: argument types;
    they return nothing) declared; `flags` beyond FLAGS; `needs`: the CPU flags
    the kernel's code takes."""
    if platform.machine() not in ("x86_64", "AMD64") or not needs <= cpu_flags():
        return None
    try:
        lib = ctypes.CDLL(str(build(source, flags)))
    except (OSError, subprocess.SubprocessError) as error:
        log.warning("no %s kernel (%s): torch's own ops instead", source.stem, error)
        return None
    for name, argtypes in signatures.items():
        function = getattr(lib, name)
        function.argtypes, function.restype = argtypes, None
    return lib


def load_best(source: Path, signatures: dict[str, list]) -> ctypes.CDLL | None:
    """The AVX-512 build where the CPU takes it, else (or where that one cannot
    be built) the AVX2 one."""
    return load(source, signatures, AVX512, NEEDS_AVX512) or load(source, signatures)


def build(source: Path, flags: tuple[str, ...] = ()) -> Path:
    """The shared library, compiled on first use (named by a hash of the source,
    the headers beside it and the flags); concurrent builders each write their
    own file and rename it into place."""
    headers = b"".join(h.read_bytes() for h in sorted(source.parent.glob("*.h")))
    command = [*FLAGS, *flags]
    digest = hashlib.sha256(source.read_bytes() + headers + " ".join(command).encode())
    target = default_cache_dir().parent / "kernels" / f"{source.stem}-{digest.hexdigest()[:16]}.so"
    if target.exists():
        return target
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise OSError("no C compiler on PATH")
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, scratch = tempfile.mkstemp(dir=target.parent, suffix=".so")
    os.close(fd)
    try:
        subprocess.run([compiler, *command, str(source), "-o", scratch], check=True,
                       capture_output=True, timeout=120)
        os.replace(scratch, target)
    finally:
        if os.path.exists(scratch):
            os.unlink(scratch)
    return target
