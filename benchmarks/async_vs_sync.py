"""Asynchronous (max_staleness 1) vs synchronous (max_staleness 0) RL on the default recipe.

Both runs use the same warm start, seed, task, batch and number of steps (so the same number of
trained samples); throughput is trained samples / summed step wall time (eval excluded), and the
final held-out eval reward is reported for each. Run: `.venv/bin/python benchmarks/async_vs_sync.py
[--steps 60] [--seed 0]`; writes benchmarks/results/async_vs_sync.md.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

from molt.cli.main import parse_config
from molt.loop.run import run_train


def measure(staleness: int, steps: int, seed: int, tmp: str) -> dict[str, float]:
    flags = [
        "--rollout.max_staleness",
        str(staleness),
        "--train.max_steps",
        str(steps),
        "--train.seed",
        str(seed),
        "--eval.every",
        str(steps),
        "--log.run_dir",
        os.path.join(tmp, f"k{staleness}"),
        "--log.every",
        "1000",
    ]
    result = run_train(parse_config(flags))
    seconds = sum(m["time/step_s"] for m in result.history)
    samples = sum(m["train/num_samples"] for m in result.history)
    return {
        "samples_per_s": samples / seconds,
        "seconds": seconds,
        "samples": samples,
        "eval_before": result.eval_before["eval/reward_mean"],
        "eval_after": result.eval_after["eval/reward_mean"],
        "staleness_max": max(m["train/staleness_max"] for m in result.history),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        sync, async_ = (measure(k, args.steps, args.seed, tmp) for k in (0, 1))
    rows = [("sync (max_staleness 0)", sync), ("async (max_staleness 1)", async_)]
    table = [
        "| run | samples | RL seconds | samples/s | eval reward before -> after | max staleness |",
        "|---|---|---|---|---|---|",
    ]
    table += [
        f"| {name} | {r['samples']} | {r['seconds']:.1f} | {r['samples_per_s']:.1f} | "
        f"{r['eval_before']:.3f} -> {r['eval_after']:.3f} | {r['staleness_max']} |"
        for name, r in rows
    ]
    ratio = async_["samples_per_s"] / sync["samples_per_s"]
    text = (
        f"# Async vs sync RL (default recipe, {args.steps} steps, seed {args.seed}, load {os.getloadavg()[0]:.1f})"
        f"\n\n" + "\n".join(table) + f"\n\nthroughput ratio async / sync: **{ratio:.2f}x**\n"
    )
    print(text)
    out = Path(__file__).parent / "results" / "async_vs_sync.md"
    out.write_text(text)


if __name__ == "__main__":
    main()
