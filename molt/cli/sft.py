"""`molt sft`: assemble supervised fine-tuning (tokenizer, model, rows, optimizer), train, evaluate, save.

The stage's pieces (tokenization, packing, the token-mean loss, the step) live in `molt/train/sft.py`.
Writes metrics.jsonl and an HF checkpoint (model + tokenizer) that `transformers` loads; with `--train.lora_rank`
only LoRA adapters train, and the checkpoint holds the merged weights plus the adapters in PEFT format (`adapter/`)."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import torch

from molt.cli.build import architecture, build_model, build_tokenizer
from molt.config import Config
from molt.engine.interface import eos_ids
from molt.log import RunDir, check_new_run_dir, plot_metrics
from molt.models import save_pretrained
from molt.train.lora import LoRA
from molt.train.optim import build_optimizer
from molt.train.packing import pack
from molt.train.precision import Precision
from molt.train.routing import freeze_routers
from molt.train.sft import evaluate, sft_rows, shuffled_batches, tokenize_rows, train_step


@dataclass
class SftResult:
    run_dir: str
    checkpoint: str
    eval_before: dict[str, float]
    eval_after: dict[str, float]


def run_sft(cfg: Config) -> SftResult:
    """The `molt sft` command."""
    torch.manual_seed(cfg.train.seed)
    if cfg.runtime.threads:
        torch.set_num_threads(cfg.runtime.threads)
    if cfg.log.run_dir:
        check_new_run_dir(cfg.log.run_dir)
    train_rows, eval_rows = sft_rows(cfg)  # a bad data file: an error before the run directory and the model
    tokenizer, source = build_tokenizer(cfg.model), cfg.data.path or f"task {cfg.data.task}"
    row_len, mb, arch = cfg.data.max_len, cfg.train.micro_batch_tokens, architecture(cfg.model, tokenizer)
    stops = [tokenizer.convert_ids_to_tokens(i) for i in eos_ids(arch.stop_ids(), tokenizer)]  # the engine's
    ids, masks, pixels = tokenize_rows(tokenizer, train_rows, row_len, source, arch, stops)  # a too-long row: here
    eval_ids, eval_masks, eval_pixels = tokenize_rows(tokenizer, eval_rows, row_len, source, arch, stops)
    with RunDir(cfg.log.run_dir, "sft", cfg) as run:
        precision = Precision.of(cfg.model.dtype, cfg.train.precision, cfg.runtime.device)
        model = build_model(cfg.model, tokenizer, cfg.train.seed, cfg.runtime.device, precision.params)
        scaler = precision.scaler()
        eval_batches = [b.to(cfg.runtime.device) for b in pack(eval_ids, eval_masks, row_len, mb, eval_pixels)]
        run.print(f"model {model.num_params() / 1e6:.2f}M params, {len(ids)} train / {len(eval_ids)} eval samples")
        tr = cfg.train
        freeze_routers(model, cfg)  # `train.freeze_router`: before the optimizer, which takes requires_grad params
        lora = LoRA(model, tr.lora_rank, tr.lora_alpha, tr.lora_targets) if tr.lora_rank else None
        opt, schedule = build_optimizer(lora.parameters() if lora is not None else model.parameters(), tr)
        before = evaluate(model, eval_batches) if eval_batches else {}
        if before:
            run.log({"step": 0, **before})  # as molt train logs its eval before the first step
        sampler = shuffled_batches(len(ids), cfg.train.batch_size, cfg.train.seed)
        for step in range(1, cfg.train.max_steps + 1):
            t0 = time.perf_counter()
            picked = next(sampler)
            batches = pack(
                [ids[i] for i in picked], [masks[i] for i in picked], row_len, mb, [pixels[i] for i in picked]
            )
            batches = [b.to(cfg.runtime.device) for b in batches]
            metrics = train_step(model, opt, schedule, batches, cfg.train.grad_clip, precision, scaler)
            dt = time.perf_counter() - t0
            metrics |= {"step": step, "train/tokens_per_s": sum(b.num_tokens for b in batches) / dt, "time/step_s": dt}
            run.log(metrics)
            if step % cfg.log.every == 0 or step == cfg.train.max_steps:
                run.print(
                    f"step {step}/{cfg.train.max_steps} loss {metrics['train/loss']:.4f} "
                    f"lr {metrics['train/lr']:.2e} {metrics['train/tokens_per_s']:.0f} tok/s"
                )
        after = evaluate(model, eval_batches) if eval_batches else {}
        if after:
            run.log({"step": cfg.train.max_steps, **after})
        with lora.merged() if lora is not None else contextlib.nullcontext():
            ckpt = save_pretrained(model, run.path / "checkpoint", tokenizer=tokenizer)
        if lora is not None:
            lora.save_peft(ckpt / "adapter", cfg.model.path)
    plot = plot_metrics(run.path, ["train/loss", "train/lr"])
    evals = f"eval loss {before['eval/loss']:.4f} -> {after['eval/loss']:.4f}" if after else "no eval rows"
    run.print(f"{evals}; checkpoint: {ckpt}; plot: {plot}")
    return SftResult(str(run.path), str(ckpt), before, after)
