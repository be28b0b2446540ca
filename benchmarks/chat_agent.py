"""ChatAgent vs Env rollout throughput: the same task, model and engine, measured in one run.

Baseline: the built-in `single_turn` Env on the `arithmetic` task (`run_episode`: the framework owns the
LLM loop, no HTTP). Compared: `examples/openai_agent.py` and `examples/anthropic_agent.py` driving the same
engine through `ChatRunner` (SDK -> loopback chat server -> session capture -> engine), as `molt train
--rollout.agent examples/openai_agent.py` does. Each path runs `--rollouts` episodes with `--in-flight`
of them concurrent (as the RL loop keeps episodes in flight), at the rollout's settings (temperature 1,
eos stops). A warm-started arithmetic policy answers in 2-4 tokens, so per-request overhead, not the
engine, decides the ratio: `--max-tokens` (default 4) bounds every completion alike on all paths.
Reported: generated tokens/s per path (best of `--repeats`, paths interleaved) and each ChatAgent's
ratio to the Env. Goal: ChatAgent >= 0.7x the Env.

Run: `.venv/bin/python benchmarks/chat_agent.py [--quick]` (writes benchmarks/results/chat_agent.md).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import sys
import time
from pathlib import Path

import torch

from molt.agents.builtin import env_for_task
from molt.agents.chat.agent import ChatRunner, load_agent_class
from molt.agents.runner import EpisodeLimits, run_episode
from molt.data.tasks import get_task
from molt.engine import SamplingParams, TorchEngine
from molt.models import Transformer, preset
from molt.models.tokenizer import build_builtin_tokenizer

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
GROUP = 8  # rollout.n_samples_per_prompt's default
AGENTS = {"openai": EXAMPLES / "openai_agent.py", "anthropic": EXAMPLES / "anthropic_agent.py"}


async def rollouts(run_one, rows: list[dict], in_flight: int) -> tuple[int, float]:
    """(generated tokens, seconds) of one rollout per row, `in_flight` at a time."""
    gate = asyncio.Semaphore(in_flight)

    async def one(i: int, row: dict) -> int:
        async with gate:
            segments = await run_one(i, row)
            return sum(s.num_action_tokens for s in segments)

    t0 = time.perf_counter()
    tokens = sum(await asyncio.gather(*(one(i, row) for i, row in enumerate(rows))))
    return tokens, time.perf_counter() - t0


def paths(engine, tok, runner: ChatRunner, sampling: SamplingParams, limits: EpisodeLimits) -> dict:
    """Path name -> `run_one(i, row) -> segments`."""

    def sampled(i: int) -> SamplingParams:
        return SamplingParams(**{**sampling.__dict__, "seed": 1000 + i})

    async def env(i, row):
        return [await run_episode(engine, tok, env_for_task("arithmetic"), row, sampled(i), limits, rollout_id=i)]

    def agent(cls):
        async def run(i, row):
            return await runner.run(cls(), row, sampled(i), limits, rollout_id=i)

        return run

    return {"env": env} | {name: agent(load_agent_class(str(path))) for name, path in AGENTS.items()}


async def measure(args) -> dict[str, float]:
    tok = build_builtin_tokenizer()
    arch = preset("tiny", vocab_size=len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model = Transformer(arch).init_weights(0.02, torch.Generator().manual_seed(0)).eval()
    engine = TorchEngine(model, tokenizer=tok, num_slots=args.in_flight, max_seq_len=256)
    sampling = SamplingParams(temperature=1.0, max_tokens=args.max_tokens, stop_token_ids=(tok.eos_token_id,))
    limits = EpisodeLimits(max_turns=1, max_len=192)
    runner = ChatRunner(engine, tok)
    prompts = get_task("arithmetic").rows(args.rollouts // GROUP, seed=0)
    rows = [row for row in prompts for _ in range(GROUP)]  # n_samples_per_prompt rollouts of each prompt
    runs = paths(engine, tok, runner, sampling, limits)
    best = dict.fromkeys(runs, 0.0)
    try:
        await rollouts(runs["env"], rows[: args.in_flight], args.in_flight)  # warm-up: engine thread, server
        for name in ("openai", "anthropic"):
            await rollouts(runs[name], rows[: args.in_flight], args.in_flight)
        for _ in range(args.repeats):
            for name, run_one in runs.items():
                tokens, seconds = await rollouts(run_one, rows, args.in_flight)
                best[name] = max(best[name], tokens / seconds)
    finally:
        await runner.close()
        await engine.close()
    return best


def report(best: dict[str, float], args) -> str:
    env = best["env"]
    lines = [
        "# ChatAgent vs Env: rollout throughput on the same task and engine",
        "",
        f"`benchmarks/chat_agent.py`: `arithmetic` task, `tiny` preset (random weights, fp32, built-in byte "
        f"tokenizer), {args.rollouts} single-turn rollouts per path ({GROUP} per prompt) with {args.in_flight} in "
        f"flight, max_tokens {args.max_tokens}, temperature 1, best of {args.repeats}. Machine: {platform.machine()}, "
        f"{os.cpu_count()} CPUs, torch {torch.__version__}, {torch.get_num_threads()} threads; load average "
        f"{os.getloadavg()[0]:.1f} at the end (other processes share the CPUs: the ChatAgent paths, bound by "
        "Python on the event loop, lose more to contention than the engine-bound Env).",
        "",
        "| path | generated tok/s | / Env |",
        "|---|---:|---:|",
    ]
    for name, tps in best.items():
        label = "Env (`single_turn`)" if name == "env" else f"ChatAgent (`examples/{name}_agent.py`)"
        lines.append(f"| {label} | {tps:.0f} | {tps / env:.2f} |")
    lines += ["", "Goal: ChatAgent >= 0.7x the Env's rollout throughput."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rollouts", type=int, default=512)
    parser.add_argument("--in-flight", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="128 rollouts, 1 repeat")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "chat_agent.md"))
    args = parser.parse_args()
    if args.quick:
        args.rollouts, args.repeats = 128, 1
    best = asyncio.run(measure(args))
    text = report(best, args)
    print(text)
    for name in ("openai", "anthropic"):
        print(f"ratio {name}/env = {best[name] / best['env']:.2f}", file=sys.stderr)
    if not args.quick:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
