"""What trains on what, and how: the groups of the policy model (`model`), its data (`data`) and the optimiser
(`train`), each checking its own invariants."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from molt.config.base import ConfigError, changed, check, check_bounds, expand_user
from molt.errors import UserError

# `apply_chat_template`'s arguments that Molt sets per rendering, or that would make it return other than the text
TEMPLATE_CALL = ("conversation", "tools", "add_generation_prompt", "tokenize", "continue_final_message", "padding",
                 "truncation", "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask",
                 "tokenizer_kwargs")  # fmt: skip


@dataclass
class ModelConfig:
    """Which policy model to build or load."""

    preset: str = "tiny"
    """Built-in architecture with random weights (tiny, small, tiny-moe, tiny-vlm, qwen3-0.6b); used when `path` is
    empty."""
    path: str = ""
    """Hugging Face model folder (config.json + *.safetensors) to load instead of a preset, or a run directory
    (its latest checkpoint)."""
    tokenizer: str = ""
    """Tokenizer folder. Default: `path` when loading a folder, else Molt's built-in byte tokenizer."""
    template_args: str = ""
    """Options of the chat template, KEY=VALUE,... with JSON values (Qwen3: enable_thinking=false), in every
    rendering: training, eval, SFT and `molt serve` (as vLLM's chat_template_kwargs, for the whole server)."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Compute dtype: the engines' weights and the trainer's matmuls (`train.precision` says where the trainer's
    parameters live). auto: bfloat16 on CUDA, float32 elsewhere (bf16 matmuls are slow on most CPUs)."""
    init_std: float = 0.02
    """Standard deviation of the random init for presets."""
    warmstart_steps: int = 250
    """`molt train` on a preset: first `molt sft` this many steps on the task's demonstrations (cached)."""
    warmstart_lr: float = 2e-3
    """Learning rate of the warm-start SFT."""
    router_fp32: bool = True
    """MoE models: router matmul, softmax and the expert combine in fp32 whatever the parameter dtype (not saved in
    checkpoints, as no HF key holds it: give it again to runs, eval and serve of the checkpoint)."""

    def architecture(self):
        """The policy's `TransformerConfig`: its folder's config.json, or the preset (no weights read)."""
        from molt.models.config import PRESETS
        from molt.models.hf_io import load_config

        return load_config(self.path) if self.path else PRESETS[self.preset]

    def __post_init__(self) -> None:
        from molt.models.config import PRESETS

        check(self.preset in PRESETS or bool(self.path), "model.preset",
              f"unknown preset; use one of {sorted(PRESETS)}")  # fmt: skip
        check_finite(self, "model")
        check_bounds(self, init_std="> 0", warmstart_lr="> 0", warmstart_steps=">= 0 (0 = no warm start)")
        self.path = self.path and check_model_folder(self.path, "model.path")  # a run directory: its latest checkpoint
        expand_user(self, "tokenizer")
        check(not self.tokenizer or os.path.isdir(self.tokenizer), "model.tokenizer",
              f"folder {self.tokenizer!r} does not exist")  # fmt: skip
        self.template_kwargs()  # a malformed one: an error at start-up

    def template_kwargs(self) -> dict[str, object]:
        """`template_args` as keyword arguments of the chat template (a value that is no JSON stays a string)."""
        out = {}
        for item in filter(None, (s.strip() for s in re.split(r",(?=\s*\w+\s*=)", self.template_args))):  # [1,2]
            key, eq, value = (part.strip() for part in item.partition("="))
            check(bool(eq and key.isidentifier()), "model.template_args", f"{item!r} is not KEY=VALUE")
            check(key not in TEMPLATE_CALL, "model.template_args", f"{key} is an argument Molt sets, not an option")
            try:
                out[key] = json.loads(value)
            except json.JSONDecodeError:
                out[key] = value
        return out


def check_finite(group: object, prefix: str, allow_inf: tuple[str, ...] = ()) -> None:
    """A ConfigError naming `prefix.<field>` for a float field (or a float of a tuple field) of config dataclass
    `group` that is NaN or infinite; `allow_inf`: fields where +inf is a deliberate "no bound"."""
    for f in dataclasses.fields(group):
        value = getattr(group, f.name)
        for v in value if isinstance(value, tuple) else (value,):
            if isinstance(v, float) and not math.isfinite(v) and not (f.name in allow_inf and v == math.inf):
                raise ConfigError(f"{prefix}.{f.name}: must be a finite number, got {v}")


def check_model_folder(path: str, key: str) -> str:
    """The model folder `path` names (`~` expanded): itself, a `molt train` run directory's latest checkpoint or a
    `molt sft` run directory's checkpoint; else a ConfigError naming `key`."""
    folder = Path(path).expanduser()
    path = str(folder)
    gguf = ("a GGUF file: convert it to a model folder once with `python -c \"from molt.models.gguf import "
            "convert_gguf; convert_gguf('FILE.gguf', 'NEW_FOLDER')\"` and give that folder")  # fmt: skip
    check(folder.exists(), key, f"{path!r} does not exist")
    check(folder.is_dir() or folder.suffix != ".gguf", key, f"{path!r} is {gguf}")
    check(folder.is_dir(), key, f"{path!r} is a file; give a Hugging Face model folder (config.json + *.safetensors)")
    check((folder / "config.json").exists() or not any(folder.glob("*.gguf")), key, f"{path!r} holds {gguf}")
    if (folder / "config.json").exists():
        return _loadable(path, key)
    if (folder / "checkpoint" / "config.json").exists():  # molt sft's
        return _loadable(str(folder / "checkpoint"), key)
    pointer = folder / "checkpoints" / "latest"
    check(pointer.parent.is_dir(), key, f"{path!r} is not a model folder (no config.json) nor a run directory with "
          "checkpoints")  # fmt: skip
    check(pointer.exists(), key, f"run directory {path!r} has no completed checkpoint (no checkpoints/latest)")
    latest = pointer.parent / pointer.read_text().strip()
    check((latest / "config.json").exists(), key, f"{latest} (the run's latest checkpoint) has no config.json")
    return _loadable(str(latest), key)


def _loadable(folder: str, key: str) -> str:
    """`folder`, once its config.json names a supported architecture and it has safetensors weights."""
    from molt.models.hf_io import load_config, weight_files

    try:
        load_config(folder)
        weight_files(Path(folder))
    except (OSError, ValueError, UserError) as e:
        raise ConfigError(f"{key}: {e}") from None
    return folder


@dataclass
class DataConfig:
    """Where prompts and demonstrations come from."""

    task: str = "calculator"
    """Built-in task generating the data when `path` is empty."""
    path: str = ""
    """Dataset instead of a built-in task: .jsonl / .json / .parquet file, a `datasets` save_to_disk folder, or a
    folder of .jsonl/.parquet files. Rows hold chat `messages` or a `prompt` string; other columns reach the
    reward function or agent as the row."""
    eval_path: str = ""
    """Held-out dataset (same formats; also what `molt eval` scores). Default: a DatasetDict's test/validation
    split, else a seeded shuffled `num_eval` rows (at most 10%) of `path`, or the task's held-out rows."""
    split: str = "train"
    """Split read from a `datasets` DatasetDict folder, or from a folder whose files are named by split (the Hub's
    `train-00000-of-00002.parquet`, `test.jsonl`; a file named by none is train's)."""
    columns: str = ""
    """Column mapping TARGET=SOURCE[,...], e.g. `prompt=question,answer=solution` (copies the source column)."""
    system_prompt: str = ""
    """System message put first in every prompt that has none (plain `prompt` strings and chat rows)."""
    shuffle: bool = True
    """Shuffle the rows of `path` with `seed` (before the held-out split)."""
    num_train: int = 2000
    """Number of training rows generated by a built-in task (less those whose prompt is held out for eval)."""
    num_eval: int = 200
    """Number of held-out rows generated by a built-in task (or split off `path`, at most 10% of it)."""
    max_len: int = 256
    """`molt sft` and the warm start: longest sample in tokens; longer rows are an error naming the row (RL prompts
    are bounded by rollout.max_len: a longer one is dropped, counted as prompt_over_context)."""
    seed: int = 0
    """Seed of the built-in task generator and of the dataset shuffle."""

    def __post_init__(self) -> None:
        expand_user(self, "path", "eval_path")
        check_bounds(self, num_train="> 0", num_eval=">= 0", max_len="> 1")
        from molt.data.formats import detect_format
        from molt.data.rows import parse_columns
        from molt.data.tasks import TASKS

        check(self.task in TASKS, "data.task", f"unknown task; built-in tasks: {sorted(TASKS)}")
        for key in ("path", "eval_path"):
            value = getattr(self, key)
            check(not value or os.path.exists(value), f"data.{key}", f"file {value!r} does not exist")
            try:
                value and detect_format(value)
            except (ValueError, UserError) as e:
                raise ConfigError(f"data.{key}: {e}") from None
        try:
            parse_columns(self.columns)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        for key in ("system_prompt", "columns"):  # a built-in task's rows are generated as they are
            check(bool(self.path or self.eval_path) or not getattr(self, key), f"data.{key}",
                  "applies to the rows of data.path / data.eval_path (a task's are generated as they are)")  # fmt: skip


@dataclass
class TrainConfig:
    """Optimisation: AdamW with warm-up + cosine decay, packing to a token budget."""

    lr: float = 1e-4
    """Peak learning rate (`molt sft` defaults to 2e-3)."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of `lr` (cosine decay after warm-up)."""
    warmup_steps: int = 10
    """Linear warm-up steps (at most `max_steps`: a shorter run warms up over all of it)."""
    max_steps: int = 60
    """Optimizer steps."""
    batch_size: int = 32
    """`molt sft` only: samples per optimizer step (RL's batch is rollout.prompts_per_step x n_samples_per_prompt)."""
    micro_batch_tokens: int = 4096
    """Tokens per packed micro-batch (gradient accumulation splits a step into these; exact, except the MoE
    load-balancing loss, computed per micro-batch)."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW betas."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value (0 disables)."""
    seed: int = 0
    """Seed for model init, data order and sampling."""
    check_tokens: Literal["cheap", "exhaustive"] = "cheap"
    """Token-exactness check per sample: hashes of engine actions, or full id comparison."""
    freeze_router: bool = False
    """MoE models: keep the router (gate) weights fixed: not optimized, not sent to the engines."""
    share_prefix: bool = True
    """Lay a group's common prompt out once in the packed forward (exact: same log-probs and gradients, except the MoE
    load-balancing loss, which counts packed positions)."""
    precision: Literal["mixed", "pure"] = "mixed"
    """mixed: fp32 parameters, gradients and AdamW states, forward/backward in `model.dtype` (autocast, or FSDP2's
    mixed-precision policy when sharded; float16 adds loss scaling). pure: parameters stored in `model.dtype`."""
    activation_checkpointing: bool = False
    """Recompute each dense decoder layer's activations in backward instead of keeping them (less memory, ~1/3
    more compute)."""
    logprob_chunk_tokens: int = 4096
    """Tokens per chunk of the LM head + log-softmax (its [tokens, vocab] fp32 logits are never built whole; capped
    at 2^27 logits per chunk, e.g. 883 tokens for a 150K vocabulary)."""
    compile: Literal["auto", "on", "off"] = "auto"
    """Regional compilation: each dense decoder layer's forward and the LM-head chunk through `torch.compile`
    (fused norms, RoPE, SwiGLU, FlexAttention in the graph; one compile serves all layers, tens of seconds once).
    auto: on for CUDA, off elsewhere (see docs/gpu.md)."""
    compile_backend: str = "inductor"
    """`torch.compile` backend for `train.compile` (`aot_eager` to debug a compile problem without inductor)."""
    lora_rank: int = 0
    """LoRA rank r (0 = full fine-tuning): only the adapters train, r x (d_in + d_out) parameters per target."""
    lora_alpha: float = 16.0
    """LoRA scale numerator: each target's update is (lora_alpha / lora_rank) * B @ A."""
    lora_targets: tuple[str, ...] = ("q", "k", "v", "o", "gate", "up", "down")
    """Linears LoRA adapts: q, k, v, o (attention), gate, up, down (dense MLPs; MoE experts are not adapted)."""

    def __post_init__(self) -> None:
        check_finite(self, "train")
        check(self.lr > 0, "train.lr", "must be > 0")
        check(-(2**63) <= self.seed < 2**63, "train.seed", "must fit in 64 bits (torch's seed)")
        check_bounds(self, lora_rank=">= 0 (0: no LoRA)", lora_alpha="> 0")
        unknown = sorted(set(self.lora_targets) - {"q", "k", "v", "o", "gate", "up", "down"})
        what = f"unknown {','.join(unknown)}; " if unknown else ""
        check(bool(self.lora_targets) and not unknown, "train.lora_targets", f"{what}choose from q,k,v,o,gate,up,down")
        for key in changed(self, "lora_alpha", "lora_targets"):
            check(self.lora_rank > 0, f"train.{key}", "has no effect here: LoRA is off (--train.lora_rank 0)")
        check(0 <= self.min_lr_ratio <= 1, "train.min_lr_ratio", "must be in [0, 1]")
        check_bounds(self, max_steps="> 0", warmup_steps=">= 0", batch_size="> 0", micro_batch_tokens="> 0")
        check_bounds(self, logprob_chunk_tokens="> 0", grad_clip=">= 0")
        check(all(0 <= b < 1 for b in self.betas), "train.betas", "each beta must be in [0, 1)")


def check_rl_batch(train: TrainConfig, max_len: int) -> None:
    """RL training refuses `train.batch_size` (no silent no-op: it is `molt sft`'s batch) and needs micro-batches
    that hold a whole episode of `rollout.max_len` tokens (`molt sft` and `molt eval` need no such thing)."""
    check(train.batch_size == TrainConfig.batch_size, "train.batch_size", "has no effect here: it is molt sft's "
          "batch; an RL step trains rollout.prompts_per_step x rollout.n_samples_per_prompt samples")  # fmt: skip
    check(train.micro_batch_tokens >= max_len, "train.micro_batch_tokens",
          f"({train.micro_batch_tokens}) must be >= rollout.max_len ({max_len})")  # fmt: skip
