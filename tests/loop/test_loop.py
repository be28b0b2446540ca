"""The RL loop end to end with the built-in engine: staleness bound, on-policy exactness, resume."""

import asyncio
import json

import pytest
from conftest import TINY_RUN  # noqa: I001 - tests/conftest.py

from molt.cli.main import parse_config
from molt.cli.train import run_train
from molt.data.trajectory import Trajectory
from molt.engine.interface import SamplingParams
from molt.loop.evaluate import evaluate, pass_at_k

FAST = [*TINY_RUN, "--rollout.max_turns", "2", "--data.num_train", "64", "--data.num_eval", "8"]


def _run(tmp_path, name, *flags):
    cfg = parse_config([*FAST, "--log.run_dir", str(tmp_path / name), *flags])
    return run_train(cfg)


@pytest.mark.parametrize("mode", ["drain", "interrupt"])
@pytest.mark.parametrize("staleness", [0, 1, 2])
def test_no_trained_token_is_older_than_max_staleness(tmp_path, staleness, mode):
    result = _run(tmp_path, "run", "--train.max_steps", "5", "--rollout.max_staleness", str(staleness),
                  "--rollout.sync_mode", mode, "--train.lr", "1e-3")  # fmt: skip
    steps = [m for m in result.history if "train/staleness_max" in m]
    assert len(steps) == 5
    assert all(m["train/staleness_max"] <= staleness for m in steps)
    if staleness == 0:
        assert all(m["train/logprob_diff"] <= 1e-5 for m in steps)  # strictly on-policy: same function
    else:  # the async path was really exercised: some trained tokens came from older weights
        assert max(m["train/staleness_max"] for m in steps) >= 1


def test_resume_reproduces_the_uninterrupted_run(tmp_path):
    """From the checkpoint a finished run writes, a resumed run trains the same groups and gets the same losses as
    the run that never stopped (on-policy, so the samples are the same). A partial-credit reward (the share of digits
    in the reply) gives the resumed steps gradients: the comparison has something to compare."""
    (tmp_path / "rows.jsonl").write_text("".join(f'{{"prompt": "{i}*7=", "answer": "{i * 7}"}}\n' for i in range(40)))
    share = "sum(c.isdigit() for c in completion) / max(len(completion), 1)"
    (tmp_path / "digits.py").write_text(f"def digits(completion, row):\n    return {share}\n")
    data = ["--data.path", str(tmp_path / "rows.jsonl"), "--rollout.reward", f"{tmp_path / 'digits.py'}:digits"]
    common = ["--rollout.max_staleness", "0", "--train.min_lr_ratio", "1.0", "--train.lr", "1e-3", *data]
    full = _run(tmp_path, "full", "--train.max_steps", "4", *common)
    assert all(m["train/grad_norm"] > 0 for m in full.history[2:])
    _run(tmp_path, "part", "--train.max_steps", "2", *common)
    shards = tmp_path / "part" / "rollouts"  # as an attempt killed after step 3 left them (with --rollout.dump)
    shards.mkdir()
    for step in (2, 3):
        (shards / f"step-{step:06d}.jsonl").write_text("{}\n")
    resumed = run_train(
        parse_config(
            [
                "--config",
                str(tmp_path / "part" / "config.yaml"),
                "--ckpt.resume",
                str(tmp_path / "part"),
                "--train.max_steps",
                "4",
            ]
        )
    )
    assert [m["step"] for m in resumed.history] == [3, 4]
    for key in ("train/loss", "train/grad_norm", "train/reward_mean"):  # the same groups (none started for a step
        expect = pytest.approx([m[key] for m in full.history[2:]], rel=1e-5, abs=1e-6)  # past the end), up to the
        assert [m[key] for m in resumed.history] == expect, key  # order groups finished in, which sums may follow
    lines = [json.loads(x) for x in (tmp_path / "part" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines if "train/loss" in m] == [1, 2, 3, 4]
    elapsed = [m["time/elapsed_s"] for m in lines if "train/loss" in m]
    assert elapsed == sorted(elapsed)  # the loop's wall clock goes on from the checkpoint's
    assert sorted(p.name for p in shards.iterdir()) == ["step-000002.jsonl"]  # the steps trained again: dropped


def test_a_checkpoint_keeps_the_rewards_no_step_has_logged_yet():
    """Rollouts of groups done (buffered, or dropped by a filter) since the last step count in the first resumed
    step's rollout/reward_mean and rollout/info, as they would have without the stop (a resumed step averaged 12
    rollouts instead of 20); those of groups in flight run again on resume, so they are left out."""
    from types import SimpleNamespace

    from molt.agents.builtin import env_for_task
    from molt.loop.rl import RLLoop
    from molt.models.tokenizer import build_builtin_tokenizer

    cfg, tokenizer = parse_config(["--eval.every", "0"]), build_builtin_tokenizer()

    def loop(state=None):
        return RLLoop(cfg, engine=None, trainer=None, tokenizer=tokenizer, train_rows=[], eval_rows=[], state=state,
                      make_env=lambda: env_for_task("calculator"))  # fmt: skip

    before = loop()
    before.step_rollouts = [SimpleNamespace(reward=1.0, info={"turns": 2, "note": "x"}, group_id=3),
                            SimpleNamespace(reward=0.0, info={}, group_id=4)]  # fmt: skip
    before.running = {4}  # in flight: it restarts on resume
    state = before.snapshot()
    assert state.unlogged == [[1.0, {"turns": 2.0}]]
    assert loop(state)._reward_metrics() == {"rollout/reward_mean": 1.0, "rollout/info/turns": 2.0}


def test_pass_at_k_unbiased_estimator():
    assert pass_at_k(4, 0, 1) == 0.0 and pass_at_k(4, 4, 4) == 1.0
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - 3 / 6)  # 1 - C(3,2)/C(4,2)
    assert pass_at_k(5, 2, 3) == pytest.approx(1 - 1 / 10)  # 1 - C(3,3)/C(5,3)


def test_run_outputs_metrics_tensorboard_and_plot(tmp_path):
    result = _run(tmp_path, "run", "--train.max_steps", "2")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "run" / "tb"))
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == [1, 2]
    assert [e.value for e in events.Scalars("train/loss")] == pytest.approx([m["train/loss"] for m in result.history])
    assert "rollout/reward_mean" in result.history[0]  # every rollout's reward, the filtered ones' too
    required = ["train/reward_mean", "train/staleness_mean", "train/staleness_max", "train/logprob_diff",
                "train/is_filter_frac", "rollout/tokens_per_s", "train/tokens_per_s", "time/step_s"]  # fmt: skip
    assert all(key in m for m in result.history for key in required)
    elapsed = [m["time/elapsed_s"] for m in result.history]  # the loop's wall clock, for throughput vs baselines
    assert elapsed == sorted(elapsed) and elapsed[-1] >= sum(m["time/step_s"] for m in result.history) * 0.99
    # engine model steps and trainer steps share the one compute thread: disjoint, both inside the loop's wall
    engine_s, train_s = ([m[k] for m in result.history] for k in ("time/engine_s", "time/train_s"))
    assert all(e >= 0 for e in engine_s) and sum(engine_s) > 0 and sum(engine_s) + sum(train_s) <= elapsed[-1]
    decode_s = [m["time/engine_decode_s"] for m in result.history]  # the part in steps that computed no prompt
    assert all(0 <= d <= e for d, e in zip(decode_s, engine_s, strict=True)) and 0 < sum(decode_s) < sum(engine_s)
    rows = [m["rollout/decode_batch_mean"] for m in result.history]  # 0: no decoding since the last step
    assert max(rows) >= 1 and all(r == 0 or r >= 1 for r in rows)
    assert (tmp_path / "run" / "curves.png").stat().st_size > 1000


def test_eval_failures_score_0_everywhere_and_are_logged_with_their_traceback(tmp_path):
    """A failed sample counts 0 in the named rewards as in reward_mean; cut-off completions are `truncated`."""

    async def rollout(row, sampling, limits, rollout_id, group_id):
        if row["fail"]:
            raise ValueError(f"bad row {group_id}")
        info = {"reward/exact": 1.0, "tool_calls": 2}  # a named reward, and the rest of the agent's Result.info
        return [Trajectory(reward=1.0, score=1.0, info=info, finish_reason="length")]

    results, log = [], tmp_path / "rollout_failures.log"
    rows = [{"fail": False}, {"fail": True}]
    metrics = asyncio.run(evaluate(None, rollout, rows=rows, sampling=SamplingParams(), limits=None, n=2, seed=0,
                                   results=results, failure_log=log))  # fmt: skip
    assert metrics["eval/failures"] == 2 and metrics["eval/reward_mean"] == metrics["eval/reward/exact"] == 0.5
    assert results[0]["samples"][0]["info"] == {"tool_calls": 2} and results[0]["samples"][0]["rewards"] == {"exact": 1}
    assert results[0]["samples"][0]["truncated"] and results[1]["samples"][0]["error"].startswith(
        "ValueError: bad row 1 ["
    )
    lines = log.read_text()
    assert "eval sample 1 of row 1 failed: ValueError: bad row 1" in lines and lines.count("Traceback") == 1


def test_each_pass_over_the_data_has_its_own_order():
    """RL epochs repeated the first pass's order (row group_index % n): the same batches in the same sequence. The
    first pass keeps the rows' order; each later one is its own seeded permutation, a function of the index."""
    from molt.loop.rl import row_index

    first, second, third = ([row_index(e * 20 + i, 20, seed=0) for i in range(20)] for e in range(3))
    assert first == list(range(20)) and sorted(second) == sorted(third) == first
    assert second != first and third != second
    assert [row_index(20 + i, 20, seed=0) for i in range(20)] == second  # the same again (resume)
    assert [row_index(20 + i, 20, seed=1) for i in range(20)] != second


def test_a_resume_on_changed_training_rows_is_refused():
    """Rows appended to the data file moved the whole shuffled order: the resumed cursor trained other prompts,
    held-out ones among them, silently. The checkpoint's loop state records the rows it walks."""
    from molt.agents.builtin import env_for_task
    from molt.config import ConfigError
    from molt.data.tasks import get_task
    from molt.loop.rl import RLLoop
    from molt.models.tokenizer import build_builtin_tokenizer

    cfg, tokenizer, rows = (
        parse_config(["--eval.every", "0"]),
        build_builtin_tokenizer(),
        get_task("arithmetic").rows(20, 0),
    )

    def loop(train_rows, state=None):
        return RLLoop(cfg, engine=None, trainer=None, tokenizer=tokenizer, train_rows=train_rows, eval_rows=[],
                      state=state, make_env=lambda: env_for_task("arithmetic"))  # fmt: skip

    state = loop(rows).snapshot()
    loop(rows, state)  # the same rows: resumes
    with pytest.raises(ConfigError, match="data.task: the training rows changed since the checkpoint \\(20 rows then"):
        loop([*rows, rows[0]], state)
    loop([], state)  # a replay reads no rows


def test_an_eval_steps_metrics_count_the_same_rollouts_and_named_rewards_add_up(tmp_path):
    """Rollouts finishing during a step's eval were in `reward/<name>` and `rollout/dropped_groups` at that step but
    in `rollout/reward_mean` and `drop/*` at the next; the named means divided by scored rollouts only."""
    from molt.data.tasks import get_task

    rows = [{"prompt": r["messages"][0]["content"], "answer": r["label"]} for r in get_task("arithmetic").rows(40, 0)]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "parts.py").write_text("def reward(c, row):\n    return {'long': len(c) > 3, 'nine': '9' in c}\n")
    result = _run(tmp_path, "run", "--train.max_steps", "3", "--data.path", str(tmp_path / "rows.jsonl"), "--rollout"
                  ".reward", str(tmp_path / "parts.py"), "--eval.every", "1", "--eval.num_prompts", "4")  # fmt: skip
    sampled = [m for m in result.history if "rollout/reward_mean" in m]  # a step no rollout finished before: none
    assert sampled and all(not any(k.startswith("rollout/info/reward/") for k in m) for m in sampled)
    for m in sampled:
        assert m["rollout/reward_mean"] == pytest.approx(sum(v for k, v in m.items() if k.startswith("reward/"))), m


def test_eval_seeds_share_no_samples_and_a_rounded_perfect_score_is_correct():
    seen = {}

    async def rollout(row, sampling, limits, rollout_id, group_id):
        seen.setdefault(sampling.seed, 0)
        seen[sampling.seed] += 1
        return [Trajectory(reward=1.0, score=0.6 + 0.3 + 0.1)]  # 0.9999999999999999

    for seed in (1, 2):
        metrics = asyncio.run(evaluate(None, rollout, rows=[{}] * 3, sampling=SamplingParams(), limits=None, n=4,
                                       seed=seed))  # fmt: skip
        assert metrics["eval/pass@1"] == 1.0
    assert len(seen) == 24 and set(seen.values()) == {1}  # seeds 1 and 2 drew 12 samples each, none shared
