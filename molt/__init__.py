"""Molt: reinforcement learning of language-model agents, compact and PyTorch-native.

The Python API mirrors `molt train` and `molt eval`: `molt.train(config)`, `molt.evaluate(target)`, or `await
molt.train_async(config)` / `await molt.evaluate_async(target)` inside an event loop.
`config` is a `Config`, a nested or dotted dict (`{"train.max_steps": 20}`) or a TOML/YAML path; keyword arguments
override groups of it. Heavy modules are imported on the first call. `molt.train` stays the function although a
subpackage `molt/train/` exists: import its modules with `from molt.train.trainer import Trainer`."""

from __future__ import annotations

import dataclasses
import os
import sys
import types
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from molt.cli.eval import EvalResult
    from molt.cli.train import TrainResult
    from molt.config import Config

__version__ = "0.1.0"
__all__ = ["cache_root", "evaluate", "evaluate_async", "make_config", "train", "train_async"]


def cache_root() -> Path:
    """Where Molt keeps what it builds once per machine (warm starts, compiled kernels): `$MOLT_CACHE`."""
    root = Path(os.environ.get("MOLT_CACHE") or Path.home() / ".cache" / "molt")  # set but empty: the default
    if root.exists() and not root.is_dir():
        from molt.config import ConfigError

        raise ConfigError(f"MOLT_CACHE={root}: not a folder (Molt's cache is a folder; unset it for ~/.cache/molt)")
    return root


def make_config(config: Config | dict[str, Any] | str | os.PathLike | None = None, **overrides: Any) -> Config:
    """A checked `Config` from a Config, a (dotted or nested) dict or a TOML/YAML file, then `overrides`; a mistake
    raises `ConfigError` naming the key (`train.max_stepz: unknown key; did you mean 'train.max_steps'?`), or the
    agent, reward function or tool-call parser that does not load, as the CLI does. A dict naming `ckpt.resume` starts
    from that run's config.yaml and continues in its folder, as `molt train --resume RUN` does."""
    from molt.cli.config_file import build, load_config_file, nested
    from molt.cli.inputs import check_user_code
    from molt.config import Config, ConfigError

    if not isinstance(config, Config | dict | str | os.PathLike | None):
        raise ConfigError(f"config: expected a Config, a dict or a TOML/YAML path, got {type(config).__name__}")
    if isinstance(config, str | os.PathLike):
        from molt.cli.main import check_resume_config

        path, config = config, load_config_file(Config, config, base=Config(), overrides=overrides)
        check_resume_config(nested(overrides).get("ckpt", {}).get("resume") or config.ckpt.resume, path)
    if isinstance(config, Config):  # built afresh: a Config changed after it was made is checked again
        values = dataclasses.asdict(config)
        values.pop("config")
        config = build(Config, nested(values, overrides))
    else:  # one build: checked once
        values, base = nested(config or {}, overrides), Config()
        ckpt = values.get("ckpt")
        if isinstance(ckpt, dict) and (run := ckpt.get("resume")):  # as `molt train --resume RUN`: the run's config
            from molt.cli.main import run_config

            base = load_config_file(Config, run_config(run), base=Config())
            values = nested({"log.run_dir": str(Path(run).resolve())}, values)
        config = build(Config, values, base=base)
    check_user_code(config)
    return config


def train(config: Config | dict[str, Any] | str | os.PathLike | None = None, **overrides: Any) -> TrainResult:
    """Run `molt train` and return its `TrainResult`. Inside a running event loop (a notebook cell) the run goes to
    a worker thread with its own loop and this call blocks (an interrupt cancels the run, waits for its clean-up and
    raises KeyboardInterrupt); prefer `await molt.train_async(...)` there."""
    from molt.cli.train import run_train

    return run_train(make_config(config, **overrides))


async def train_async(
    config: Config | dict[str, Any] | str | os.PathLike | None = None, **overrides: Any
) -> TrainResult:
    """`molt.train` as a coroutine on the caller's event loop: `result = await molt.train_async(cfg)`."""
    from molt.cli.train import train_async as run

    return await run(make_config(config, **overrides))


def evaluate(target: str | os.PathLike, config: Any = None, **overrides: Any) -> EvalResult:
    """`molt eval TARGET` from Python: score a checkpoint, a run directory (its latest checkpoint) or a model folder
    on held-out rows; returns its `EvalResult` (metrics, per-row samples, the eval's run directory). A run's
    config.yaml is the config (its data, agent, reward and eval settings) unless `config` is given; keyword arguments
    override groups of it, as for `train` (`eval={"n_samples": 8}`). Inside a running event loop (a notebook cell) it
    runs on a worker thread, as `molt.train` does; prefer `await molt.evaluate_async(...)` there."""
    from molt.cli.eval import run_eval

    return run_eval(_eval_config(target, config, overrides))


async def evaluate_async(target: str | os.PathLike, config: Any = None, **overrides: Any) -> EvalResult:
    """`molt.evaluate` as a coroutine on the caller's event loop."""
    from molt.cli.eval import eval_async

    return await eval_async(_eval_config(target, config, overrides))


def _eval_config(target: str | os.PathLike, config: Any, overrides: dict[str, Any]) -> Config:
    """The config `molt eval TARGET` resolves: the target's run's config.yaml (not its run directory or tokenizer; not
    its training file when `data.eval_path` names the rows to score) unless `config` is given, then `overrides`."""
    from molt.cli.config_file import nested
    from molt.cli.main import run_of

    given, run = nested(overrides), run_of(str(target)) if config is None else None
    base: dict[str, Any] = {"model.path": str(target), "log.run_dir": ""}
    if run is not None:
        config, base["model.tokenizer"] = str(run / "config.yaml"), ""
        if "eval_path" in given.get("data", {}) and "path" not in given.get("data", {}):
            base["data.path"] = ""  # the run's training file need not exist any more
    return make_config(config, **nested(base, given))


class _Package(types.ModuleType):
    """This package's module type: importing the `molt.train` subpackage would rebind `molt.train` to it (the import
    system sets a package's attribute for each submodule); that one binding is skipped, so the API function stays."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "train" and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
