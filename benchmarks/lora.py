"""LoRA vs full fine-tuning on CPU: training memory (parameters + gradients + AdamW state) and trainer step time.

Both runs train the same preset (random weights) on the same fixed batch of synthetic trajectories through
`Trainer.step` (packed forward, GRPO + PPO loss, backward, AdamW); the baseline is full fine-tuning measured in
the same run. Memory is counted from the tensors themselves (every parameter, every gradient, every optimizer
state after a step), so it is exact and device-independent; time is the median of a few steps.

Run: `.venv/bin/python benchmarks/lora.py [--preset tiny] [--rank 8] [--out benchmarks/results/lora.md]`.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

import torch

from molt.cli.main import parse_config
from molt.data.trajectory import Trajectory
from molt.models import Transformer, preset
from molt.train.trainer import Trainer


def batch(vocab: int, num_groups: int = 4, n: int = 4, seed: int = 0) -> list[Trajectory]:
    """Groups of one prompt (32 tokens) and one 96-token action each; rewards 0/1."""
    rng = random.Random(seed)
    trajs = []
    for g in range(num_groups):
        prompt = [rng.randrange(vocab) for _ in range(32)]
        for k in range(n):
            traj = Trajectory(group_id=g, rollout_id=g * n + k, reward=float(k % 2))
            traj.extend_prompt(prompt)
            ids = [rng.randrange(vocab) for _ in range(96)]
            traj.extend_action(ids, [-5.0] * len(ids), [0] * len(ids))
            trajs.append(traj)
    return trajs


def train_bytes(trainer: Trainer) -> dict[str, int]:
    """Bytes of parameters (model + adapters), gradients and optimizer states held by the trainer."""
    params = list(trainer.model.parameters()) + (list(trainer.lora.parameters()) if trainer.lora else [])
    states = [v for s in trainer.opt.state.values() for v in s.values() if torch.is_tensor(v)]
    nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
    return {
        "params": nbytes(params),
        "grads": nbytes(trainer.trainable()),  # fp32, alive from backward to the step (freed after it)
        "optimizer": nbytes(states),
        "trainable": sum(p.numel() for p in trainer.trainable()),
    }


def measure(name: str, rank: int, steps: int) -> dict:
    vocab = 512
    model = Transformer(preset(name, vocab_size=vocab)).init_weights(0.02, torch.Generator().manual_seed(0))
    flags = ["--model.preset", name, "--rollout.max_len", "256", "--data.max_len", "256", "--train.warmup_steps", "0"]
    trainer = Trainer(model, parse_config(flags + (["--train.lora_rank", str(rank)] if rank else [])))
    trajs = batch(vocab)
    trainer.step(trajs)  # warm-up; allocates gradients and AdamW states
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        trainer.step(trajs)
        times.append(time.perf_counter() - t0)
    return train_bytes(trainer) | {"step_s": statistics.median(times)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", default="benchmarks/results/lora.md")
    args = parser.parse_args()
    full, lora = measure(args.preset, 0, args.steps), measure(args.preset, args.rank, args.steps)
    total = lambda m: m["params"] + m["grads"] + m["optimizer"]  # noqa: E731
    lines = [
        f"# LoRA (rank {args.rank}, all 7 targets) vs full fine-tuning: preset {args.preset}, CPU, fp32, "
        f"{torch.get_num_threads()} threads",
        "",
        "| run | trainable params | params MB | grads MB | AdamW MB | total MB | step s |",
        "|---|---|---|---|---|---|---|",
    ]
    for label, m in (("full (baseline)", full), (f"lora r={args.rank}", lora)):
        mb = [m[k] / 2**20 for k in ("params", "grads", "optimizer")]
        lines.append(
            f"| {label} | {m['trainable']:,} | {mb[0]:.1f} | {mb[1]:.1f} | {mb[2]:.1f} | {sum(mb):.1f} "
            f"| {m['step_s']:.3f} |"
        )
    lines += [
        "",
        f"memory ratio lora/full: {total(lora) / total(full):.3f}; "
        f"step time ratio lora/full: {lora['step_s'] / full['step_s']:.3f}; "
        f"trainable ratio: {lora['trainable'] / full['trainable']:.4f}",
    ]
    report = "\n".join(lines) + "\n"
    print(report)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(report)


if __name__ == "__main__":
    main()
