"""MoE and multimodal throughput: what a sparse or vision policy costs in Molt's rollout and training.

MoE section (this file's `moe_*` functions). The `tiny-moe` preset (8 experts, top-2, expert width
192) against the dense `tiny` preset with `intermediate_size = 2 x 192`, i.e. equal *active*
parameters per token, random weights, fp32, in one process:

- rollout tok/s: `TorchEngine` generates `GROUPS` prompts x `N` samples of `NEW_TOKENS` tokens
  (continuous batching, all concurrent), generated tokens / wall time; for MoE with routing
  capture on (the default) and off;
- train tok/s: one `Trainer.step` (packed forward + backward + AdamW) on those rollouts, all tokens
  / wall time; for MoE with routing replay (`algo.routing_replay`) and without;
- capture + replay cost: MoE with both on vs a MoE run with capture off and the trainer's forward
  given no `Routing` at all (no record, no metrics, natural routing), as slowdown %. Goal <= 10%.
  The trainers run with `algo.moe_diff_both` off: its extra no-grad forward is a diagnostic, not replay.

Every variant is measured `REPEATS` times interleaved (A B A B ...) and the median kept, so load
from other processes hits all of them alike. VLM throughput (image prefill, visual-task samples/s) is
measured by `benchmarks/vlm.py`.

Run: `.venv/bin/python benchmarks/moe_vlm.py [--quick] [--out FILE]` (writes benchmarks/results/moe_vlm.md,
or FILE; `--quick` writes only with `--out`).
"""

from __future__ import annotations

import asyncio
import copy
import os
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import torch

from molt.agents.runner import record_completion
from molt.cli.main import parse_config
from molt.data.trajectory import Trajectory
from molt.engine import SamplingParams, TorchEngine
from molt.models import Transformer, build_builtin_tokenizer, preset
from molt.train.trainer import Trainer

GROUPS, N, PROMPT_LEN, NEW_TOKENS, REPEATS = 8, 4, 32, 48, 5
THREADS = 1  # one intra-op thread: on a shared 2-core machine two OpenMP threads stall each other badly


def moe_models() -> dict[str, Transformer]:
    vocab = len(build_builtin_tokenizer())
    moe = preset("tiny-moe", vocab_size=vocab)
    dense = preset("tiny", vocab_size=vocab, intermediate_size=moe.num_experts_per_tok * moe.moe_intermediate_size)
    gen = torch.Generator().manual_seed(0)
    return {"dense": Transformer(dense).init_weights(0.02, gen), "moe": Transformer(moe).init_weights(0.02, gen)}


def active_params(model: Transformer) -> int:
    cfg = model.cfg
    if not cfg.num_experts:
        return model.num_params()
    inactive = (cfg.num_experts - cfg.num_experts_per_tok) * 3 * cfg.hidden_size * cfg.moe_intermediate_size
    return model.num_params() - inactive * cfg.num_moe_layers()


def rollout(model: Transformer, record: bool) -> tuple[float, list[Trajectory]]:
    """(generated tokens/s, trajectories) for GROUPS x N samples."""
    engine = TorchEngine(copy.deepcopy(model).eval(), num_slots=GROUPS * N, max_seq_len=128, eos_token_ids=(),
                         seed=0, record_routing=record, num_threads=THREADS)  # fmt: skip
    gen = torch.Generator().manual_seed(1)
    vocab = model.cfg.vocab_size
    prompts = [torch.randint(0, vocab, (PROMPT_LEN,), generator=gen).tolist() for _ in range(GROUPS)]
    sampling = SamplingParams(n=N, max_tokens=NEW_TOKENS, seed=3)

    async def run():
        t0 = time.perf_counter()
        groups = await asyncio.gather(*(engine.generate_group(p, sampling) for p in prompts))
        dt = time.perf_counter() - t0
        await engine.close()
        return groups, dt

    groups, dt = asyncio.run(run())
    trajs = []
    for g, (prompt, group) in enumerate(zip(prompts, groups, strict=True)):
        for c in group:
            traj = Trajectory(group_id=g, rollout_id=len(trajs), reward=float(c.sample_index % 2))
            traj.extend_prompt(prompt)
            record_completion(traj, c, keep_ids=False)
            trajs.append(traj)
    return GROUPS * N * NEW_TOKENS / dt, trajs


def trainer_for(model: Transformer, flags: list[str], routing_off: bool = False) -> Trainer:
    name = "tiny-moe" if model.cfg.num_experts else "tiny"
    cfg = parse_config(["--model.preset", name, "--rollout.max_len", "128", "--data.max_len", "128",
                        "--train.lr", "1e-6", "--algo.no_moe_diff_both", *flags])  # fmt: skip
    trainer = Trainer(copy.deepcopy(model), cfg)
    if routing_off:  # baseline without any routing machinery: no replay ids, no Routing record or metrics
        trainer.moe_shape = (0, 0)
    return trainer


def train(trainer: Trainer, trajs: list[Trajectory]) -> float:
    """All tokens / wall time of one trainer step (packed forward + backward + AdamW)."""
    t0 = time.perf_counter()
    trainer.step(trajs)
    return sum(len(t.tokens) for t in trajs) / (time.perf_counter() - t0)


def moe_section(repeats: int) -> tuple[list[str], dict[str, float]]:
    models = moe_models()
    _, trajs = rollout(models["moe"], record=True)
    _, dense_trajs = rollout(models["dense"], record=False)
    trainers = {
        "dense": trainer_for(models["dense"], []),
        "moe, replay": trainer_for(models["moe"], ["--algo.routing_replay"]),
        "moe, live routing + metrics": trainer_for(models["moe"], []),
        "moe, no routing machinery": trainer_for(models["moe"], [], routing_off=True),
    }
    for name, trainer in trainers.items():  # warm-up step (allocations, optimizer state)
        train(trainer, dense_trajs if name == "dense" else trajs)
    variants = {
        ("rollout", "dense"): lambda: rollout(models["dense"], False)[0],
        ("rollout", "moe, capture on"): lambda: rollout(models["moe"], True)[0],
        ("rollout", "moe, capture off"): lambda: rollout(models["moe"], False)[0],
    } | {("train", name): partial(train, t, dense_trajs if name == "dense" else trajs) for name, t in trainers.items()}
    samples: dict[tuple[str, str], list[float]] = {k: [] for k in variants}
    for r in range(repeats):
        for key, fn in variants.items():
            samples[key].append(fn())
        print(f"repeat {r + 1}/{repeats} done (load {os.getloadavg()[0]:.1f})", flush=True)
    tps = {k: statistics.median(v) for k, v in samples.items()}
    rows = ["| stage | model / variant | params (active) | tok/s (median) | vs dense |", "|---|---|---|---|---|"]
    for (stage, variant), value in tps.items():
        model = models["dense" if variant == "dense" else "moe"]
        params = f"{model.num_params() / 1e6:.2f}M ({active_params(model) / 1e6:.2f}M)"
        ratio = value / tps[stage, "dense"]
        rows.append(f"| {stage} | {variant} | {params} | {value:.0f} | {ratio:.2f}x |")
    gen_tokens, train_tokens = GROUPS * N * NEW_TOKENS, sum(len(t.tokens) for t in trajs)
    with_both = gen_tokens / tps["rollout", "moe, capture on"] + train_tokens / tps["train", "moe, replay"]
    without = gen_tokens / tps["rollout", "moe, capture off"] + train_tokens / tps["train", "moe, no routing machinery"]
    cost = {
        "capture": tps["rollout", "moe, capture off"] / tps["rollout", "moe, capture on"] - 1,
        "replay": tps["train", "moe, no routing machinery"] / tps["train", "moe, replay"] - 1,
        "both": with_both / without - 1,
    }
    return rows, cost


def main() -> None:
    quick = "--quick" in sys.argv
    torch.set_num_threads(THREADS)
    load_start = os.getloadavg()[0]
    rows, cost = moe_section(2 if quick else REPEATS)
    summary = (
        f"Routing capture + replay cost (goal <= 10%): rollout capture {cost['capture']:+.1%}, "
        f"trainer replay {cost['replay']:+.1%}, one rollout + train cycle {cost['both']:+.1%}."
    )
    print("\n".join(rows) + "\n" + summary)
    text = (
        "# MoE throughput\n\n"
        f"torch {torch.__version__}, fp32, {THREADS} thread(s), {GROUPS} prompts x {N} samples x {NEW_TOKENS} "
        "new tokens "
        f"(prompt {PROMPT_LEN}); medians of {2 if quick else REPEATS} interleaved repeats. "
        f"Load average (1 min) at start / end: {load_start:.2f} / {os.getloadavg()[0]:.2f} "
        "(a shared 2-core machine: absolute numbers are noisy, ratios less so).\n\n"
        "## MoE: tiny-moe vs dense of equal active parameters\n\n" + "\n".join(rows) + "\n\n" + summary + "\n"
    )
    if quick and "--out" not in sys.argv:  # a quick run leaves the committed results alone
        return
    default = Path(__file__).parent / "results" / "moe_vlm.md"
    out = Path(sys.argv[sys.argv.index("--out") + 1]) if "--out" in sys.argv else default
    out.write_text(text)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
