"""Run directories: a new run refuses a non-empty one, a finished run's resume says what to raise, Ctrl-C
leaves a resumable run (no rollout counted failed), a resumed run goes on in its own (possibly moved) folder
with each step logged once, and checkpoints are readable by the group with an interrupted save's temp folders
removed at the next save."""

import asyncio
import json
import os
import shutil
import signal
import stat
import subprocess
import sys

import pytest
import yaml
from conftest import TINY_RUN, one_line, run_molt  # noqa: I001 - tests/conftest.py

from molt.cli.main import main
from molt.loop.checkpoint import remove_orphans
from molt.models.hf_io import share_like_new_files

TINY = [*TINY_RUN, "--data.task", "arithmetic", "--data.num_train", "32", "--data.num_eval", "4",
        "--rollout.n_samples_per_prompt", "2", "--rollout.max_tokens", "4"]  # fmt: skip
FOLDER = TINY[4:]  # beside --model.path: no --model.preset / warmstart_steps (refused there: they do nothing)


def test_new_run_refuses_a_non_empty_run_dir(tmp_path, capsys):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "notes.txt").write_text("mine")
    err = one_line(run_molt(capsys, "train", *TINY, "--log.run_dir", str(tmp_path / "run")))
    assert f"log.run_dir: {tmp_path / 'run'} already holds files" in err and "--resume" not in err  # none to resume
    assert sorted(os.listdir(tmp_path / "run")) == ["notes.txt"]  # nothing written


def test_resume_finished_run_orphans_and_group_readable_checkpoints(tmp_path, capsys, monkeypatch):
    run = tmp_path / "run"
    old_mask = os.umask(0o022)
    try:
        main(["train", *TINY, "--train.max_steps", "1", "--log.run_dir", str(run)])
        err = one_line(run_molt(capsys, "train", *TINY, "--train.max_steps", "1", "--log.run_dir", str(run)))
        assert "already holds a run" in err and f"--resume {run}" in err
        err = one_line(run_molt(capsys, "train", "--resume", str(run)))
        assert "is finished (its latest checkpoint is step 1, train.max_steps is 1)" in err
        assert "raise --train.max_steps" in err
        orphan = run / "checkpoints" / ".step-2.crashed"  # what a save killed mid-write leaves
        orphan.mkdir()
        (orphan / "model.safetensors").write_bytes(b"partial")
        import molt.cli.train as train

        saves, save = [], train.save_checkpoint
        monkeypatch.setattr(
            train, "save_checkpoint", lambda run_dir, *rest: saves.append(rest[1].step) or save(run_dir, *rest)
        )
        main(["train", "--resume", str(run), "--train.max_steps", "2", "--ckpt.every", "1"])
        assert saves == [2]  # the last step's checkpoint is written once (on_step's), not again at the end
    finally:
        os.umask(old_mask)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["latest", "step-1", "step-2"]
    for path in [run / "checkpoints" / "step-2", *(run / "checkpoints" / "step-2").iterdir()]:
        expected = 0o755 if path.is_dir() else 0o644
        assert stat.S_IMODE(path.stat().st_mode) == expected, path
    (run / "checkpoints" / "step-7").mkdir()  # a save killed after the model, before its trainer state
    (run / "checkpoints" / "step-7" / "config.json").write_text("{}")
    main(["train", "--resume", str(run), "--train.max_steps", "3", "--ckpt.every", "1", "--ckpt.keep", "2"])
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["latest", "step-2", "step-3"]


def test_ctrl_c_then_resume_of_the_moved_run_dir(tmp_path):
    run, moved = tmp_path / "run", tmp_path / "moved"
    args = [*TINY, "--train.max_steps", "40", "--ckpt.every", "2", "--log.every", "1", "--log.run_dir", str(run)]
    molt = subprocess.Popen([sys.executable, "-m", "molt.cli.main", "train", *args], stderr=subprocess.PIPE, text=True)
    for line in molt.stderr:
        if "step 5/40" in line:
            molt.send_signal(signal.SIGINT)  # Ctrl-C mid-run, rollouts in flight
            break
    err = molt.stderr.read()
    assert molt.wait() == 130, err
    assert err.strip().splitlines()[-1].startswith("molt train: interrupted") and "failed" not in err, err
    assert not (run / "rollout_failures.log").exists()  # the closing engine fails no rollout
    assert yaml.safe_load((run / "config.yaml").read_text())["ckpt"]["resume"] == ""  # --config of it: a new run
    run.rename(moved)
    main(["train", "--resume", str(moved), "--train.max_steps", "8"])
    assert not run.exists()  # continued where the run now is
    steps = [json.loads(line)["step"] for line in (moved / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 9))  # rows logged after the resumed checkpoint were dropped, none twice


def test_sigterm_to_a_background_job_stops_it_as_ctrl_c_does(tmp_path):
    """`molt train ... &` in a script runs with SIGINT ignored: SIGTERM (`kill`, `timeout`, Slurm) raised the interrupt
    from its signal handler wherever the process was, so the run's clean-up did not run (agent workers started
    again while it shut down, an abort at exit); it now cancels the run on its event loop."""
    args = [*TINY, "--train.max_steps", "40", "--rollout.agent_workers", "1", "--log.every", "1", "--log.run_dir"]
    command = [sys.executable, "-m", "molt.cli.main", "train", *args, str(tmp_path / "run")]
    background = lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)  # noqa: E731 - as a shell starts `cmd &`
    molt = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, preexec_fn=background)
    for line in molt.stderr:
        if "step 3/40" in line:
            molt.send_signal(signal.SIGTERM)
            break
    err = molt.stderr.read()
    assert molt.wait(timeout=120) == 143, err
    assert err.strip().splitlines()[-1].startswith("molt train: terminated (SIGTERM)"), err
    assert "starting another" not in err and "Event loop is closed" not in err and "pending" not in err, err


def test_a_second_ctrl_c_gets_out_of_code_blocking_the_loop():
    """The first cancels the run (its clean-up runs once the loop is free); a second raises at once, out of sync code
    blocking the loop, as asyncio.run's own Ctrl-C does (it waited for that code to return)."""
    import threading
    import time

    from molt.cli.signals import interruptible

    finished = []

    @interruptible
    async def blocked():
        time.sleep(30)  # a sync call in agent code or a long load
        finished.append(True)

    main = threading.main_thread().ident
    for delay in (0.3, 0.6):
        threading.Timer(delay, signal.pthread_kill, (main, signal.SIGINT)).start()
    with pytest.raises(KeyboardInterrupt):
        asyncio.run(blocked())
    assert not finished and signal.getsignal(signal.SIGINT) is signal.default_int_handler  # restored


def test_a_signal_after_the_runs_last_await_keeps_its_result():
    """Cancelled from the signal handler, a run past its last await (writing its summary) lost its result to a bare
    CancelledError; the cancel now waits for the loop, by when the run has returned."""
    import os

    from molt.cli.signals import interruptible

    @interruptible
    async def finishing():
        await asyncio.sleep(0)
        os.kill(os.getpid(), signal.SIGINT)  # arrives during the synchronous tail
        return "done"

    assert asyncio.run(finishing()) == "done"


def test_ctrl_c_during_the_warm_start_stops_at_once(tmp_path):
    env = {**os.environ, "MOLT_CACHE": str(tmp_path / "cache")}
    args = [*TINY, "--model.warmstart_steps", "100000", "--log.every", "1", "--log.run_dir", str(tmp_path / "run")]
    molt = subprocess.Popen([sys.executable, "-m", "molt.cli.main", "train", *args], stderr=subprocess.PIPE,
                            text=True, env=env)  # fmt: skip
    for line in molt.stderr:
        if "step 2/100000" in line:  # the warm start's SFT is training on its thread
            molt.send_signal(signal.SIGINT)
            break
    err = molt.stderr.read()
    assert molt.wait(timeout=120) == 130, err  # not after 100000 steps
    assert err.strip().splitlines()[-1].startswith("molt train: interrupted"), err


def test_orphan_cleanup_and_modes_follow_the_umask(tmp_path):
    (tmp_path / ".step-3.abc").mkdir()
    (tmp_path / ".latest.tmp").write_text("step-3")
    (tmp_path / "step-2").mkdir()
    (tmp_path / "step-2" / "trainer_state.pt").write_bytes(b"")
    (tmp_path / "step-4").mkdir()  # no trainer state: its save was killed
    (tmp_path / "step-2-best").mkdir()  # a user's copy: not Molt's, left alone (its name made every save crash)
    assert sorted(p.name for p in remove_orphans(tmp_path)) == [".latest.tmp", ".step-3.abc", "step-4"]
    shutil.rmtree(tmp_path / "step-2-best")
    assert [p.name for p in tmp_path.iterdir()] == ["step-2"]
    (tmp_path / "step-1").mkdir()  # older than `latest`, its trainer state deleted by its user: kept
    (tmp_path / "latest").write_text("step-2")
    assert remove_orphans(tmp_path) == [] and (tmp_path / "step-1").is_dir()
    (tmp_path / "latest").unlink()
    (tmp_path / "step-1").rmdir()
    folder = tmp_path / "step-2"
    (folder / "w.bin").write_bytes(b"")
    folder.chmod(0o700)
    (folder / "w.bin").chmod(0o600)
    old_mask = os.umask(0o027)
    try:
        share_like_new_files(folder)
    finally:
        os.umask(old_mask)
    assert stat.S_IMODE(folder.stat().st_mode) == 0o750
    assert stat.S_IMODE((folder / "w.bin").stat().st_mode) == 0o640


def test_a_run_that_stopped_before_its_first_step_can_start_again_and_models_save_readable(tmp_path, capsys):
    from conftest import small_model

    from molt.models import save_pretrained

    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text('{"model_type": "gpt2"}')
    (tmp_path / "bad" / "model.safetensors").write_bytes(b"")
    err = one_line(run_molt(capsys, "train", *FOLDER, "--model.path", str(tmp_path / "bad")))
    assert "model.path: " in err and "model_type='gpt2' is not supported" in err
    run = tmp_path / "run"
    run.mkdir()  # what a start that failed after writing its config leaves
    (run / "config.yaml").write_text("{}")
    (run / "metrics.jsonl").write_text("")
    main(["train", *TINY, "--train.max_steps", "1", "--log.run_dir", str(run)])
    assert (run / "checkpoints" / "latest").exists()
    old_mask = os.umask(0o022)
    try:
        folder = save_pretrained(small_model(), tmp_path / "model")  # safetensors itself writes 0600
    finally:
        os.umask(old_mask)
    assert {stat.S_IMODE(p.stat().st_mode) for p in folder.iterdir()} == {0o644}


def test_resume_refuses_settings_its_checkpoint_state_cannot_hold(tmp_path, capsys):
    run = tmp_path / "run"
    main(["train", *TINY, "--train.max_steps", "1", "--log.run_dir", str(run)])
    for flags, what in (
        (["--train.lora_rank", "4"], "train.lora_rank is 4 here but 0 in {run}"),
        (["--algo.estimator", "gae"], "adds a critic (algo.estimator gae), which {run} was trained without"),
        (["--algo.kl_coef", "0.1"], "adds a KL reference (algo.kl_coef > 0), which {run} was trained without"),
        (["--model.preset", "small"], "model.preset is small here but tiny in {run}"),  # the checkpoint's policy
        (
            ["--train.precision", "pure", "--model.dtype", "bfloat16"],
            "the trainer's parameter dtype (train.precision, model.dtype) is bfloat16 here but float32 in {run}",
        ),  # its fp32 Adam state would be cast down
    ):
        err = one_line(run_molt(capsys, "train", "--resume", str(run), "--train.max_steps", "2", *flags))
        assert "ckpt.resume: " + what.format(run=run) in err and f"--model.path {run}" in err
    lora = tmp_path / "lora"  # its adapters were trained at this alpha: another one would rescale them
    main(["train", *TINY, "--train.max_steps", "1", "--train.lora_rank", "4", "--log.run_dir", str(lora)])
    err = one_line(
        run_molt(capsys, "train", "--resume", str(lora), "--train.max_steps", "2", "--train.lora_alpha", "64")
    )
    assert f"ckpt.resume: train.lora_alpha is 64.0 here but 16.0 in {lora}" in err
    adaptive = tmp_path / "adaptive"  # its coefficient is checkpointed state: a new start value would not act
    kl = ("--algo.kl_coef", "0.1", "--algo.kl_target", "0.5")
    main(["train", *TINY, "--train.max_steps", "1", *kl, "--log.run_dir", str(adaptive)])
    resume = ("train", "--resume", str(adaptive), "--train.max_steps", "2")
    err = one_line(run_molt(capsys, *resume, "--algo.kl_coef", "0.5"))
    assert "algo.kl_coef: the adaptive KL coefficient (algo.kl_target) continues from" in err
    saved = yaml.safe_load((run / "config.yaml").read_text())  # as a Ray run writes it: the backend and its settings
    saved["runtime"] |= {"backend": "ray", "engines": 2}
    (run / "config.yaml").write_text(yaml.safe_dump(saved))
    err = one_line(run_molt(capsys, "train", "--resume", str(run), "--runtime.backend", "local"))
    assert f"ckpt.resume: runtime.backend is local here but ray in {run}" in err  # not its runtime.engines line


def test_resume_after_the_model_folder_moved_takes_its_new_place(tmp_path, capsys):
    """The checkpoint holds the policy: a base model folder moved since the run resumes from `--model.path NEW`
    (the old place no longer exists); while it still exists, another folder is refused as before."""
    from molt.models import Transformer, build_builtin_tokenizer, preset, save_pretrained

    tokenizer = build_builtin_tokenizer()
    save_pretrained(Transformer(preset("tiny", vocab_size=len(tokenizer))), tmp_path / "base", tokenizer=tokenizer)
    run = tmp_path / "run"
    main(
        ["train", *FOLDER, "--train.max_steps", "1", "--model.path", str(tmp_path / "base"), "--log.run_dir", str(run)]
    )
    shutil.copytree(tmp_path / "base", tmp_path / "copy")
    err = one_line(run_molt(capsys, "train", "--resume", str(run), "--train.max_steps", "2", "--model.path",
                            str(tmp_path / "copy")))  # fmt: skip
    assert "model.path is " in err and "keep the run's setting" in err
    (tmp_path / "base").rename(tmp_path / "moved")
    err = one_line(run_molt(capsys, "train", "--resume", str(run), "--train.max_steps", "2"))
    assert "model.path: " in err and "does not exist" in err
    main(["train", "--resume", str(run), "--train.max_steps", "2", "--model.path", str(tmp_path / "moved")])
    assert (run / "checkpoints" / "step-2").is_dir()


def test_json_safe_writes_what_strict_json_readers_take():
    """Eval results and rollout dumps share one converter: numbers stay numbers, the rest becomes text."""
    import datetime
    import decimal

    import numpy as np
    from PIL import Image

    from molt.log import json_safe

    value = {"np": np.float32(0.5), "nan": [float("nan"), np.float64("-inf")], 3: decimal.Decimal("1.50")}
    value |= {"day": datetime.date(2026, 1, 2), "image": Image.new("RGB", (2, 2)), "bytes": b"x" * 200, "s": {1}}
    assert json.loads(json.dumps(json_safe(value), allow_nan=False)) == {
        "np": 0.5, "nan": ["nan", "-inf"], "3": "1.50", "day": "2026-01-02", "image": "<Image>", "bytes": "<bytes>",
        "s": "{1}",
    }  # fmt: skip


def test_a_run_directory_is_held_by_one_process_and_a_cut_short_row_is_left_out(tmp_path, capsys):
    """Two runs given one --log.run_dir (or a resume beside its still running run) overwrote each other's
    checkpoints and metrics, both exiting 0; a full disk's half-written last row made --resume an internal error."""
    from molt.config import Config, ConfigError
    from molt.log import RunDir, read_metrics

    first = RunDir(tmp_path, "train", Config())
    with pytest.raises(ConfigError, match="is in use by another molt process"):
        RunDir(tmp_path, "train", Config())
    first.log({"step": 1, "x": 1.0})
    first.close()
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 2, "x":')  # the disk filled up here
    RunDir(tmp_path, "train", Config(), resumed=1).close()  # free again; the resume trims the broken row
    assert read_metrics(tmp_path) == [{"step": 1, "x": 1.0}]
    assert "metrics.jsonl:2: a row cut short" in capsys.readouterr().err
    (tmp_path / "metrics.jsonl").write_text('{"step": 1\n{"step": 2}\n')  # a broken row before the last
    with pytest.raises(ConfigError, match=r"metrics.jsonl:1: not a JSON row"):
        RunDir(tmp_path, "train", Config(), resumed=1)
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    RunDir(tmp_path, "train", Config(), resumed=1).close()  # the failed one let the folder go


def test_a_resume_reads_a_hand_edited_config_yaml_with_its_defaults(tmp_path):
    """A key deleted from a run's config.yaml was an internal KeyError on --resume (the resume's own config fills
    it with its default, and so does the check of the saved settings now); an empty file is one line."""
    from molt import make_config
    from molt.cli.train import check_run_dir
    from molt.config import Config, ConfigError

    (tmp_path / "checkpoints" / "step-2").mkdir(parents=True)
    (tmp_path / "checkpoints" / "step-2" / "trainer_state.pt").write_bytes(b"")
    (tmp_path / "checkpoints" / "latest").write_text("step-2")
    form = Config().file_form()
    del form["train"]["precision"], form["critic"]
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(form))
    assert check_run_dir(make_config({"ckpt.resume": str(tmp_path), "train.max_steps": 8})) == 2
    (tmp_path / "config.yaml").write_text("")
    with pytest.raises(ConfigError, match="config.yaml holds no settings"):
        check_run_dir(make_config({"ckpt.resume": str(tmp_path), "train.max_steps": 8}))


def test_a_checkpoint_gone_or_cut_short_is_one_line(tmp_path):
    """`latest` naming a deleted folder said it had no trainer state; a trainer_state.pt cut short (a machine
    crash after its rename) was an internal error."""
    from molt import make_config
    from molt.config import Config, ConfigError
    from molt.loop.checkpoint import load_training_state

    (tmp_path / "checkpoints" / "step-2").mkdir(parents=True)
    (tmp_path / "checkpoints" / "latest").write_text("step-4")
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(Config().file_form()))
    with pytest.raises(ConfigError, match="latest names step-4, which is gone"):
        make_config({"ckpt.resume": str(tmp_path), "train.max_steps": 8})
    torch_file = tmp_path / "checkpoints" / "step-2" / "trainer_state.pt"
    torch_file.write_bytes(b"PK\x03\x04 cut short")
    with pytest.raises(ConfigError, match="trainer_state.pt cannot be read"):
        load_training_state(torch_file.parent, trainer=None)


def test_a_resume_given_another_config_file_is_refused(tmp_path, capsys):
    """`--resume RUN --config other.yaml` went on training RUN with the file's settings (every other one at its
    default: another task, batch and learning rate), exit 0; the run's own config.yaml is still accepted."""
    from molt import make_config
    from molt.config import Config, ConfigError

    run, other = tmp_path / "run", tmp_path / "other.yaml"
    (run / "checkpoints" / "step-2").mkdir(parents=True)
    (run / "checkpoints" / "step-2" / "trainer_state.pt").write_bytes(b"")
    (run / "checkpoints" / "latest").write_text("step-2")
    (run / "config.yaml").write_text(yaml.safe_dump(Config().file_form()))
    other.write_text("train:\n  max_steps: 8\n")
    (tmp_path / "resumes.yaml").write_text(f"ckpt:\n  resume: {run}\n")  # a file naming the run itself
    for args in (["--resume", str(run), "--config", str(other)], ["--config", str(other), f"--ckpt.resume={run}"],
                 ["--config", str(tmp_path / "resumes.yaml")]):  # fmt: skip
        with pytest.raises(SystemExit) as exit_info:
            main(["train", *args])
        assert exit_info.value.code == 2 and "would replace" in capsys.readouterr().err
    for path, overrides in ((other, {"ckpt": {"resume": str(run)}}), (tmp_path / "resumes.yaml", {})):
        with pytest.raises(ConfigError, match="would replace"):
            make_config(str(path), **overrides)
    assert make_config(str(run / "config.yaml"), ckpt={"resume": str(run)}, train={"max_steps": 8}).ckpt.resume


def test_a_checkpoint_is_on_disk_before_latest_names_it(tmp_path, monkeypatch):
    """A machine crash after `latest` was renamed could leave it naming files the page cache never wrote."""
    import molt.log

    events = []
    fsync, replace = os.fsync, os.replace
    monkeypatch.setattr(molt.log.os, "fsync", lambda fd: events.append(os.readlink(f"/proc/self/fd/{fd}")) or fsync(fd))
    monkeypatch.setattr(molt.log.os, "replace", lambda a, b: events.append(("replace", str(b))) or replace(a, b))
    run = tmp_path / "run"
    main(["train", *TINY, "--train.max_steps", "1", "--log.run_dir", str(run)])
    step = run / "checkpoints" / "step-1"
    named = events.index(("replace", str(run / "checkpoints" / "latest")))
    synced = set(events[:named])
    assert {str(p) for p in [step, *step.rglob("*")]} <= synced
    assert str(run / "checkpoints") in events[named:]  # the rename itself, too
    (step / "gone").symlink_to(tmp_path / "nowhere")  # a dangling link in a folder (it aborted the save)
    molt.log.sync_tree(step)


def test_the_adaptive_kl_refusals_remedy_works_as_given(tmp_path, capsys):
    """Its remedy, `--algo.kl_target 0`, then failed on the run's own kl_horizon (no effect with a fixed KL)."""
    run = tmp_path / "run"
    kl = ["--algo.kl_coef", "0.05", "--algo.kl_target", "0.05", "--algo.kl_horizon", "100"]
    main(["train", *TINY, *kl, "--train.max_steps", "1", "--log.run_dir", str(run)])
    err = one_line(run_molt(capsys, "train", "--resume", str(run), "--train.max_steps", "2", "--algo.kl_coef", "0.1"))
    remedy = err.split("(or ")[1].split(" for a fixed")[0].split()
    assert remedy == ["--algo.kl_target", "0", "--algo.kl_horizon", "10000"]
    main(["train", "--resume", str(run), "--train.max_steps", "2", "--algo.kl_coef", "0.1", *remedy])
