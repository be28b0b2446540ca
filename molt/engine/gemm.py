"""Molt's own fp32 GEMM for the engine's linear layers (`gemm.c`): build, load, pack, multiply.

On a 2-core AMD EPYC, torch's fp32 `linear` (MKL sgemm) reaches a fraction of the FMA peak at the row
counts of decoding (1-64 rows), and oneDNN's prepacked product only part of the way. A plain register-tiled
kernel over a weight packed once into 16-column panels ran 2-5x sgemm at 1-16 rows, ~2x at 32 and still
1.1-1.2x at 512, on every weight of the 5M and 20M benchmark models (`benchmarks/engine.py` shows the engine's
rates; the kernel's sums differ from sgemm's only in rounding order).

The kernel (C, `gemm.c`) is compiled on first use with the system C++ compiler (`$CXX`, else `c++`; ~15 s)
into the torch operator `molt_kernels::gemm` (`gemm_op.cpp`), cached in `$MOLT_CACHE/kernels` per torch version.
As an operator it is called without Python in between from eager code and from compiled graphs alike. It shares
torch's OpenMP runtime (the same `libgomp.so.1`), so it runs on the calling thread's pool with torch's thread
count. `kernel()` is None on CPUs without AVX2/FMA, when the build fails (logged once) or with
`MOLT_GEMM_KERNEL=0`; callers then keep `F.linear`.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from molt import cache_root

log = logging.getLogger(__name__)
SOURCES = [Path(__file__).with_name(name) for name in ("gemm_op.cpp", "gemm.c")]
FLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC", "-std=c++17"]
PANEL = 16  # output columns per packed panel (NR in gemm.c)


@functools.cache
def kernel() -> Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor] | None:
    """The operator `molt_kernels::gemm`, built into the cache on first use; None where it cannot run here, or
    when `MOLT_GEMM_KERNEL=0` asks for torch's sgemm (an A/B switch)."""
    if os.environ.get("MOLT_GEMM_KERNEL", "1") == "0":
        return None
    if platform.machine().lower() not in ("x86_64", "amd64") or torch.backends.cpu.get_cpu_capability() not in (
        "AVX2",
        "AVX512",
    ):
        return None
    flags = [*FLAGS, *_torch_flags()]
    sources = b"".join(p.read_bytes() for p in SOURCES)
    key = hashlib.sha256(sources + " ".join([*flags, torch.__version__]).encode()).hexdigest()[:16]
    path = cache_root() / "kernels" / f"gemm-{key}.so"
    try:
        if not path.exists():
            _build(shutil.which(os.environ.get("CXX", "c++")), flags, path)
        torch.ops.load_library(str(path))
    except (OSError, subprocess.CalledProcessError, TypeError) as e:
        log.warning("engine GEMM kernel unavailable (%s); linear layers use torch's sgemm", e)
        return None
    op = torch.ops.molt_kernels.gemm
    torch.library.register_fake("molt_kernels::gemm")(lambda x, packed, n: x.new_empty((*x.shape[:-1], n)))
    return op


def _torch_flags() -> list[str]:
    """Headers, libraries and ABI of the running torch (so the cache key changes with it)."""
    root = Path(torch.__file__).parent
    return [
        f"-I{root / 'include'}",
        f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
        f"-L{root / 'lib'}",
        f"-Wl,-rpath,{root / 'lib'}",
        "-lc10",
        "-ltorch_cpu",
    ]


def _build(compiler: str | None, flags: list[str], path: Path) -> None:
    """Compile the operator to `path` atomically (concurrent builders each write a temp file, then rename)."""
    if compiler is None:
        raise OSError("no C++ compiler (set $CXX)")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
    os.close(fd)
    try:
        subprocess.run([compiler, str(SOURCES[0]), "-o", tmp, *flags], check=True, capture_output=True)
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
    """`x @ weight.T` for the weight `packed` came from (its N rows given), x fp32 [..., K] on CPU; a RuntimeError
    for an input the kernel would misread. Needs `kernel()`."""
    return torch.ops.molt_kernels.gemm(x, packed, n)
