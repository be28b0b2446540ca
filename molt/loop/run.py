"""`molt train`: warm start (cached SFT), then asynchronous RL with eval, checkpoints and a summary."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import hashlib
import json
import sys
import time
from collections.abc import Coroutine
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch

from molt import cache_root
from molt.agents.reward_env import agent_factory
from molt.agents.reward_fn import RewardFunction, load_reward
from molt.config import Config, ConfigError
from molt.data.dataset import dataset_rows, has_demonstrations
from molt.engine.torch_engine import on_fresh_thread
from molt.log import RunDir, check_new_run_dir, plot_metrics
from molt.loop.checkpoint import checkpoint_step, latest_checkpoint, load_training_state, save_checkpoint
from molt.loop.rl import RLLoop
from molt.runtime.sizing import engine_kwargs
from molt.train.build import build_model, build_tokenizer
from molt.train.precision import Precision, resolve_dtype
from molt.train.trainer import Trainer

T = TypeVar("T")


@dataclass
class TrainResult:
    """What `molt train` / `molt.train()` return: where the run went, eval before and after, every step's metrics."""

    run_dir: str
    checkpoint: str
    eval_before: dict[str, float]
    eval_after: dict[str, float]
    history: list[dict[str, Any]]
    seconds: float


def _model_key(m) -> dict[str, Any]:
    """The model fields that name a cached warm start (router_fp32 only when off: older caches stay valid)."""
    fields = dataclasses.asdict(m)
    if fields.get("router_fp32", False):
        del fields["router_fp32"]
    return fields


def _data_key(d) -> dict[str, Any]:
    """The data fields that name a cached warm start (newer fields only when set: older caches stay valid)."""
    fields, defaults = dataclasses.asdict(d), dataclasses.asdict(type(d)())
    for key in ("eval_path", "split", "columns", "system_prompt", "shuffle"):
        if fields[key] == defaults[key]:
            del fields[key]
    return fields


def warm_start(cfg: Config, train_rows: list[dict] | None = None) -> str:
    """Path of an SFT checkpoint of the preset on the task's demonstrations (trained once, then cached)."""
    from molt.train.sft import run_sft

    m = cfg.model
    sft_cfg = dataclasses.replace(
        cfg,
        train=dataclasses.replace(
            cfg.train,
            max_steps=m.warmstart_steps,
            lr=m.warmstart_lr,
            batch_size=32,
            warmup_steps=min(10, m.warmstart_steps),
        ),
    )
    rows = train_rows if train_rows is not None else dataset_rows(cfg.data)[0]
    sample = rows[:8]  # the data itself, so a changed task definition is not served stale
    key_fields = {
        "model": _model_key(m),
        "data": _data_key(cfg.data),
        "seed": cfg.train.seed,
        "sample": sample,
        "version": 1,
    }
    key = hashlib.sha256(json.dumps(key_fields, sort_keys=True).encode()).hexdigest()[:16]
    folder = cache_root() / "warmstart" / key
    if not (folder / "checkpoint" / "config.json").exists():
        sft_cfg.log = dataclasses.replace(cfg.log, run_dir=str(folder), wandb_project="")  # a cache, not a run
        run_sft(sft_cfg)
    return str(folder / "checkpoint")


def wants_warm_start(cfg: Config, train_rows: list[dict], say=print) -> bool:
    """Warm-start a preset (not `--model.path`, not a resume) on a task's demonstrations, or on a data file
    whose every row has an assistant turn; prompt-only data skips it, saying so."""
    if cfg.ckpt.resume or cfg.model.path or cfg.model.warmstart_steps <= 0:
        return False
    if not cfg.data.path or has_demonstrations(train_rows):
        return True
    say(
        f"warm start skipped: {cfg.data.path} has prompts without assistant turns (nothing to imitate), so preset "
        f"{cfg.model.preset!r} starts from random weights; pass a pretrained model with --model.path (e.g. a "
        "`molt sft` checkpoint), or --model.warmstart_steps 0 to silence this"
    )
    return False


def _policy(cfg: Config, train_rows: list[dict], warm: bool):
    """(tokenizer, trainer model): resumed, loaded, or warm-started preset."""
    if cfg.ckpt.resume:
        folder = latest_checkpoint(cfg.ckpt.resume)
        model_cfg = dataclasses.replace(cfg.model, path=str(folder), tokenizer="")
    elif warm:
        model_cfg = dataclasses.replace(cfg.model, path=warm_start(cfg, train_rows), tokenizer="")
    else:
        model_cfg = cfg.model
    tokenizer = build_tokenizer(model_cfg)
    params = Precision.of(cfg.model.dtype, cfg.train.precision, cfg.runtime.device).params
    return tokenizer, build_model(model_cfg, tokenizer, cfg.train.seed, cfg.runtime.device, params)


def _engine(cfg: Config, model, tokenizer, version: int, threads: int):
    from molt.engine import TorchEngine

    slots = cfg.rollout.episodes_in_flight * 2
    if cfg.runtime.engine == "vllm":
        from molt.engine.vllm import VLLMEngine

        return VLLMEngine.from_model(model, tokenizer, num_slots=slots, max_model_len=cfg.rollout.max_len + 1)
    return TorchEngine(
        copy.deepcopy(model).eval().to(resolve_dtype(cfg.model.dtype, cfg.runtime.device)),  # compute dtype
        tokenizer=tokenizer,
        num_threads=cfg.runtime.engine_threads or threads,
        version=version,
        **engine_kwargs(cfg, model.cfg),
    )


class Progress:
    """A live bar on a terminal, plain log lines otherwise."""

    def __init__(self, run: RunDir, total: int, every: int):
        self.run, self.total, self.every, self.t0 = run, total, every, time.perf_counter()
        self.bar = None
        if sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc="molt train", dynamic_ncols=True)

    def __call__(self, m: dict[str, Any]) -> None:
        self.run.log(m)
        info = {"reward": f"{m['train/reward_mean']:.3f}", "tok/s": f"{m['rollout/tokens_per_s']:.0f}"}
        if "eval/reward_mean" in m:
            info["eval"] = f"{m['eval/reward_mean']:.3f}"
        if self.bar is not None:
            self.bar.set_postfix(info)
            self.bar.update(1)
        elif m["step"] % self.every == 0 or m["step"] == self.total:
            eta = (time.perf_counter() - self.t0) / m["step"] * (self.total - m["step"])
            self.run.print(
                f"step {m['step']}/{self.total} " + " ".join(f"{k} {v}" for k, v in info.items()) + f" eta {eta:.0f}s"
            )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


@dataclass
class RunInputs:
    """What a run reads before any model is built: data rows, reward function and agent factory."""

    train_rows: list[dict]
    eval_rows: list[dict]
    reward: RewardFunction | None
    make_env: Any


def load_inputs(cfg: Config) -> RunInputs:
    """Data, reward and agent of a run; a bad row, file or function is an error here, before any model."""
    train_rows, eval_rows = dataset_rows(cfg.data)
    ro = cfg.rollout
    reward = load_reward(ro.reward, ro.reward_weights) if ro.reward else None
    return RunInputs(train_rows, eval_rows, reward, agent_factory(ro.agent, reward, cfg.data.task, ro.max_turns))


async def _train_async(cfg: Config, run: RunDir, threads: int, inputs: RunInputs) -> TrainResult:
    t0 = time.perf_counter()
    warm = wants_warm_start(cfg, inputs.train_rows, run.print)
    tokenizer, model = on_fresh_thread(_policy, cfg, inputs.train_rows, warm, threads=threads)
    runtime = None
    if cfg.runtime.backend == "ray":
        from molt.runtime.backend import RayRuntime

        runtime = RayRuntime(cfg, model)
    try:
        trainer = runtime.trainer if runtime else Trainer(model, cfg)
        state = load_training_state(latest_checkpoint(cfg.ckpt.resume), trainer) if cfg.ckpt.resume else None
        engine = (
            runtime.start_engines(tokenizer, trainer.version)
            if runtime
            else _engine(cfg, model, tokenizer, trainer.version, threads)
        )
    except BaseException:
        if runtime:
            runtime.shutdown()
        raise
    if state is not None and getattr(trainer, "lora", None) is not None:  # the engine copied the unmerged base
        await engine.update_weights(trainer.weights(), trainer.version)
    loop = RLLoop(cfg, engine, trainer, tokenizer, inputs.make_env, inputs.train_rows, inputs.eval_rows, state,
                  run_dir=run.path)  # fmt: skip
    progress = Progress(run, cfg.train.max_steps, cfg.log.every)
    try:
        before = await loop.evaluate() if cfg.eval.every and not cfg.ckpt.resume else {}
        if before:
            run.log({"step": loop.state.step, **before})

        def on_step(metrics: dict[str, Any]) -> None:
            metrics |= runtime.metrics() if runtime else {}
            metrics |= inputs.reward.log.drain() if inputs.reward else {}
            progress(metrics)
            if cfg.ckpt.every and loop.state.step % cfg.ckpt.every == 0:
                save_checkpoint(run.path, trainer, loop.snapshot(), tokenizer)

        history = await loop.run(on_step)
        ckpt = save_checkpoint(run.path, trainer, loop.snapshot(), tokenizer)
    finally:
        progress.close()
        await loop.chat.close()
        await (runtime.close() if runtime else engine.close())
        if inputs.reward:
            inputs.reward.close()
    after = next((m for m in reversed(history) if "eval/reward_mean" in m), {})
    after = {k: v for k, v in after.items() if k.startswith("eval/")}
    return TrainResult(str(run.path), str(ckpt), before, after, history, time.perf_counter() - t0)


def check_run_dir(cfg: Config) -> None:
    """Start-up checks of the run directory: a new run needs an empty one; a resume needs a checkpoint to go on
    from, short of `train.max_steps`. Each failure is one ConfigError line, before any data or model is read."""
    if not cfg.ckpt.resume:
        if cfg.log.run_dir:
            check_new_run_dir(cfg.log.run_dir)
        return
    try:
        step = checkpoint_step(latest_checkpoint(cfg.ckpt.resume))
    except FileNotFoundError as e:
        raise ConfigError(str(e)) from None
    if step >= cfg.train.max_steps:
        raise ConfigError(
            f"ckpt.resume: {cfg.ckpt.resume} is finished (its latest checkpoint is step {step}, train.max_steps is "
            f"{cfg.train.max_steps}); raise --train.max_steps to train it further"
        )
    if cfg.log.run_dir and Path(cfg.log.run_dir).resolve() != Path(cfg.ckpt.resume).resolve():
        check_new_run_dir(cfg.log.run_dir)


def _summary(run: RunDir, result: TrainResult) -> None:
    """The closing lines: eval reward before -> after, throughput, plot and checkpoint paths."""
    plot = plot_metrics(run.path, ["train/reward_mean", "eval/reward_mean", "train/logprob_diff"])
    last = result.history[-1] if result.history else {}
    before, after = (r.get("eval/reward_mean", float("nan")) for r in (result.eval_before, result.eval_after))
    run.print(
        f"done in {result.seconds:.0f}s: eval reward {before:.3f} -> {after:.3f}; "
        f"rollout {last.get('rollout/tokens_per_s', 0):.0f} tok/s, train {last.get('train/tokens_per_s', 0):.0f} tok/s"
        f"\n  plot: {plot}\n  checkpoint: {result.checkpoint}"
    )


async def train_async(cfg: Config) -> TrainResult:
    """`molt train` as a coroutine, for callers that already run an event loop (`await molt.train_async(cfg)`)."""
    check_run_dir(cfg)
    torch.manual_seed(cfg.train.seed)
    threads, main_threads = cfg.runtime.threads or torch.get_num_threads(), torch.get_num_threads()
    torch.set_num_threads(1)  # this thread runs asyncio only; model compute runs on the engine's thread
    try:
        inputs = load_inputs(cfg)  # before the run directory and any model: a bad row stops here
        run = RunDir(cfg.log.run_dir or cfg.ckpt.resume, "train", cfg)
        try:
            result = await _train_async(cfg, run, threads, inputs)
        finally:
            run.close()
    finally:
        torch.set_num_threads(main_threads)
    _summary(run, result)
    return result


def run_sync(coro: Coroutine[Any, Any, T]) -> T:
    """Run `coro` to completion from synchronous code: on this thread, or on a worker thread with its own event
    loop when this thread already runs one (a notebook), since `asyncio.run` refuses to nest."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        running = False
    else:
        running = True
    if not running:  # outside the except block: a failure's traceback must not start with "no running loop"
        return asyncio.run(coro)
    with ThreadPoolExecutor(1, thread_name_prefix="molt-run") as pool:
        return pool.submit(asyncio.run, coro).result()


def run_train(cfg: Config) -> TrainResult:
    """The `molt train` command (callable from a script or from inside a running event loop)."""
    return run_sync(train_async(cfg))
