"""Speed of the algorithm library on one step batch: 4096 sequences x 512 tokens, CPU, fp32.

Times (median of several runs) advantage estimation and the composed policy loss (surrogate +
train/rollout IS correction + KL loss + aggregation), forward and forward+backward, and prints
each as a ratio against a named baseline measured in the same run: `floor`, a single masked
pass `sum(where(mask, exp(logp - old) * A, 0))` -- the least any loss over these tensors costs.

Run: `.venv/bin/python benchmarks/algo_speed.py [--out report.md]`.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from molt.algo import (
    AdvantageInputs,
    AdvantageParams,
    ISCorrectionParams,
    ObjectiveParams,
    PolicyBatch,
    compute_advantages,
    policy_objective,
    step_denominators,
)

NUM_B, NUM_T, GROUP_SIZE = 4096, 512, 8


def median_seconds(fn: Callable[[], object], repeats: int = 7) -> float:
    fn()  # warm-up (allocator, lazy init)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def make_batch(gen: torch.Generator) -> dict[str, torch.Tensor]:
    lengths_b = torch.randint(NUM_T // 4, NUM_T, (NUM_B,), generator=gen)
    prompt_b = torch.randint(16, 128, (NUM_B,), generator=gen)
    positions = torch.arange(NUM_T)
    old = -torch.rand(NUM_B, NUM_T, generator=gen) * 3
    return dict(
        mask_bt=(positions >= prompt_b[:, None]) & (positions < lengths_b[:, None]),
        rewards_b=torch.randint(0, 2, (NUM_B,), generator=gen).float(),
        group_ids_b=torch.arange(NUM_B) // GROUP_SIZE,
        values_bt=torch.randn(NUM_B, NUM_T, generator=gen),
        old_logp_bt=old,
        logp_bt=old + 0.05 * torch.randn(NUM_B, NUM_T, generator=gen),
        rollout_logp_bt=old + 0.01 * torch.randn(NUM_B, NUM_T, generator=gen),
        ref_logp_bt=old + 0.1 * torch.randn(NUM_B, NUM_T, generator=gen),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="also write the table to this markdown file")
    args = parser.parse_args()
    d = make_batch(torch.Generator().manual_seed(0))
    mask = d["mask_bt"]
    logp = d["logp_bt"].clone().requires_grad_(True)
    inputs = AdvantageInputs(mask_bt=mask, rewards_b=d["rewards_b"], group_ids_b=d["group_ids_b"])
    gae_inputs = AdvantageInputs(mask_bt=mask, rewards_b=d["rewards_b"], values_bt=d["values_bt"])
    advantages_bt = compute_advantages("grpo", inputs)[0]
    params = ObjectiveParams(is_correction=ISCorrectionParams("token", "mask", 0.5, 2.0), kl_loss_coef=0.01)

    def floor() -> torch.Tensor:
        return torch.where(mask, (logp - d["old_logp_bt"]).exp() * advantages_bt, 0.0).sum()

    def loss() -> torch.Tensor:
        old, rollout, ref = d["old_logp_bt"], d["rollout_logp_bt"], d["ref_logp_bt"]
        batch = PolicyBatch(logp, mask, advantages_bt, old, rollout, ref)
        return policy_objective(batch, step_denominators([mask]), params)[0]

    def grpo_and_loss() -> torch.Tensor:
        nonlocal advantages_bt
        advantages_bt = compute_advantages("grpo", inputs)[0]
        return loss()

    with torch.no_grad():
        cases = {
            "floor (baseline)": median_seconds(floor),
            "advantages grpo": median_seconds(lambda: compute_advantages("grpo", inputs)),
            "advantages reinforce (gamma 0.99)": median_seconds(
                lambda: compute_advantages("reinforce", gae_inputs, AdvantageParams(gamma=0.99))
            ),
            "advantages gae": median_seconds(lambda: compute_advantages("gae", gae_inputs)),
            "loss ppo+IS+KL, forward": median_seconds(loss),
            "grpo + loss, forward": median_seconds(grpo_and_loss),
        }
    cases["grpo + loss, forward+backward"] = median_seconds(lambda: grpo_and_loss().backward())
    floor_s = cases["floor (baseline)"]
    setup = f"{NUM_B} x {NUM_T} tokens, fp32, {torch.get_num_threads()} threads, torch {torch.__version__}"
    lines = [
        f"# algo speed: {setup}",
        "",
        "| case | ms | x floor |",
        "|---|---:|---:|",
    ]
    lines += [f"| {name} | {sec * 1e3:.1f} | {sec / floor_s:.1f} |" for name, sec in cases.items()]
    print("\n".join(lines))
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
