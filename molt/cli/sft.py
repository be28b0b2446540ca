"""`molt sft`: assemble supervised fine-tuning (tokenizer, model, rows, optimizer), train, evaluate, save.

The stage's pieces (tokenization, packing, the token-mean loss, the step) live in `molt/train/sft.py`.
Writes metrics.jsonl and an HF checkpoint (model + tokenizer) that `transformers` loads; with `--train.lora_rank`
only LoRA adapters train, and the checkpoint holds the merged weights plus the adapters in PEFT format (`adapter/`)."""

from __future__ import annotations

import dataclasses
import threading
import time
from dataclasses import dataclass

import torch

from molt.cli.build import architecture, build_model, build_tokenizer
from molt.cli.train import check_run_dir
from molt.config import Config
from molt.config.run import latest_checkpoint
from molt.engine.interface import eos_ids
from molt.log import RunDir, plot_metrics, read_metrics
from molt.loop.accounting import LoopState, check_same_rows
from molt.loop.checkpoint import load_training_state, save_checkpoint
from molt.train.lora import save_policy
from molt.train.packing import pack
from molt.train.precision import Precision
from molt.train.sft import SftTrainer, evaluate, sft_rows, shuffled_batches, tokenize_rows


@dataclass
class SftResult:
    run_dir: str
    checkpoint: str
    eval_before: dict[str, float]
    eval_after: dict[str, float]


def run_sft(cfg: Config, stop: threading.Event | None = None) -> SftResult:
    """The `molt sft` command; `--ckpt.every N` also saves resumable `checkpoints/step-N/` (`molt sft --resume RUN`).
    `stop` (a run's warm start on its build thread): set, the next step raises KeyboardInterrupt."""
    torch.manual_seed(cfg.train.seed)
    if cfg.runtime.threads:
        torch.set_num_threads(cfg.runtime.threads)
    resumed = check_run_dir(cfg, "sft")
    train_rows, eval_rows, digest = sft_rows(cfg)  # a bad data file: an error before the run directory and the model
    tokenizer, source = build_tokenizer(cfg.model), cfg.data.path or f"task {cfg.data.task}"
    row_len, mb, arch = cfg.data.max_len, cfg.train.micro_batch_tokens, architecture(cfg.model, tokenizer)
    stops = [tokenizer.convert_ids_to_tokens(i) for i in eos_ids(arch.stop_ids(), tokenizer)]  # the engine's
    ids, masks, pixels = tokenize_rows(tokenizer, train_rows, row_len, source, arch, stops)  # a too-long row: here
    eval_ids, eval_masks, eval_pixels = tokenize_rows(tokenizer, eval_rows, row_len, source, arch, stops)
    with RunDir(cfg.log.run_dir or cfg.ckpt.resume, "sft", cfg, resumed=resumed) as run:
        trainer, start = _trainer(cfg, tokenizer, digest)
        eval_batches = [b.to(cfg.runtime.device) for b in pack(eval_ids, eval_masks, row_len, mb, eval_pixels)]
        where = f"resumed at step {start}, " if start else ""
        run.print(f"{where}model {trainer.model.num_params() / 1e6:.2f}M params, {len(ids)} train / "
                  f"{len(eval_ids)} eval samples")  # fmt: skip
        before = _eval_before(run, trainer.model, eval_batches, start)
        sampler = shuffled_batches(len(ids), cfg.train.batch_size, cfg.train.seed)
        for _ in range(start):
            next(sampler)  # a resumed run draws the batches the run would have drawn
        for step in range(start + 1, cfg.train.max_steps + 1):
            if stop is not None and stop.is_set():  # the run that wanted it was cancelled
                raise KeyboardInterrupt
            t0 = time.perf_counter()
            picked = next(sampler)
            batches = pack(
                [ids[i] for i in picked], [masks[i] for i in picked], row_len, mb, [pixels[i] for i in picked]
            )
            metrics = trainer.step([b.to(cfg.runtime.device) for b in batches])
            dt = time.perf_counter() - t0
            metrics |= {"step": step, "train/tokens_per_s": sum(b.num_tokens for b in batches) / dt, "time/step_s": dt}
            run.log(metrics)
            if step % cfg.log.every == 0 or step == cfg.train.max_steps:
                run.print(
                    f"step {step}/{cfg.train.max_steps} loss {metrics['train/loss']:.4f} "
                    f"lr {metrics['train/lr']:.2e} {metrics['train/tokens_per_s']:.0f} tok/s"
                )
            if cfg.ckpt.every and (step % cfg.ckpt.every == 0 or step == cfg.train.max_steps):  # the last: finished
                state = LoopState(step=step, drops={}, data=digest)
                save_checkpoint(run.path, trainer, state, tokenizer, cfg.ckpt.keep)
        after = evaluate(trainer.model, eval_batches) if eval_batches else {}
        if after:
            run.log({"step": cfg.train.max_steps, **after})
        ckpt = save_policy(trainer.model, trainer.lora, run.path / "checkpoint", tokenizer, cfg.model.path)
    plot = plot_metrics(run.path, ["train/loss", "train/lr"])
    evals = f"eval loss {before['eval/loss']:.4f} -> {after['eval/loss']:.4f}" if after and before else "no eval rows"
    run.print(f"{evals}; checkpoint: {ckpt}; plot: {plot}")
    return SftResult(str(run.path), str(ckpt), before, after)


def _trainer(cfg: Config, tokenizer, digest: list) -> tuple[SftTrainer, int]:
    """The model (a resume's from its latest checkpoint) and its trainer, restored on a resume; the step it is at."""
    precision = Precision.of(cfg.model.dtype, cfg.train.precision, cfg.runtime.device)
    folder = latest_checkpoint(cfg.ckpt.resume) if cfg.ckpt.resume else None
    model_cfg = dataclasses.replace(cfg.model, path=str(folder), tokenizer="") if folder else cfg.model
    trainer = SftTrainer(build_model(model_cfg, tokenizer, cfg.train.seed, cfg.runtime.device, precision.params), cfg,
                         precision)  # fmt: skip
    if folder is None:
        return trainer, 0
    state = load_training_state(folder, trainer)
    check_same_rows(state.data, digest, cfg.data)
    return trainer, state.step


def _eval_before(run: RunDir, model, eval_batches: list, start: int) -> dict[str, float]:
    """The held-out loss before training, logged as step 0; a resumed run's from its metrics.jsonl."""
    if start:
        return next((row for row in read_metrics(run.path) if row.get("step") == 0 and "eval/loss" in row), {})
    before = evaluate(model, eval_batches) if eval_batches else {}
    if before:
        run.log({"step": 0, **before})  # as molt train logs its eval before the first step
    return before
