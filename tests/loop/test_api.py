"""The Python API (`molt.train`, `molt.train_async`) from a notebook-style running event loop, and W&B logging
(offline run files when `wandb` is installed; one config line naming the flag when it is not)."""

import asyncio
import importlib.util
import signal
import threading

import numpy as np
import pytest
import torch
from conftest import one_line, run_molt  # noqa: I001 - tests/conftest.py

import molt
from molt.cli.train import Progress
from molt.config import Config, ConfigError
from molt.log import RunDir, read_metrics

TINY = {
    "model": {"preset": "tiny", "warmstart_steps": 0},
    "data": {"task": "arithmetic", "num_train": 32, "num_eval": 4},
    "rollout": {"prompts_per_step": 2, "n_samples_per_prompt": 2, "max_tokens": 4, "filters": ["nonfinite"]},
    "train": {"max_steps": 2, "warmup_steps": 0},
    "eval.every": 0,
    "log.every": 100,
}


def test_make_config_merges_dicts_files_and_overrides(tmp_path):
    cfg = molt.make_config({"train.max_steps": 3, "train": {"lr": 1e-3}}, train={"warmup_steps": 0})
    assert (cfg.train.max_steps, cfg.train.lr, cfg.train.warmup_steps) == (3, 1e-3, 0)
    (tmp_path / "run.toml").write_text("[train]\nmax_steps = 7\nwarmup_steps = 0\n")
    assert molt.make_config(tmp_path / "run.toml", eval={"every": 0}).train.max_steps == 7
    with pytest.raises(ConfigError, match="train.max_stepz: unknown key; did you mean 'train.max_steps'"):
        molt.make_config({"train.max_stepz": 3})


def test_make_config_resuming_a_run_starts_from_its_config(tmp_path):
    import yaml

    run = tmp_path / "run"
    (run / "checkpoints" / "step-2").mkdir(parents=True)
    (run / "checkpoints" / "step-2" / "trainer_state.pt").write_bytes(b"")  # what the config checks look for
    (run / "checkpoints" / "latest").write_text("step-2")
    saved = molt.make_config(TINY).file_form()
    (run / "config.yaml").write_text(yaml.safe_dump(saved))
    cfg = molt.make_config({"ckpt.resume": str(run)}, train={"max_steps": 5})  # as `molt train --resume RUN`
    assert (cfg.rollout.prompts_per_step, cfg.data.task, cfg.train.max_steps) == (2, "arithmetic", 5)
    assert cfg.log.run_dir == str(run.resolve())
    with pytest.raises(ConfigError, match="ckpt.resume: run directory '.*nope' does not exist"):
        molt.make_config({"ckpt.resume": str(tmp_path / "nope")})


def test_make_config_refuses_what_is_not_a_config_and_takes_paths_and_numpy_numbers(tmp_path):
    with pytest.raises(ConfigError, match="config: expected a Config, a dict or a TOML/YAML path, got int"):
        molt.make_config(5)
    with pytest.raises(ConfigError, match="config: a config cannot name another config"):
        molt.make_config({"config": str(tmp_path / "missing.toml")})
    with pytest.raises(ConfigError, match=r"rollout.reward: expected str, got function .*pass '__main__:NAME'"):
        molt.make_config(rollout={"reward": test_make_config_merges_dicts_files_and_overrides})
    with pytest.raises(ConfigError, match=r"rollout.agent: '__main__:NAME' .*agent_workers processes do not run"):
        molt.make_config(rollout={"agent": "__main__:Agent", "agent_workers": 1})
    cfg = molt.make_config({"train.max_steps": np.int64(3), "train.lr": np.float32(0.5), "log.run_dir": tmp_path})
    assert (cfg.train.max_steps, cfg.train.lr, cfg.log.run_dir) == (3, 0.5, str(tmp_path))
    assert type(cfg.train.max_steps) is int and type(cfg.train.lr) is float


def test_a_notebook_cell_that_redefines_its_reward_or_agent_is_used_by_the_next_run(monkeypatch):
    """`__main__:fn` / `__main__:Agent` are looked up anew: the first definition was served for the whole process."""
    import sys

    from molt.agents import Env
    from molt.agents.chat.agent import load_agent_class
    from molt.agents.reward_fn import load_part

    async def step(self, action):  # an Env's one method
        return None

    main = sys.modules["__main__"]
    for version in (0.25, 0.75):
        monkeypatch.setattr(main, "cell_reward", lambda completion, row, v=version: v, raising=False)
        monkeypatch.setattr(main, "CellAgent", type("CellAgent", (Env,), {"v": version, "step": step}), raising=False)
        assert load_part("__main__:cell_reward").fn("", {}) == version
        assert load_agent_class("__main__:CellAgent").v == version


def test_train_from_inside_a_running_event_loop(tmp_path):
    """A notebook cell: `await molt.train_async(...)`, and the blocking `molt.train(...)` on a worker thread."""

    async def cell():
        running = asyncio.get_running_loop()
        first = await molt.train_async(TINY, log={"run_dir": str(tmp_path / "async")})
        second = molt.train(molt.make_config(TINY), log={"run_dir": str(tmp_path / "sync")})  # blocks this loop
        assert asyncio.get_running_loop() is running
        return first, second

    first, second = asyncio.run(cell())
    for result, name in ((first, "async"), (second, "sync")):
        assert [m["step"] for m in result.history] == [1, 2]
        assert [m["step"] for m in read_metrics(tmp_path / name)] == [1, 2]
        assert (tmp_path / name / "checkpoints" / "step-2" / "model.safetensors").exists()


@pytest.fixture
def own_variants():
    """A GAE variant and a loss registered in your own code, as docs/algorithms.md says; removed afterwards."""
    from molt import algo

    @algo.ESTIMATORS.register("my_gae", whiten=True, needs=("rewards_b", "values_bt"), uses_kl=True,
                              group_baseline=False)  # fmt: skip
    def my_gae(inputs, params):
        return algo.ESTIMATORS.get("gae")(inputs, params)

    @algo.POLICY_LOSSES.register("neg_twice")
    def neg_twice(logp_bt, old_logp_bt, advantages_bt, mask_bt, params):
        """-w(A) * A * logp with w = 2 for A < 0: not the policy gradient at ratio 1."""
        weighted_bt = advantages_bt * torch.where(advantages_bt < 0, 2.0, 1.0)
        return algo.POLICY_LOSSES.get("pg")(logp_bt, old_logp_bt, weighted_bt, mask_bt, params)

    yield
    for registry, name in ((algo.ESTIMATORS, "my_gae"), (algo.POLICY_LOSSES, "neg_twice")):
        del registry._fns[name], registry._info[name]


def test_your_own_estimator_and_loss_are_wired_by_their_registry_info(tmp_path, own_variants):
    """An estimator that needs values_bt gets a critic (and may read gamma); a loss of your own is not refused as
    one of the built-in surrogates that share one gradient at ratio 1."""
    algo = {"estimator": "my_gae", "gamma": 0.9, "policy_loss": "neg_twice", "clip_high": 0.3}
    result = molt.train(TINY, algo=algo, critic={"lr": 1e-3}, log={"run_dir": str(tmp_path)})
    assert [m["step"] for m in result.history] == [1, 2]
    assert all("critic/value_loss" in m for m in result.history)
    with pytest.raises(ConfigError, match="algo.policy_loss: has no effect here"):
        molt.make_config(TINY, algo={"policy_loss": "pg"})


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_ctrl_c_stops_a_blocking_train_inside_a_running_event_loop(tmp_path, monkeypatch, signum):
    """A notebook's interrupt (or SIGTERM, which killed the process) during `molt.train` cancels the run on its worker
    thread and waits for its clean-up."""
    log_step = Progress.__call__

    def interrupt_after_step_one(progress, metrics):
        log_step(progress, metrics)
        if metrics["step"] == 1:
            signal.pthread_kill(threading.main_thread().ident, signum)

    monkeypatch.setattr(Progress, "__call__", interrupt_after_step_one)

    async def cell():
        molt.train(TINY, train={"max_steps": 20}, log={"run_dir": str(tmp_path)})

    with pytest.raises(KeyboardInterrupt):
        asyncio.run(cell())
    assert len(read_metrics(tmp_path)) <= 3  # not the 20 steps of the whole run
    assert not [t for t in threading.enumerate() if t.name.startswith("molt-run")]


def test_ctrl_c_stops_an_awaited_train_async_on_the_notebooks_loop(tmp_path, monkeypatch):
    """A kernel's interrupt during `await molt.train_async(...)` raised KeyboardInterrupt in the cell but left the run
    going on the kernel's loop (writing its metrics, holding its run directory); it now cancels the run first."""
    log_step = Progress.__call__

    def interrupt_after_step_one(progress, metrics):
        log_step(progress, metrics)
        if metrics["step"] == 1:
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)

    monkeypatch.setattr(Progress, "__call__", interrupt_after_step_one)
    kernel, earlier = asyncio.new_event_loop(), set(threading.enumerate())  # a notebook's loop: it outlives cells
    try:
        with pytest.raises(KeyboardInterrupt):
            kernel.run_until_complete(molt.train_async(molt.make_config(TINY, train={"max_steps": 20},
                                                                        log={"run_dir": str(tmp_path)})))  # fmt: skip
        assert not asyncio.all_tasks(kernel)  # nothing of the run left on the kernel's loop
        assert not [t for t in set(threading.enumerate()) - earlier if t.name.startswith("molt-engine")]
        assert len(read_metrics(tmp_path)) <= 3
    finally:
        kernel.close()


def test_an_interrupt_during_the_warm_start_stops_its_thread(tmp_path, monkeypatch):
    """In a notebook the warm start's build thread trained on after the interrupt (holding the cache's lock, so the
    next run waited for it); the run now stops it at its next step."""
    from molt.train.sft import SftTrainer

    step = SftTrainer.step

    def interrupt_at_step_two(trainer, batches):
        if trainer.version == 2:
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
        return step(trainer, batches)

    monkeypatch.setattr(SftTrainer, "step", interrupt_at_step_two)
    monkeypatch.setenv("MOLT_CACHE", str(tmp_path / "cache"))
    earlier, kernel = set(threading.enumerate()), asyncio.new_event_loop()
    cfg = molt.make_config(TINY, model={"warmstart_steps": 100000}, log={"run_dir": str(tmp_path / "run")})
    try:
        with pytest.raises(KeyboardInterrupt):
            kernel.run_until_complete(molt.train_async(cfg))
    finally:
        kernel.close()
    for thread in set(threading.enumerate()) - earlier:
        thread.join(60)
        assert not thread.is_alive(), thread.name  # not the 100000 steps


@pytest.mark.skipif(importlib.util.find_spec("wandb") is None, reason="wandb is not installed (optional)")
def test_wandb_offline_writes_its_run_files(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir = tmp_path / "run"
    log = {"run_dir": str(run_dir), "wandb_project": "molt-test", "wandb_mode": "offline"}
    result = molt.train(TINY, log=log)
    files = list((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 1 and files[0].stat().st_size > 0
    assert (run_dir / "wandb_run_id").read_text() in files[0].name
    assert result.history[-1]["step"] == 2


@pytest.mark.skipif(importlib.util.find_spec("wandb") is None, reason="wandb is not installed (optional)")
def test_wandb_without_a_login_is_one_config_line(tmp_path, monkeypatch):
    """Online W&B (the default mode) with no login was an internal error with a traceback."""
    import wandb

    def no_login(**kw):
        raise wandb.errors.UsageError("No API key configured. Use `wandb login` to log in.")

    monkeypatch.setattr(wandb, "init", no_login)
    with pytest.raises(ConfigError, match=r"log.wandb_project: W&B did not start \(No API key.*--log.wandb_mode off"):
        RunDir(tmp_path / "run", "train", molt.make_config(log={"wandb_project": "p"}))


def test_keyword_overrides_replace_a_config_files_values_before_they_are_checked(tmp_path):
    """`make_config("recipe.toml", model={"path": ...})` failed on the file's own model folder, gone here, which the
    keyword replaces (as `--config recipe.toml --model.path elsewhere/` does)."""
    (tmp_path / "recipe.toml").write_text('[model]\npath = "gone/model"\n[train]\nmax_steps = 3\n')
    config = molt.make_config(str(tmp_path / "recipe.toml"), model={"path": ""})
    assert (config.model.path, config.train.max_steps) == ("", 3)


def test_missing_wandb_is_one_config_line(monkeypatch, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError, match=r"log.wandb_project: wandb is not installed: `pip install wandb`"):
        molt.make_config(log={"wandb_project": "p"})
    one_line(run_molt(capsys, "train", "--log.wandb_project", "p", "--log.wandb_mode", "offline"),
             "log.wandb_project", "pip install wandb")  # fmt: skip


def test_a_run_directory_stays_put_when_agent_code_changes_the_working_directory(tmp_path, monkeypatch):
    """An agent (a sandboxed tool) that calls os.chdir in the run's process: the run keeps writing where it began
    (its TensorBoard files moved with the cwd: a Molt internal error)."""
    monkeypatch.chdir(tmp_path)
    run = RunDir("run", "train", Config())
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    run.log({"step": 1, "train/loss": 0.5})
    run.close()
    assert run.path == tmp_path / "run" and (tmp_path / "run" / "metrics.jsonl").read_text().count("train/loss") == 1
    assert list((tmp_path / "run" / "tb").iterdir()) and not (tmp_path / "elsewhere" / "run").exists()


def test_a_config_changed_after_it_was_made_is_checked_again():
    """`cfg.train.max_steps = 0` or a str for a tuple after make_config ran a 'done' run of nothing, or failed only
    once the model and engine were built (a filter named 'n': the str's letters), and wrote a config.yaml that
    --resume could not read. make_config (and so molt.train) builds a Config afresh."""
    from molt.config import ConfigError

    cfg = molt.make_config({"train.max_steps": 3})
    assert molt.make_config(cfg) == cfg
    cfg.train.max_steps = 0
    with pytest.raises(ConfigError, match="train.max_steps: must be > 0"):
        molt.train(cfg)
    cfg.train.max_steps, cfg.rollout.filters = 3, "nonfinite"
    with pytest.raises(ConfigError, match="rollout.filters: expected tuple"):
        molt.make_config(cfg)
