"""The warm start of `molt train`: a preset SFT-trained on the task's demonstrations, trained once and cached.

Cached under `cache_root()/warmstart/<key>`, the key naming the model and data settings, the seed, the run's
AdamW and precision settings (its SFT uses them) and the rows (a data file's all, a task's first few: a changed file
or task definition is not served stale). Runs sharing the cache train a warm start once (a file lock: the others
wait for it); one a crash or a full disk left unreadable is trained again. Full fine-tuning, also when the RL run
trains LoRA adapters."""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import shutil
import sys
import threading
from pathlib import Path
from typing import Any

from safetensors import SafetensorError, safe_open

from molt import cache_root
from molt.config import CkptConfig, Config, ConfigError, TrainConfig
from molt.config.base import changed
from molt.data.dataset import dataset_rows, has_demonstrations, rows_digest

OPTIMIZER = ("weight_decay", "betas", "grad_clip", "min_lr_ratio", "precision")  # the run's, used by the SFT too


def _key_fields(group: Any, *newer: str) -> dict[str, Any]:
    """The fields of a config group that name a cached warm start; those added later (`newer`) only when set away
    from their defaults, so older caches stay valid."""
    moved = changed(group, *newer)
    return {k: v for k, v in dataclasses.asdict(group).items() if k not in newer or k in moved}


def warm_start(cfg: Config, train_rows: list[dict] | None = None, stop: threading.Event | None = None) -> str:
    """Path of an SFT checkpoint of the preset on the task's demonstrations (trained once, then cached); `stop` set
    stops its training (the run was cancelled)."""
    rows = train_rows if train_rows is not None else dataset_rows(cfg.data)[0]
    data = _key_fields(cfg.data, "eval_path", "split", "columns", "system_prompt", "shuffle")
    # a file's every row (it may change); a task's count and three of its rows (as a resume checks them: a change of
    # its generated rows, such as held-out prompts leaving them, moves those)
    sample = rows if cfg.data.path else rows_digest(rows)
    model = _key_fields(cfg.model, "router_fp32", "template_args")
    fields = dict(model=model, data=data, seed=cfg.train.seed, sample=sample, version=1)
    fields |= {"freeze_router": True} if cfg.train.freeze_router else {}  # the warm start freezes it too
    if moved := changed(cfg.train, *OPTIMIZER):  # the SFT's AdamW and precision are the run's
        fields["train"] = {k: getattr(cfg.train, k) for k in sorted(moved)}
    key = hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()[:16]
    folder = cache_root() / "warmstart" / key
    if not _cached(folder / "checkpoint"):  # (a read-only cache that holds it is served)
        try:
            folder.parent.mkdir(parents=True, exist_ok=True)
            with open(folder.parent / f"{key}.lock", "w") as lock:  # runs sharing the cache train it once
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:  # the others wait, then find it cached
                    print(f"waiting for another run's warm start of this model and data ({lock.name})",
                          file=sys.stderr, flush=True)  # fmt: skip
                    fcntl.flock(lock, fcntl.LOCK_EX)
                if not _cached(folder / "checkpoint"):
                    _train(cfg, folder, stop)
        except (OSError, SafetensorError) as e:  # a full disk, a read-only cache
            raise ConfigError(
                f"warm start: cannot write the cache {folder} ({e}); free space or set MOLT_CACHE"
            ) from None
    return str(folder / "checkpoint")


def _train(cfg: Config, folder: Path, stop: threading.Event | None = None) -> None:
    """`molt sft` of the preset into `folder`: the run's settings, the warm start's steps and lr, no LoRA."""
    from molt.cli.sft import run_sft

    shutil.rmtree(folder, ignore_errors=True)  # what an interrupted (or corrupted) warm start left
    steps, lora = cfg.model.warmstart_steps, ("lora_rank", "lora_alpha", "lora_targets")
    lora_off = {k: TrainConfig.__dataclass_fields__[k].default for k in lora}
    train = dataclasses.replace(cfg.train, max_steps=steps, lr=cfg.model.warmstart_lr, batch_size=32,
                                warmup_steps=min(10, steps), **lora_off)  # fmt: skip
    log = dataclasses.replace(cfg.log, run_dir=str(folder), wandb_project="")  # a cache, not a run
    ckpt = CkptConfig()  # the run's checkpoint settings are not the cached SFT's
    run_sft(dataclasses.replace(cfg, train=train, log=log, ckpt=ckpt), stop)


def _cached(checkpoint: Path) -> bool:
    """Whether `checkpoint` holds a warm start whose config and weights read (a crash or a full disk truncates them)."""
    try:
        json.loads((checkpoint / "config.json").read_text())
        with safe_open(str(checkpoint / "model.safetensors"), "pt") as f:
            f.keys()
    except Exception:  # noqa: BLE001 - a missing or unreadable config or weights file: train it again
        return False
    return True


def may_warm_start(cfg: Config) -> bool:
    """Whether the run's policy is a preset to warm-start (not `--model.path`, not a resume, warm-start steps)."""
    return not (cfg.ckpt.resume or cfg.model.path or cfg.model.warmstart_steps <= 0)


def wants_warm_start(cfg: Config, train_rows: list[dict], say=print) -> bool:
    """Warm-start a preset (not `--model.path`, not a resume) on a task's demonstrations, or on a data file
    whose every row has an assistant turn; prompt-only data skips it, saying so."""
    if not may_warm_start(cfg):
        return False
    if not cfg.data.path or has_demonstrations(train_rows):
        return True
    say(
        f"warm start skipped: {cfg.data.path} has prompts without assistant turns (nothing to imitate), so preset "
        f"{cfg.model.preset!r} starts from random weights; pass a pretrained model with --model.path (e.g. a "
        "`molt sft` checkpoint), or --model.warmstart_steps 0 to silence this"
    )
    return False
