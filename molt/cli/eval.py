"""`molt eval`: score a checkpoint on held-out rows the way training's eval does.

The target (`--model.path`, filled from `molt eval TARGET`) is a checkpoint, a run directory (its latest checkpoint,
with the run's config.yaml) or any HF model folder. Same data split, agent, rewards, engine, limits, sampling and
seeds as training's eval, so it reproduces the in-training eval of the checkpoint's step. Writes `metrics.jsonl`
(mean reward, named rewards, pass@k for every k up to `eval.n_samples`), `results.jsonl` (one line per row) and, if
samples failed, `rollout_failures.log`; a user error when every sample failed."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch

from molt.agents.chat.agent import local_rollout
from molt.cli.build import build_policy
from molt.cli.inputs import RunInputs, agent_workers, load_inputs
from molt.cli.signals import interruptible, run_sync
from molt.config import Config, check
from molt.data.dataset import rows_digest
from molt.engine.torch_engine import on_fresh_thread
from molt.errors import UserError
from molt.log import RunDir, atomic_write_text, check_new_run_dir, json_safe
from molt.loop.accounting import FAILURE_LOG
from molt.loop.evaluate import chat_runner, episode_limits, evaluate, rollout_sampling
from molt.runtime.factory import build_engine


@dataclasses.dataclass
class EvalResult:
    run_dir: str
    checkpoint: str
    metrics: dict[str, float]
    rows: list[dict[str, Any]]


async def _eval_async(cfg: Config, rows: list[dict], inputs: RunInputs, threads: int, out: list, failure_log: Path):
    tokenizer, model = await on_fresh_thread(build_policy, cfg, threads=threads)  # the engine puts it in eval mode
    engine = build_engine(cfg, model, tokenizer, threads=threads, owned=True)
    chat, workers, n = chat_runner(cfg, engine, tokenizer), None, cfg.eval.n_samples
    try:
        workers = await agent_workers(cfg, engine, tokenizer)
        rollout = workers.run if workers else local_rollout(chat, engine, tokenizer, inputs.make_env)
        return await evaluate(tokenizer, rollout, rows=rows, limits=episode_limits(cfg), n=n, seed=cfg.eval.seed,
                              sampling=rollout_sampling(cfg, tokenizer, cfg.eval.temperature),
                              ks=list(range(1, n + 1)), results=out, failure_log=failure_log)  # fmt: skip
    finally:
        if workers:
            await workers.close()
        await chat.close()
        await engine.close()


def _check_same_rows(checkpoint: Path, train_rows: list[dict]) -> None:
    """A `molt train` checkpoint records a digest of its training rows; held out from other rows (a data file
    edited since), the eval rows could be rows the policy trained on, silently. `--data.eval_path` names rows."""
    state = checkpoint / "trainer_state.pt"
    then = (
        torch.load(state, mmap=True, map_location="cpu", weights_only=False)["loop"].get("data")
        if state.is_file()
        else None
    )
    now = rows_digest(train_rows)
    before = then[0] if then else 0
    check(not then or then == now, "data.path", f"the training rows are not those {checkpoint} trained on ({before} "
          f"then, {now[0]} now, or other rows): the data changed since, or a data flag given here splits it otherwise; "
          "its held-out rows could be rows the policy trained on. Evaluate on the run's data and split, or name the "
          "rows to score with --data.eval_path")  # fmt: skip


def run_eval(cfg: Config) -> EvalResult:
    """The `molt eval` command, from synchronous code (`run_sync`: a notebook's running loop too)."""
    return run_sync(eval_async, cfg)


@interruptible
async def eval_async(cfg: Config) -> EvalResult:
    """`molt eval` on the running event loop (`await molt.evaluate_async(...)`)."""
    checkpoint = cfg.model.path  # a run directory's latest checkpoint, resolved by ModelConfig
    check(bool(checkpoint), "model.path", "molt eval needs a checkpoint: `molt eval CHECKPOINT|RUN_DIR|MODEL_FOLDER`")
    if cfg.log.run_dir:  # its config.yaml and metrics.jsonl would replace and join another run's
        check_new_run_dir(cfg.log.run_dir)
    inputs = load_inputs(cfg)  # data, reward and agent: errors before any model is built
    if cfg.data.path and not cfg.data.eval_path:
        _check_same_rows(Path(checkpoint), inputs.train_rows)
    rows = inputs.eval_rows[: cfg.eval.num_prompts]
    check(bool(rows or cfg.data.eval_path or not cfg.data.path), "data", "no held-out rows to evaluate: a data file "
          f"keeps data.num_eval={cfg.data.num_eval} rows, at most 10% of its rows, for eval: none of the "
          f"{len(inputs.train_rows)} rows of {cfg.data.path}; pass --data.eval_path (or --data.num_eval > 0 with at "
          "least 10 rows)")  # fmt: skip
    check(bool(rows), "data", "no held-out rows to evaluate (set --data.eval_path, or --data.num_eval > 0)")
    torch.manual_seed(cfg.train.seed)
    threads, main_threads = cfg.runtime.threads or torch.get_num_threads(), torch.get_num_threads()
    torch.set_num_threads(1)  # as in training: this thread runs asyncio; the engine's thread computes
    records: list[dict] = []
    with RunDir(cfg.log.run_dir, "eval", cfg, tensorboard=False) as run:
        out = Path(cfg.eval.output) if cfg.eval.output else run.path / "results.jsonl"
        out.parent.mkdir(parents=True, exist_ok=True)  # before the samples run
        failure_log = run.path / FAILURE_LOG
        try:
            metrics = await _eval_async(cfg, rows, inputs, threads, records, failure_log)
        finally:
            torch.set_num_threads(main_threads)
            if inputs.reward:
                inputs.reward.close()
        for record, row in zip(records, rows, strict=True):
            record["row"] = row
        run.log({"checkpoint": checkpoint, **metrics})
    atomic_write_text(out, "".join(json.dumps(json_safe(r)) + "\n" for r in records))
    shown = " ".join(f"{k.removeprefix('eval/')} {v:.3f}" for k, v in metrics.items() if k != "eval/failures")
    failed, total = metrics["eval/failures"], len(rows) * cfg.eval.n_samples
    first = next((s["error"] for r in records for s in r["samples"] if "error" in s), "")
    failures = f" failures {failed}/{total} (first: {first})\n  tracebacks: {failure_log}" if failed else ""
    run.print(f"{checkpoint}: {len(rows)} rows x {cfg.eval.n_samples}: {shown}{failures}\n  results: {out}")
    if failed == total:
        raise UserError(f"every one of the {total} eval samples failed (first: {first}); tracebacks: {failure_log}")
    return EvalResult(str(run.path), checkpoint, metrics, records)
