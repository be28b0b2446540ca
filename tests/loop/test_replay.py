"""Rollout dump and replay: a replay of an on-policy run's dump reproduces its losses bit for bit, with no
engine; a corrupted dump stops the replay naming its file, line and field."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from test_loop import FAST  # noqa: I001 - tests/loop/test_loop.py

import molt.runtime.base
from molt.cli.main import parse_command
from molt.cli.train import run_train
from molt.config import ConfigError
from molt.data.trajectory import Trajectory
from molt.loop.dump import DumpError, read_shard, shard_name, write_shard
from molt.models import preset
from molt.models.vision import pixel_hash

STEPS = 3


@pytest.fixture(scope="module")
def dumped(tmp_path_factory) -> tuple[Path, list[dict]]:
    """A 3-step on-policy run with `--rollout.dump`: its run directory and per-step metrics."""
    folder = tmp_path_factory.mktemp("dump")
    (folder / "reward.py").write_text("def reward(completion, row):\n    return float(sum(map(ord, completion)) % 3)\n")
    run = folder / "run"
    flags = [*FAST, "--log.run_dir", str(run), "--train.max_steps", str(STEPS), "--rollout.max_staleness", "0",
             "--train.lr", "1e-3", "--rollout.dump", "--rollout.reward", f"{folder / 'reward.py'}:reward"]  # fmt: skip
    history = run_train(parse_command(["train", *flags])).history
    assert all(m["train/grad_norm"] > 0 for m in history)  # the weights do change (the loss may be 0: GRPO's
    # advantages sum to 0 in a group, so samples of equal length give a token-mean of exactly 0, with a gradient)
    return run, history


def _replay(target: Path, run_dir: Path, *flags: str):
    return run_train(parse_command(["train", "--replay", str(target), "--log.run_dir", str(run_dir), *flags]))


def _no_engine(monkeypatch) -> None:
    def refuse(*args, **kw):
        raise AssertionError("a replay must not build an engine")

    monkeypatch.setattr(molt.runtime.base, "build_engine", refuse)


def test_dump_holds_every_trained_sample(dumped):
    run, history = dumped
    shards = sorted((run / "rollouts").glob("step-*.jsonl"))
    assert [p.name for p in shards] == [shard_name(s) for s in range(1, STEPS + 1)]
    for step, (path, metrics) in enumerate(zip(shards, history, strict=True), 1):
        lines = [json.loads(x) for x in path.read_text().splitlines()]
        assert len(lines) == metrics["train/num_samples"]
        assert all(x["step"] == step and x["version"] == step - 1 for x in lines)
        assert sum(sum(x["loss_mask"]) for x in lines) == metrics["train/action_tokens"]
        assert all(v == step - 1 for x in lines for v, m in zip(x["versions"], x["loss_mask"], strict=True) if m)


def test_replay_reproduces_the_on_policy_run_bit_exactly(dumped, tmp_path, monkeypatch):
    run, history = dumped
    _no_engine(monkeypatch)
    replay = _replay(run, tmp_path / "replay")
    for key in ("train/loss", "train/grad_norm", "train/logprob_diff", "train/reward_mean", "train/num_samples"):
        assert [m[key] for m in replay.history] == [m[key] for m in history], key
    logged = [json.loads(x) for x in (tmp_path / "replay" / "metrics.jsonl").read_text().splitlines()]
    assert [m["train/loss"] for m in logged if "train/loss" in m] == [m["train/loss"] for m in history]
    # the rollouts folder names the dump as well as its run directory
    again = _replay(run / "rollouts", tmp_path / "again", "--config", str(run / "config.yaml"))
    assert [m["train/loss"] for m in again.history] == [m["train/loss"] for m in history]
    # `molt eval` of the replay run reads its config.yaml (rollout.replay set): the replay's refusals are train's
    assert parse_command(["eval", str(tmp_path / "replay"), "--rollout.max_tokens", "8"]).rollout.max_tokens == 8


def test_a_replay_needs_neither_the_data_nor_the_reward(dumped, tmp_path):
    """The dump holds every batch (images too): a replay of a run whose data or reward file moved, or on another
    machine, read and checked them first and failed on their absence."""
    run, history = dumped
    reward = run.parent / "reward.py"
    reward.rename(run.parent / "moved.py")
    try:
        replay = _replay(run, tmp_path / "replay")
    finally:
        (run.parent / "moved.py").rename(reward)
    assert [m["train/loss"] for m in replay.history] == [m["train/loss"] for m in history]


def test_a_replay_from_another_initial_policy_is_warned_about(dumped, tmp_path, caplog):
    """The policy is rebuilt from config.yaml: another one (here another seed's random init; in use, a changed model
    folder or warm-start cache) trained silently against the dump's log-probs."""
    run, history = dumped
    with caplog.at_level("WARNING", logger="molt.loop"):
        _replay(run, tmp_path / "same")
    assert "is not the one that sampled the dump" not in caplog.text
    with caplog.at_level("WARNING", logger="molt.loop"):
        _replay(run, tmp_path / "other", "--train.seed", "7")
    assert "replay step 1: train/logprob_diff" in caplog.text and "not the one that sampled the dump" in caplog.text


CORRUPTIONS = {  # an edit of one line (the second of step 1's shard) and what the error says
    "token out of vocab": (lambda r: r["tokens"].__setitem__(0, 10**6), "field 'tokens': id 1000000"),
    "missing field": (lambda r: r.pop("loss_mask"), "field 'loss_mask': missing"),
    "version newer than the step": (
        lambda r: r["versions"].__setitem__(r["loss_mask"].index(1), 5),
        "field 'versions': a token sampled at version 5 is newer than the trainer",
    ),
    "token changed": (
        lambda r: r["tokens"].__setitem__(r["loss_mask"].index(1), (r["tokens"][r["loss_mask"].index(1)] + 1) % 256),
        "differ from the engine's",
    ),
}


@pytest.mark.parametrize("kind", CORRUPTIONS)
def test_a_corrupted_dump_fails_naming_file_line_and_field(dumped, tmp_path, monkeypatch, kind):
    run, _ = dumped
    copy = tmp_path / "copy"
    shutil.copytree(run / "rollouts", copy / "rollouts")
    shutil.copy(run / "config.yaml", copy / "config.yaml")
    shard = copy / "rollouts" / shard_name(1)
    lines = shard.read_text().splitlines()
    record = json.loads(lines[1])
    edit, message = CORRUPTIONS[kind]
    edit(record)
    lines[1] = json.dumps(record)
    shard.write_text("\n".join(lines) + "\n")
    _no_engine(monkeypatch)
    with pytest.raises(DumpError, match=re.escape(f"{shard}:2: ") + ".*" + re.escape(message)):
        _replay(copy, tmp_path / "replay")


def test_a_dump_shorter_than_max_steps_is_refused_before_any_model(dumped, tmp_path):
    run, _ = dumped
    with pytest.raises(ConfigError, match=f"no shard for step {STEPS + 1}"):
        _replay(run, tmp_path / "replay", "--train.max_steps", str(STEPS + 1))


@pytest.mark.parametrize(
    "flag",
    [
        ["--eval.seed", "3"],
        ["--runtime.engine_compile"],
        ["--rollout.filters", "nonfinite"],
        ["--rollout.top_p", "0.5"],
        ["--rollout.n_samples_per_prompt", "2"],
        ["--rollout.temperature", "0.5"],
        ["--runtime.engines", "2", "--runtime.backend", "ray"],  # Ray's replicas: a replay places none
    ],  # fmt: skip
)
def test_a_flag_replay_never_reads_is_refused(dumped, flag):
    """Engine, sampling-filter, data and eval flags did nothing in a replay (no engine, no data, no eval), silently."""
    run, _ = dumped
    with pytest.raises(ConfigError, match=f"{flag[0][2:]}: has no effect with --replay"):
        parse_command(["train", "--replay", str(run), *flag])


def test_a_replay_on_ray_places_only_its_trainer_ranks(dumped, capsys):
    """It reserved a bundle for every engine replica it never starts (an idle GPU each), and refused a --num_cpus
    that holds only the ranks."""
    run, _ = dumped
    flags = ["--runtime.backend", "ray", "--runtime.trainer_ranks", "2", "--runtime.num_cpus", "2"]
    assert parse_command(["train", "--replay", str(run), *flags]).runtime.num_cpus == 2
    with pytest.raises(SystemExit):
        parse_command(["train", *flags, "--rollout.prompts_per_step", "2"])  # a run: engines too
    assert "runtime.num_cpus: (2) must be >= (engines + trainer_ranks)" in capsys.readouterr().err


def test_a_resumed_run_may_not_replay_its_own_dump(dumped, tmp_path):
    run, _ = dumped
    shutil.copytree(run, tmp_path / "run")
    shutil.copy(tmp_path / "run" / "rollouts" / shard_name(3), tmp_path / "run" / "rollouts" / shard_name(4))
    shards = sorted((tmp_path / "run" / "rollouts").iterdir())  # steps 1-4; resuming at 3 would drop step 4's
    flags = ["--resume", str(tmp_path / "run"), "--rollout.replay", str(tmp_path / "run"), "--train.max_steps", "4"]
    with pytest.raises(ConfigError, match="rollout.replay: .* this run's own dump"):
        run_train(parse_command(["train", *flags]))
    assert sorted((tmp_path / "run" / "rollouts").iterdir()) == shards  # nothing trimmed


def test_shard_round_trip_keeps_routing_images_and_floats_exactly(tmp_path):
    pixels = torch.arange(48, dtype=torch.uint8).reshape(3, 4, 4)
    info = {"t": torch.tensor(2.5), "a": np.arange(3), (1, 2): [np.float32(0.5)], "r": range(2)}  # never fails
    info["nan"] = [float("nan"), np.float64("inf")]  # as text: strict JSON has no NaN
    traj = Trajectory(reward=0.1 + 0.2, score=1.0, group_id=3, rollout_id=7, info=info)
    traj.extend_prompt([1, 2, 3])
    traj.extend_action([4, 5], [-0.123456789012345678, -1e-30], [2, 2])
    traj.routing = torch.tensor([[[0, 1]], [[-1, -1]], [[3, 2]], [[2, 0]], [[-1, -1]]], dtype=torch.int16)
    traj.images = [{"start": 1, "pixels": pixels, "hash": pixel_hash(pixels)}]
    folder = tmp_path / "rollouts"
    path = write_shard(folder, 3, 3, [traj])  # tokens of version 2 trained at version 3
    (back,) = read_shard(path, step=3, vocab_size=8, trainer_version=3, max_staleness=1)
    for f in ("tokens", "loss_mask", "rollout_logprobs", "versions", "reward", "score", "actions", "group_id"):
        assert getattr(back, f) == getattr(traj, f), f
    assert back.routing.dtype == torch.int16 and torch.equal(back.routing, traj.routing)
    assert torch.equal(back.images[0]["pixels"], pixels) and back.images[0]["hash"] == traj.images[0]["hash"]
    assert back.info == {"t": 2.5, "a": [0, 1, 2], "(1, 2)": [0.5], "r": "range(0, 2)", "nan": ["nan", "inf"]}
    json.loads(path.read_text().splitlines()[0], parse_constant=lambda c: pytest.fail(f"{c} in the shard"))
    with pytest.raises(DumpError, match=re.escape(f"{path}:1: field 'versions'") + ".*older than"):
        read_shard(path, step=3, vocab_size=8, trainer_version=3, max_staleness=0)
    with pytest.raises(DumpError, match=re.escape(f"{path}:1: field 'step'")):
        read_shard(path, step=4, vocab_size=8, trainer_version=3, max_staleness=1)
    next(folder.glob("images/*.pt")).write_bytes(b"")
    with pytest.raises(DumpError, match=re.escape(f"{path}:1: field 'images'")) as err:
        read_shard(path, step=3, vocab_size=8, trainer_version=3, max_staleness=1)
    assert "\n" not in str(err.value)  # the exception's first line, not PyTorch's weights_only paragraph


@pytest.mark.parametrize(
    "routing, message",
    [
        ([[[0, 1]]] * 6, r"shape \(6, 1, 2\) does not fit \[<= 5 tokens, 1 MoE layers, top-k 2\]"),
        ([[[0, 1], [0, 1]]] * 5, r"shape \(5, 2, 2\) does not fit"),
        ([[[0, 1, 2]]] * 5, r"shape \(5, 1, 3\) does not fit"),
        ([[[0, 4]]] * 5, r"expert id 4 outside -1..3"),
        ([[[0, -5]]] * 5, r"expert id -5 outside -1..3"),
        ([[[0, 1]], [[2, 2]]], r"position 1 MoE layer 0 repeats an expert: \[2, 2\]"),
        ([[[0, 1]], [[-1, 2]]], r"position 1 MoE layer 0 mixes -1 with expert ids"),
        ([[0, 1]], r"must be a \[positions, layers, k\] list of ints"),
    ],
)
def test_dumped_routing_must_fit_the_model(tmp_path, routing, message):
    traj = Trajectory(reward=1.0)
    traj.extend_prompt([1, 2, 3])
    traj.extend_action([4, 5], [-0.5, -0.5], [0, 0])
    traj.routing = torch.tensor([[[0, 1]]] * 5)
    path = write_shard(tmp_path, 1, 0, [traj])
    record = json.loads(path.read_text()) | {"routing": routing}
    path.write_text(json.dumps(record) + "\n")
    with pytest.raises(DumpError, match=re.escape(f"{path}:1: field 'routing': ") + message):
        read_shard(path, step=1, vocab_size=8, trainer_version=0, max_staleness=0, moe=(1, 2, 4))


def test_a_dump_line_with_a_non_finite_reward_or_routing_for_a_dense_policy_is_refused(tmp_path):
    traj = Trajectory(reward=1.0, score=1.0)
    traj.extend_prompt([1, 2, 3])
    traj.extend_action([4, 5], [-0.5, -0.5], [0, 0])
    traj.routing = torch.tensor([[[0, 1]]] * 5)
    path = write_shard(tmp_path, 1, 0, [traj])
    good = json.loads(path.read_text())
    for change, field in [({"reward": float("nan")}, "reward"), ({"score": 1e400}, "score"), ({}, "routing")]:
        path.write_text(json.dumps(good | change) + "\n")  # NaN / Infinity: what json writes for them
        with pytest.raises(DumpError, match=re.escape(f"{path}:1: field '{field}': ")):
            read_shard(path, step=1, vocab_size=8, trainer_version=0, max_staleness=0, moe=())


def test_dumped_images_must_start_at_the_policys_placeholders(tmp_path):
    """Checked with the line before the step trains (it was the trainer's internal error, after earlier steps)."""
    vlm = preset("tiny-vlm", vocab_size=16)
    vlm.image_token_id = 6
    per = vlm.vision.tokens_per_image
    pixels = torch.zeros(3, vlm.vision.image_size, vlm.vision.image_size, dtype=torch.uint8)
    traj = Trajectory(reward=1.0)
    traj.extend_prompt([1, *[6] * per, 2])
    traj.extend_action([4, 5], [-0.5, -0.5], [0, 0])
    traj.images = [{"start": 1, "pixels": pixels, "hash": pixel_hash(pixels)}]
    path = write_shard(tmp_path, 1, 0, [traj])
    args = dict(step=1, vocab_size=16, trainer_version=0, max_staleness=0)
    assert len(read_shard(path, **args, model_cfg=vlm)[0].images) == 1
    record = json.loads(path.read_text())
    record["images"][0]["start"] = 2
    path.write_text(json.dumps(record) + "\n")
    with pytest.raises(DumpError, match=re.escape(f"{path}:1: field 'images': rollout 0: placeholders start at [1]")):
        read_shard(path, **args, model_cfg=vlm)
    with pytest.raises(DumpError, match="field 'images': trajectories carry images but the policy has no vision"):
        read_shard(path, **args, model_cfg=preset("tiny", vocab_size=16))
