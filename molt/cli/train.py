"""`molt train`: assemble a run (inputs, policy, runtime, loop), then asynchronous RL with eval and checkpoints.

The order: start-up checks of the run directory, inputs (a bad row stops here), the policy (resumed, loaded, or a
cached warm start), the runtime of `runtime.backend`, the loop, a closing summary. With `rollout.replay` the loop
trains on a rollout dump and no engine is started (`molt/loop/replay.py`)."""

from __future__ import annotations

import asyncio
import dataclasses
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml

from molt.algo import ESTIMATORS
from molt.cli.build import build_policy, build_tokenizer, check_same_tokenizer
from molt.cli.inputs import RunInputs, agent_workers, load_inputs
from molt.cli.signals import interruptible, run_sync
from molt.cli.warm_start import may_warm_start, wants_warm_start, warm_start
from molt.config import AlgoConfig, Config, ConfigError, check
from molt.config.rl import check_rollout_algo
from molt.config.run import latest_checkpoint
from molt.config.training import check_rl_batch
from molt.data.dataset import dataset_rows
from molt.engine.torch_engine import on_fresh_thread
from molt.log import RunDir, check_new_run_dir, plot_metrics
from molt.loop.accounting import FAILURE_LOG
from molt.loop.checkpoint import check_written_by, checkpoint_step, load_training_state, save_checkpoint
from molt.loop.dump import rollouts_folder
from molt.loop.replay import ReplayLoop, replay_folder
from molt.loop.rl import RLLoop
from molt.runtime.base import Runtime, start_runtime
from molt.train.precision import Precision


@dataclass
class TrainResult:
    """What `molt train` / `molt.train()` return: where the run went, eval before and after, every step's metrics."""

    run_dir: str
    checkpoint: str
    eval_before: dict[str, float]
    eval_after: dict[str, float]
    history: list[dict[str, Any]]
    seconds: float


def _policy(cfg: Config, train_rows: list[dict], warm: bool, stop: threading.Event):
    """(tokenizer, trainer model): resumed, loaded, or warm-started preset (`stop` set: the warm start stops)."""
    folder = (
        latest_checkpoint(cfg.ckpt.resume) if cfg.ckpt.resume else warm_start(cfg, train_rows, stop) if warm else None
    )
    model_cfg = dataclasses.replace(cfg.model, path=str(folder), tokenizer="") if folder else cfg.model
    return build_policy(cfg, model_cfg, Precision.of(cfg.model.dtype, cfg.train.precision, cfg.runtime.device).params)


class Progress:
    """A live bar on a terminal, plain log lines otherwise."""

    def __init__(self, run: RunDir, total: int, every: int, start: int = 0):
        self.run, self.total, self.every, self.start, self.t0 = run, total, every, start, time.perf_counter()
        self.bar = None
        if sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=start, desc="molt train", dynamic_ncols=True)

    def __call__(self, m: dict[str, Any]) -> None:
        self.run.log(m)
        reward = m.get("rollout/reward_mean", m["train/reward_mean"])  # every rollout's, not just the trained ones
        info = {"reward": f"{reward:.3f}", "tok/s": f"{m['rollout/tokens_per_s']:.0f}"}
        if "eval/reward_mean" in m:
            info["eval"] = f"{m['eval/reward_mean']:.3f}"
        if self.bar is not None:
            self.bar.set_postfix(info)
            self.bar.update(1)
        elif m["step"] % self.every == 0 or m["step"] == self.total:
            eta = (time.perf_counter() - self.t0) / max(m["step"] - self.start, 1) * (self.total - m["step"])
            self.run.print(
                f"step {m['step']}/{self.total} " + " ".join(f"{k} {v}" for k, v in info.items()) + f" eta {eta:.0f}s"
            )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _replay_inputs(cfg: Config) -> RunInputs:
    """A replay's: the dump holds its batches, images included, so no agent or reward runs (their files and the data
    may be gone); the training rows only for a warm start to imitate."""
    return RunInputs(dataset_rows(cfg.data)[0] if may_warm_start(cfg) else [], [], None, None)


async def _start(cfg: Config, run: RunDir, threads: int, inputs: RunInputs) -> tuple[Runtime, RLLoop]:
    """The runtime (policy trainer, extra models, engines) and the loop over them; a resume restores both.
    `rollout.replay`: the trainer alone and the loop over the dump (no engine is built)."""
    warm = wants_warm_start(cfg, inputs.train_rows, run.print)
    stop = threading.Event()  # cancelled (a notebook's interrupt), the run stops its warm start's thread too
    try:
        tokenizer, model = await on_fresh_thread(_policy, cfg, inputs.train_rows, warm, stop, threads=threads)
    except asyncio.CancelledError:
        stop.set()
        raise
    runtime = start_runtime(cfg, model, threads)
    try:
        trainer = runtime.trainer
        state = load_training_state(latest_checkpoint(cfg.ckpt.resume), trainer) if cfg.ckpt.resume else None
        if cfg.rollout.replay:  # no engine: the trainer steps on the dumped batches
            return runtime, ReplayLoop(cfg, trainer=trainer, tokenizer=tokenizer, model_cfg=model.cfg,
                                       threads=threads, state=state, run_dir=run.path)  # fmt: skip
        engine = runtime.start_engines(tokenizer, trainer.version)
        if state is not None:  # the engines copied the checkpoint folder (LoRA: the unmerged base): the trainer wins
            await engine.update_weights(trainer.weights(), trainer.version)
        workers = await agent_workers(cfg, engine, tokenizer)
    except BaseException:
        await runtime.close()  # what was placed so far (`Runtime.close` stops only the engines that started)
        raise
    loop = RLLoop(cfg, engine=engine, trainer=trainer, tokenizer=tokenizer, make_env=inputs.make_env,
                  train_rows=inputs.train_rows, eval_rows=inputs.eval_rows, state=state, run_dir=run.path,
                  workers=workers)  # fmt: skip
    return runtime, loop


async def _train_async(cfg: Config, run: RunDir, threads: int, inputs: RunInputs) -> TrainResult:
    t0 = time.perf_counter()
    runtime, loop = await _start(cfg, run, threads, inputs)
    progress = Progress(run, cfg.train.max_steps, cfg.log.every, loop.state.step)  # a resume starts past 0
    saved: dict[int, Path] = {}  # step -> its checkpoint
    try:
        before = await loop.evaluate() if cfg.eval.every and not cfg.ckpt.resume else {}
        if before:
            run.log({"step": loop.state.step, **before})

        def save() -> Path:
            return save_checkpoint(run.path, loop.trainer, loop.snapshot(), loop.tokenizer, cfg.ckpt.keep)

        def on_step(metrics: dict[str, Any]) -> None:
            metrics |= runtime.metrics()
            progress(metrics)
            if cfg.ckpt.every and loop.state.step % cfg.ckpt.every == 0:
                saved[loop.state.step] = save()

        history = await loop.run(on_step)
        ckpt = saved.get(loop.state.step) or save()
    finally:
        progress.close()
        await loop.close()
        await runtime.close()
        if inputs.reward:
            inputs.reward.close()
    after = next((m for m in reversed(history) if "eval/reward_mean" in m), {})
    after = {k: v for k, v in after.items() if k.startswith("eval/")}
    return TrainResult(str(run.path), str(ckpt), before, after, history, time.perf_counter() - t0)


def check_run_dir(cfg: Config, command: str = "train") -> int | None:
    """Start-up checks of the run directory: a new run needs an empty one; a resume needs a checkpoint `command`
    wrote to go on from, short of `train.max_steps`, and settings its trainer state can hold. Each failure is one
    ConfigError line, before any data or model is read. Returns the step a resume goes on from (None: a new run)."""
    if not cfg.ckpt.resume:
        if cfg.log.run_dir:
            check_new_run_dir(cfg.log.run_dir)
        return None
    check_written_by(cfg.ckpt.resume, command)  # (the CLI checks it before the run's config.yaml is read)
    step = checkpoint_step(latest_checkpoint(cfg.ckpt.resume))  # ckpt.resume checked it exists
    check(step < cfg.train.max_steps, "ckpt.resume", f"{cfg.ckpt.resume} is finished (its latest checkpoint is "
          f"step {step}, train.max_steps is {cfg.train.max_steps}); raise --train.max_steps to train it "
          "further")  # fmt: skip
    if cfg.log.run_dir and Path(cfg.log.run_dir).resolve() != Path(cfg.ckpt.resume).resolve():
        check_new_run_dir(cfg.log.run_dir)
    saved = Path(cfg.ckpt.resume) / "config.yaml"
    if saved.exists():
        old = _saved_form(saved)
        was, now = _state_shape(old), _state_shape(cfg.file_form())
        adaptive = cfg.algo.kl_target and old["algo"]["kl_target"]  # its coefficient is training state
        horizon = "" if cfg.algo.kl_horizon == AlgoConfig.kl_horizon else f" --algo.kl_horizon {AlgoConfig.kl_horizon}"
        check(not adaptive or cfg.algo.kl_coef == old["algo"]["kl_coef"], "algo.kl_coef", "the adaptive KL "
              f"coefficient (algo.kl_target) continues from {cfg.ckpt.resume}'s checkpoint; --algo.kl_coef sets "
              f"only a new run's starting value: drop it (or --algo.kl_target 0{horizon} for a fixed "
              "coefficient)")  # fmt: skip
        folders = ("model.path", "model.tokenizer", "critic.path")
        moved = {k for k in folders if was[k] and now[k] and not Path(str(was[k])).exists()}
        for what in (k for k in now if now[k] != was[k] and k not in moved):  # a moved folder: its new place
            differs = f"{what} is {now[what]} here but {was[what]} in {cfg.ckpt.resume}"
            if isinstance(now[what], bool):  # a model (or frozen routers) the run trained without, or with
                trained = "without" if now[what] else "with"
                differs = f"{'adds' if now[what] else 'drops'} {what}, which {cfg.ckpt.resume} was trained {trained}"
            raise ConfigError(
                f"ckpt.resume: {differs}; its checkpoint holds the other training state: keep the run's setting, or "
                f"start a new run from its policy with --model.path {cfg.ckpt.resume}"
            )
    return step


def _saved_form(saved: Path) -> dict:
    """A run's config.yaml as a file form: a key left out (a hand edit) has its default, as the resume's config
    itself does; a file that is not a mapping is a ConfigError."""
    raw = yaml.safe_load(saved.read_text())
    check(isinstance(raw, dict), "ckpt.resume", f"{saved} holds no settings (a YAML mapping): restore the run's "
          "config.yaml (the resume reads its settings there)")  # fmt: skip
    return {group: {**value, **(raw.get(group) or {})} if isinstance(value, dict) else raw.get(group, value)
            for group, value in Config().file_form().items()}  # fmt: skip


def _state_shape(config: dict) -> dict[str, object]:
    """What a checkpoint's trainer state depends on (from a file form): the policy it trained (a resume continues it,
    whatever model.* now says), its tokenizer, parameter dtype, adapters, frozen routers, critic, reference."""
    train, algo, model = config["train"], config["algo"], config["model"]
    params = "float32" if train["precision"] == "mixed" else model["dtype"]  # as written: `auto` is the machine's
    return {
        "model.path": model["path"] or None,
        "model.preset": None if model["path"] else model["preset"],  # unused beside a model folder
        "model.tokenizer": model["tokenizer"] or None,
        "the trainer's parameter dtype (train.precision, model.dtype)": params,
        "train.lora_rank": train["lora_rank"],
        "train.lora_targets": list(train["lora_targets"]) if train["lora_rank"] else None,
        "train.lora_alpha": train["lora_alpha"] if train["lora_rank"] else None,  # scales the saved adapters
        "train.freeze_router": train["freeze_router"],  # frozen routers are not in the optimizer's groups
        "runtime.backend": config["runtime"]["backend"],  # ray writes sharded (DCP) checkpoints
        "a critic (algo.estimator gae)": "values_bt" in ESTIMATORS.info(algo["estimator"])["needs"],
        "critic.path": config["critic"]["path"] or None,  # the checkpoint's critic continues, whatever it came from
        "a KL reference (algo.kl_coef > 0)": algo["kl_coef"] > 0,
    }


def _summary(run: RunDir, result: TrainResult) -> None:
    """The closing lines: eval reward before -> after, throughput, plot and checkpoint paths."""
    keys = ["rollout/reward_mean", "train/reward_mean", "eval/reward_mean", "train/logprob_diff"]
    plot = plot_metrics(run.path, keys)
    last = result.history[-1] if result.history else {}
    ran = [r["eval/reward_mean"] for r in (result.eval_before, result.eval_after) if "eval/reward_mean" in r]
    evals = "eval reward " + " -> ".join(f"{reward:.3f}" for reward in ran) if ran else "eval off"  # 1: resumed
    if failed := last.get("rollout/failures", 0):  # over the run (a resume's too); tracebacks in the failure log
        evals += f"; {failed} of {last['rollout/rollouts']} rollouts failed (see {run.path / FAILURE_LOG})"
    run.print(
        f"done in {result.seconds:.0f}s: {evals}; "
        f"rollout {last.get('rollout/tokens_per_s', 0):.0f} tok/s, train {last.get('train/tokens_per_s', 0):.0f} tok/s"
        f"\n  plot: {plot}\n  checkpoint: {result.checkpoint}"
    )


@interruptible
async def train_async(cfg: Config) -> TrainResult:
    """`molt train` as a coroutine, for callers that already run an event loop (`await molt.train_async(cfg)`)."""
    check_rollout_algo(cfg.rollout, cfg.algo)  # training's: `molt eval` / `serve` may sample with top-p freely
    check_rl_batch(cfg.train, cfg.rollout.max_len)  # before the warm start
    resumed = check_run_dir(cfg)
    tokenizer = build_tokenizer(cfg.model)  # one the model cannot take: an error before the run directory
    for key, folder in (("algo.teacher", cfg.algo.teacher), ("critic.path", cfg.critic.path)):
        if folder:  # their token ids must be the policy's
            check_same_tokenizer(tokenizer, folder, key)
    if cfg.rollout.replay:  # its shards cover the steps to train, before any data or model is read
        folder = replay_folder(cfg, resumed or 0)
        own = cfg.ckpt.resume and (cfg.log.run_dir or cfg.ckpt.resume)  # the folder a resume trims (a new one is empty)
        check(not own or folder.resolve() != rollouts_folder(own).resolve(), "rollout.replay", f"{folder} is this "
              "run's own dump, which resuming trims to the checkpoint's step: replay a copy of it")  # fmt: skip
    torch.manual_seed(cfg.train.seed)
    threads, main_threads = cfg.runtime.threads or torch.get_num_threads(), torch.get_num_threads()
    torch.set_num_threads(1)  # this thread runs asyncio only; model compute runs on the engine's thread
    try:
        # before the run directory and any model: a bad row stops here
        inputs = _replay_inputs(cfg) if cfg.rollout.replay else load_inputs(cfg)
        with RunDir(cfg.log.run_dir or cfg.ckpt.resume, "train", cfg, resumed=resumed) as run:
            result = await _train_async(cfg, run, threads, inputs)
    finally:
        torch.set_num_threads(main_threads)
    _summary(run, result)
    return result


def run_train(cfg: Config) -> TrainResult:
    """The `molt train` command, from synchronous code (`run_sync`: a notebook's running loop too)."""
    return run_sync(train_async, cfg)
