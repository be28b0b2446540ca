"""Molt's own fp32 GEMM for the engine's linear layers (`gemm.c`): build, load, pack, multiply.

On a 2-core AMD EPYC, torch's fp32 `linear` (MKL sgemm) reaches a fraction of the FMA peak at the row
counts of decoding (1-64 rows), and oneDNN's prepacked product only part of the way. A plain register-tiled
kernel over a weight packed once into 16-column panels ran 2-5x sgemm at 1-16 rows, ~2x at 32 and still
1.1-1.2x at 512, on every weight of the 5M and 20M benchmark models (`benchmarks/engine.py` shows the engine's
rates; the kernel's sums differ from sgemm's only in rounding order).

The kernel is C compiled on first use with the system C compiler (`$CC`, else `cc`; ~1 s) into
`$MOLT_CACHE/kernels` and called through ctypes, which releases the GIL. It shares torch's OpenMP runtime
(the same `libgomp.so.1`), so it runs on the calling thread's pool with torch's thread count. `kernel()` is
None on CPUs without AVX2/FMA, when the build fails (logged once) or with `MOLT_GEMM_KERNEL=0`; callers
then keep `F.linear`.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from molt import cache_root

log = logging.getLogger(__name__)
SOURCE = Path(__file__).with_name("gemm.c")
FLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC"]
PANEL = 16  # output columns per packed panel (NR in gemm.c)


@functools.cache
def kernel() -> ctypes._CFuncPtr | None:
    """The loaded `molt_gemm_packed`, built into the cache on first use; None where it cannot run here, or
    when `MOLT_GEMM_KERNEL=0` asks for torch's sgemm (an A/B switch)."""
    if os.environ.get("MOLT_GEMM_KERNEL", "1") == "0":
        return None
    if platform.machine().lower() not in ("x86_64", "amd64") or torch.backends.cpu.get_cpu_capability() not in (
        "AVX2",
        "AVX512",
    ):
        return None
    source = SOURCE.read_bytes()
    compiler = shutil.which(os.environ.get("CC", "cc"))
    key = hashlib.sha256(source + " ".join(FLAGS).encode()).hexdigest()[:16]
    path = cache_root() / "kernels" / f"gemm-{key}.so"
    try:
        if not path.exists():
            _build(compiler, path)
        fn = ctypes.CDLL(str(path)).molt_gemm_packed
    except (OSError, subprocess.CalledProcessError, TypeError) as e:
        log.warning("engine GEMM kernel unavailable (%s); linear layers use torch's sgemm", e)
        return None
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3 + [ctypes.c_int]
    return fn


def _build(compiler: str | None, path: Path) -> None:
    """Compile gemm.c to `path` atomically (concurrent builders each write a temp file, then rename)."""
    if compiler is None:
        raise OSError("no C compiler (set $CC)")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
    os.close(fd)
    try:
        subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", tmp], check=True, capture_output=True)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def pack(weight_nk: torch.Tensor) -> torch.Tensor:
    """`weight_nk` [N, K] as [ceil(N / 16), K, 16]: each panel's 16 output columns side by side, zero padded."""
    n, k = weight_nk.shape
    panels = -(-n // PANEL)
    padded = weight_nk.new_zeros(panels * PANEL, k)
    padded[:n] = weight_nk
    return padded.view(panels, PANEL, k).transpose(1, 2).contiguous()


def matmul(x: torch.Tensor, packed: torch.Tensor, n: int) -> torch.Tensor:
    """`x @ weight.T` for the weight `packed` came from (its N rows given), x fp32 [..., K] on CPU."""
    if x.shape[-1] != packed.shape[1] or x.dtype != torch.float32 or x.device.type != "cpu":
        raise ValueError(f"matmul: x {x.dtype} {tuple(x.shape)} on {x.device} vs a [{n}, {packed.shape[1]}] weight")
    x_mk = x.reshape(-1, x.shape[-1]).contiguous()
    out_mn = x_mk.new_empty(x_mk.shape[0], n)
    threads = torch.get_num_threads()
    kernel()(x_mk.data_ptr(), packed.data_ptr(), out_mn.data_ptr(), x_mk.shape[0], x_mk.shape[1], n, threads)
    return out_mn.view(*x.shape[:-1], n)
