"""Molt's own CPU kernels for the engine (fp32, AVX2/FMA, OpenMP), as torch operators: build, load, call.

- `gemm.c`: the linear layers' product over a weight packed once into 16-column panels, well ahead of MKL's
  sgemm at decoding's row counts (docs/engine.md has the measurements).
- `attention.c`: attention of one query token per row over its slot's cached keys (plus, optionally, its own
  new key), for decode rows and, in eager steps, prefill tokens.
- `norm.c`: RMSNorm in one pass per row, for eager steps (a compiled graph fuses its own).

`ops.cpp` wraps them as `molt_kernels::gemm`, `::decode_attention` and `::rms_norm`, compiled on first use with
the system C++ compiler (`$CXX`, else `c++`) against the running torch into `$MOLT_CACHE/kernels`; eager code
and compiled graphs call them alike. They share torch's OpenMP runtime, so they run on the calling thread's
pool. `load()` is False on CPUs without AVX2/FMA, when the build fails (logged once) or with
`MOLT_GEMM_KERNEL=0`; callers then keep torch's own ops."""

from __future__ import annotations

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
SOURCES = [Path(__file__).with_name(name) for name in ("ops.cpp", "gemm.c", "attention.c", "norm.c")]
FLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC", "-std=c++17"]
PANEL = 16  # output columns per packed panel (NR in gemm.c)


@functools.cache
def load() -> bool:
    """Build (into the cache, on first use) and load the operators; False where they cannot run here, or when
    `MOLT_GEMM_KERNEL=0` asks for torch's own ops (an A/B switch)."""
    if os.environ.get("MOLT_GEMM_KERNEL", "1") == "0":
        return False
    capability = torch.backends.cpu.get_cpu_capability()
    if platform.machine().lower() not in ("x86_64", "amd64") or capability not in ("AVX2", "AVX512"):
        return False
    flags = [*FLAGS, *_torch_flags()]
    sources = b"".join(p.read_bytes() for p in SOURCES)
    key = hashlib.sha256(sources + " ".join([*flags, torch.__version__]).encode()).hexdigest()[:16]
    path = cache_root() / "kernels" / f"ops-{key}.so"
    try:
        if not path.exists():
            _build(shutil.which(os.environ.get("CXX", "c++")), flags, path)
        torch.ops.load_library(str(path))
    except (OSError, TypeError) as e:
        log.warning("Molt's CPU kernels unavailable (%s); the engine uses torch's own ops", e)
        return False
    torch.library.register_fake("molt_kernels::gemm")(lambda x, packed, n: x.new_empty((*x.shape[:-1], n)))
    torch.library.register_fake("molt_kernels::decode_attention")(lambda q, *_: q.new_empty(q.shape))
    torch.library.register_fake("molt_kernels::rms_norm")(lambda x, *_: x.new_empty(x.shape))
    return True


def usable(tensor: torch.Tensor) -> bool:
    """Whether the kernels can work on this tensor's data (fp32 on CPU) and are loaded."""
    return tensor.device.type == "cpu" and tensor.dtype == torch.float32 and load()


def _torch_flags() -> list[str]:
    """Headers, libraries and ABI of the running torch (so the cache key changes with it)."""
    root = Path(torch.__file__).parent
    inc, lib, abi = root / "include", root / "lib", int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return [f"-I{inc}", f"-D_GLIBCXX_USE_CXX11_ABI={abi}", f"-L{lib}", f"-Wl,-rpath,{lib}", "-lc10", "-ltorch_cpu"]


def _build(compiler: str | None, flags: list[str], path: Path) -> None:
    """Compile the operator to `path` atomically (concurrent builders each write a temp file, then rename)."""
    if compiler is None:
        raise OSError("no C++ compiler (set $CXX)")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
    os.close(fd)
    try:
        done = subprocess.run([compiler, str(SOURCES[0]), "-o", tmp, *flags], capture_output=True, text=True)
        if done.returncode:
            raise OSError(f"{compiler} failed: {done.stderr.strip()[-2000:]}")
        os.replace(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)


def pack(weight_nk: torch.Tensor) -> torch.Tensor:
    """`weight_nk` [N, K] as [ceil(N / 16), K, 16]: each panel's 16 output columns side by side, zero padded."""
    n, k = weight_nk.shape
    panels = -(-n // PANEL)
    padded = weight_nk.new_zeros(panels * PANEL, k)
    padded[:n] = weight_nk
    return padded.view(panels, PANEL, k).transpose(1, 2).contiguous()


def matmul(x: torch.Tensor, packed: torch.Tensor, n: int) -> torch.Tensor:
    """`x @ weight.T` for the weight `packed` came from (its N rows given), x fp32 [..., K] on CPU; a RuntimeError
    for an input the kernel would misread. Needs `load()`."""
    return torch.ops.molt_kernels.gemm(x, packed, n)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`x * rsqrt(mean(x ** 2, -1) + eps) * weight` for fp32 `x` [..., D] on CPU, `weight` [D]. Needs `load()`."""
    return torch.ops.molt_kernels.rms_norm(x, weight, eps)


def decode_attention(
    q_bhd: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots_b: torch.Tensor,
    lens_b: torch.Tensor,
    new_k_bkd: torch.Tensor | None = None,
    new_v_bkd: torch.Tensor | None = None,
) -> torch.Tensor:
    """[B, H, D] attention of each row's query heads over `k_cache`/`v_cache` [slots, kv_heads, T, D] at slot
    `slots_b[b]`, positions 0..`lens_b[b]`-1, then over its own `new_k_bkd[b]` if given; query head h reads kv
    head h // (H / kv_heads); scaled by D ** -0.5. Needs `load()`."""
    args = (q_bhd, k_cache, v_cache, slots_b, lens_b, new_k_bkd, new_v_bkd)
    return torch.ops.molt_kernels.decode_attention(*args, q_bhd.shape[-1] ** -0.5)
