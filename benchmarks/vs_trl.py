"""Molt vs TRL's GRPOTrainer: same model, tokenizer, task, group size, batch and steps, in one run.

Task: Molt's built-in single-turn `arithmetic` task (TRL's GRPOTrainer generates single-turn
completions; Molt's multi-turn tool task has no TRL equivalent). Both start from the same Molt
warm start (an SFT checkpoint, HF format) and run GRPO with 8 prompts x 8 samples per step, fp32 on
CPU. Throughput = optimizer steps / wall seconds of training, on one clock for both: from the first step's
start (TRL: its `on_step_begin`; Molt: its loop's first rollout, after the engine started) to the last
step's end (TRL: `on_train_end`; Molt: its last weight sync). Each side's whole wall time (model load,
start-up, training) is reported too. Molt runs on-policy (`--rollout.max_staleness 0`, as TRL is) unless
`--staleness N` lets its rollouts run N versions ahead. Both final models are then evaluated by the same
evaluator (Molt's engine, 100 held-out prompts x 4 samples, temperature 1).
TRL is a benchmark-only dependency: `pip install trl`. Writes benchmarks/results/vs_trl.md.
Run: `.venv/bin/python benchmarks/vs_trl.py [--steps 40] [--staleness 0]`.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import tempfile
import time
from pathlib import Path

import torch

from molt.agents.builtin import env_for_task
from molt.agents.chat.agent import local_rollout
from molt.agents.runner import EpisodeLimits
from molt.cli.main import parse_config
from molt.cli.train import run_train
from molt.cli.warm_start import warm_start
from molt.data.dataset import dataset_rows
from molt.data.tasks import get_task
from molt.engine import SamplingParams, TorchEngine
from molt.engine.torch_engine import on_fresh_thread as _on_fresh_thread
from molt.loop.evaluate import evaluate
from molt.models import from_pretrained, load_tokenizer


def on_fresh_thread(fn, *args, threads: int):
    """`fn(*args)` on a fresh thread with `threads` torch threads (Molt's async helper, run to completion)."""
    return asyncio.run(_on_fresh_thread(fn, *args, threads=threads))


FLAGS = [
    "--data.task", "arithmetic", "--model.warmstart_steps", "300", "--rollout.max_turns", "1",
    "--rollout.max_tokens", "8", "--rollout.prompts_per_step", "8", "--rollout.n_samples_per_prompt", "8",
    "--train.lr", "1e-4", "--train.warmup_steps", "0", "--train.min_lr_ratio", "1.0", "--rollout.filters", "nonfinite",
]  # fmt: skip
THREADS = 2


def run_trl(checkpoint: str, rows: list[dict], steps: int, out_dir: str) -> tuple[float, float]:
    """Train with TRL's GRPOTrainer; returns (seconds from its first step's start to the end of training, whole
    wall seconds from the model's load). Saves the final model to out_dir."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    marks: dict[str, float] = {}

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            marks.setdefault("first_step", time.perf_counter())

        def on_train_end(self, args, state, control, **kwargs):
            marks["end"] = time.perf_counter()

    task = get_task("arithmetic")
    data = Dataset.from_list([{"prompt": r["messages"], "label": r["label"]} for r in rows])

    def reward(completions, label, **_):
        return [task.grade({"label": lab}, c[0]["content"]) for c, lab in zip(completions, label, strict=True)]

    args = GRPOConfig(
        output_dir=out_dir, max_steps=steps, per_device_train_batch_size=64, num_generations=8,
        gradient_accumulation_steps=1, steps_per_generation=1, num_iterations=1, max_completion_length=8,
        learning_rate=1e-4, lr_scheduler_type="constant", warmup_steps=0, beta=0.0, temperature=1.0, use_cpu=True,
        bf16=False, report_to=[], logging_steps=1000, save_strategy="no", loss_type="grpo", scale_rewards="group",
        epsilon=0.2, epsilon_high=0.28, seed=0, dataloader_num_workers=0,
    )  # fmt: skip
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=data,
                          processing_class=load_tokenizer(checkpoint), callbacks=[Clock()])  # fmt: skip
    trainer.train()
    wall = time.perf_counter() - t0
    trainer.save_model(out_dir)
    load_tokenizer(checkpoint).save_pretrained(out_dir)
    return marks["end"] - marks["first_step"], wall


async def _eval(folder: str, rows: list[dict]) -> float:
    tokenizer = load_tokenizer(folder)
    engine = TorchEngine(
        from_pretrained(folder).eval(), tokenizer=tokenizer, num_slots=64, max_seq_len=128, num_threads=THREADS
    )
    sampling = SamplingParams(temperature=1.0, max_tokens=8, stop_token_ids=(tokenizer.eos_token_id,), seed=0)
    try:
        limits = EpisodeLimits(max_turns=1, max_len=128)
        rollout = local_rollout(None, engine, tokenizer, lambda: env_for_task("arithmetic"))
        metrics = await evaluate(tokenizer, rollout, rows=rows, sampling=sampling, limits=limits, n=4, seed=12345)
    finally:
        await engine.close()
    return metrics["eval/reward_mean"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--staleness", type=int, default=0, help="Molt's rollout.max_staleness (TRL: on-policy)")
    args = parser.parse_args()
    torch.set_num_threads(1)  # compute runs on threads whose OpenMP pool is the only one (see TorchEngine)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = parse_config([*FLAGS, "--train.max_steps", str(args.steps), "--eval.every", "0",
                            "--runtime.threads", str(THREADS), "--log.run_dir", os.path.join(tmp, "molt"),
                            "--log.every", "1000", "--rollout.max_staleness", str(args.staleness)])  # fmt: skip
        start = on_fresh_thread(warm_start, cfg, threads=THREADS)
        train_rows, eval_rows = dataset_rows(cfg.data)
        eval_rows = eval_rows[:100]
        t0 = time.perf_counter()
        molt = run_train(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, path=start)))
        molt_s = molt.history[-1]["time/elapsed_s"]  # the loop's wall, first rollout to last weight sync
        wall_molt = time.perf_counter() - t0
        trl_s, wall_trl = on_fresh_thread(run_trl, start, train_rows, args.steps, os.path.join(tmp, "trl"),
                                          threads=THREADS)  # fmt: skip
        rewards = {
            name: asyncio.run(_eval(folder, eval_rows))
            for name, folder in (("start", start), ("molt", molt.checkpoint), ("trl", os.path.join(tmp, "trl")))
        }
    table = ["| framework | steps | train seconds | steps/s | eval reward (start -> end) |", "|---|---|---|---|---|"]
    for name, seconds in (("TRL GRPOTrainer", trl_s), ("Molt", molt_s)):
        key = "trl" if name.startswith("TRL") else "molt"
        table.append(
            f"| {name} | {args.steps} | {seconds:.1f} | {args.steps / seconds:.3f} | "
            f"{rewards['start']:.3f} -> {rewards[key]:.3f} |"
        )
    text = (
        f"# Molt vs TRL GRPO (arithmetic, 8x8 per step, fp32 CPU, Molt at rollout.max_staleness {args.staleness}, "
        f"load {os.getloadavg()[0]:.1f})\n\n"
        + "\n".join(table)
        + f"\n\nMolt / TRL throughput, first step to last: **{trl_s / molt_s:.2f}x**; whole wall times (model load, "
        f"start-up, training; Molt's also its final checkpoint): Molt {wall_molt:.1f} s, TRL {wall_trl:.1f} s, "
        f"**{wall_trl / wall_molt:.2f}x**\n"
    )
    print(text)
    (Path(__file__).parent / "results" / "vs_trl.md").write_text(text)


if __name__ == "__main__":
    main()
