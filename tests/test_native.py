"""Every kernel source compiles with each set of flags the engine builds it
with, whatever this CPU runs: where a build fails, `native.load` says None and
the engine takes torch's ops, so the kernel's own tests skip as on a CPU
without it, and a compile error would pass unseen (a change to qgemm_amx.c
did once, on a host with AMX: its tests skipped)."""

from __future__ import annotations

import os
import shutil

import pytest

from workers.scheduler import fused, layers, native, paged, qgemm, qgemm_amx, qgemm_vnni

BUILDS = [
    (fused.SOURCE, ()), (fused.SOURCE, native.AVX512),
    (paged.SOURCE, ()), (paged.SOURCE, native.AVX512), (paged.INT8_SOURCE, paged.INT8_FLAGS),
    (qgemm.SOURCE, ()), (qgemm.SOURCE_BF16, qgemm.FLAGS_BF16),
    (qgemm_vnni.SOURCE, qgemm_vnni.FLAGS), (qgemm_vnni.SOURCE_AVX2, qgemm_vnni.FLAGS_AVX2),
    (qgemm_amx.SOURCE, qgemm_amx.FLAGS), (layers.SOURCE, ()),
]


@pytest.mark.skipif(not (os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")),
                    reason="no C compiler")
@pytest.mark.parametrize(("source", "flags"), BUILDS,
                         ids=[f"{source.name}{'+' if flags else ''}" for source, flags in BUILDS])
def test_each_kernel_compiles_with_its_flags(source, flags):
    assert native.build(source, flags).exists()
