"""Run directories: a new run refuses a non-empty one, a finished run's resume says what to raise, and
checkpoints are readable by the group with an interrupted save's temp folders removed at the next save."""

import os
import stat

from conftest import TINY_RUN, one_line, run_molt  # noqa: I001 - tests/conftest.py

from molt.cli.main import main
from molt.loop.checkpoint import remove_orphans, share_like_new_files

TINY = [*TINY_RUN, "--data.task", "arithmetic", "--data.num_train", "32", "--data.num_eval", "4",
        "--rollout.n_samples_per_prompt", "2", "--rollout.max_tokens", "4"]  # fmt: skip


def test_new_run_refuses_a_non_empty_run_dir(tmp_path, capsys):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "notes.txt").write_text("mine")
    err = one_line(run_molt(capsys, "train", *TINY, "--log.run_dir", str(tmp_path / "run")))
    assert f"log.run_dir: {tmp_path / 'run'} already holds files" in err and "--resume" in err
    assert sorted(os.listdir(tmp_path / "run")) == ["notes.txt"]  # nothing written


def test_resume_finished_run_orphans_and_group_readable_checkpoints(tmp_path, capsys):
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
        main(["train", "--resume", str(run), "--train.max_steps", "2"])
    finally:
        os.umask(old_mask)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["latest", "step-1", "step-2"]
    for path in [run / "checkpoints" / "step-2", *(run / "checkpoints" / "step-2").iterdir()]:
        expected = 0o755 if path.is_dir() else 0o644
        assert stat.S_IMODE(path.stat().st_mode) == expected, path


def test_orphan_cleanup_and_modes_follow_the_umask(tmp_path):
    (tmp_path / ".step-3.abc").mkdir()
    (tmp_path / ".latest.tmp").write_text("step-3")
    (tmp_path / "step-2").mkdir()
    assert sorted(p.name for p in remove_orphans(tmp_path)) == [".latest.tmp", ".step-3.abc"]
    assert [p.name for p in tmp_path.iterdir()] == ["step-2"]
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
