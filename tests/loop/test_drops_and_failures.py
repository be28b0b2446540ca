"""Issue 23, the loop's side: a failed rollout costs its own sample (one line, traceback in the run dir),
filters decide on the trained reward, and every dropped group is counted and explained.

The loop runs with a stub agent runner (no engine, no model): these are the loop's own decisions.
"""

from __future__ import annotations

import asyncio
import logging
import math
from types import SimpleNamespace

import numpy as np
import pytest

from molt.cli.main import parse_config
from molt.data.trajectory import Trajectory
from molt.loop.accounting import AgentFailureRateError, RunStoppedError
from molt.loop.rl import FAILURE_LOG, RLLoop


class StubLoop(RLLoop):
    """Sample k of every group fails when k is in `failing`; the others return `reward(k)` and `score(k)`."""

    failing: tuple[int, ...] = ()

    def __init__(self, cfg, reward=lambda k: k / 4, score=lambda k: None):
        tokenizer = SimpleNamespace(eos_token_id=0)
        engine = SimpleNamespace(version=0)
        super().__init__(cfg, engine=engine, trainer=None, tokenizer=tokenizer, make_env=object,
                         train_rows=[{"messages": []}], eval_rows=[])  # fmt: skip
        self.reward, self.score = reward, score

    async def _rollout(self, row, sampling, limits, **ids):
        k = ids["rollout_id"] % self.group_size
        if k in self.failing:
            raise ValueError(f"tool backend hiccup on sample {k}")
        ids = {"group_id": ids["group_id"], "rollout_id": ids["rollout_id"]}
        info = {"turns": np.int64(k), "solved": k == 3, "note": "text", "nan": math.nan, "huge": 10**400}
        return [Trajectory(reward=self.reward(k), score=self.score(k), info=info, **ids)]


def _config(tmp_path, *flags):
    return parse_config(["--rollout.n_samples_per_prompt", "4", "--log.run_dir", str(tmp_path / "run"), *flags])


def test_a_failed_rollout_drops_only_its_sample_with_one_line(tmp_path, caplog):
    loop = StubLoop(_config(tmp_path))
    loop.failing = (1,)
    with caplog.at_level(logging.WARNING, logger="molt.loop"):
        asyncio.run(loop._group(0))
    group = loop.buffer.get_nowait()
    assert sorted(t.rollout_id for t in group) == [0, 2, 3]  # the group trains on its other samples
    assert loop.state.drops["agent_failure"] == 1 and not loop.group_drops
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith("rollout 1 (group 0) failed: ValueError: tool backend hiccup on sample 1 [")
    assert "its group trains without it unless fewer than 2 of its rollouts succeed" in line and "\n" not in line
    log = (tmp_path / "run" / FAILURE_LOG).read_text()
    assert "Traceback" in log and "test_drops_and_failures.py" in log

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="molt.loop"):
        asyncio.run(loop._group(1))  # the same kind of failure again: one line, no second traceback
    assert len(caplog.records) == 1 and "traceback in" not in caplog.records[0].getMessage()
    assert (tmp_path / "run" / FAILURE_LOG).read_text().count("Traceback") == 1


def test_an_estimator_that_needs_complete_groups_drops_the_group_and_says_so(tmp_path, caplog):
    loop = StubLoop(_config(tmp_path))
    loop.failing, loop.complete_groups = (2,), True
    with caplog.at_level(logging.WARNING, logger="molt.loop"):
        asyncio.run(loop._group(0))
    assert loop.buffer.empty() and loop.state.drops["agent_failure"] == 4
    assert "its group is dropped: the estimator needs complete groups" in caplog.records[0].getMessage()
    assert loop.drop_line().startswith("1 group dropped: 1 agent_failure (failed rollouts")


def test_filters_decide_on_the_partial_credit_reward_not_the_score(tmp_path):
    partial = {"reward": lambda k: [0.2, 0.5, 0.5, 0.9][k], "score": lambda k: 0.0}  # nobody fully solved it
    loop = StubLoop(_config(tmp_path), **partial)
    asyncio.run(loop._group(0))
    assert loop.buffer.qsize() == 1 and not loop.group_drops  # the rewards differ: a learning signal

    loop = StubLoop(_config(tmp_path, "--rollout.filter_on", "score"), **partial)
    asyncio.run(loop._group(0))
    assert loop.buffer.empty() and loop.state.drops["filter_all_equal"] == 4
    line = loop.drop_line()
    assert (
        line == "1 group dropped: 1 filter_all_equal (every sample got the same score: no signal for a group baseline)"
    )
    assert loop.drop_line() == ""  # counted once, then reset for the next progress line
    assert loop.step_dropped_groups == 1  # the step's `rollout/dropped_groups` keeps it whenever lines are printed
    # the step's `rollout/reward_mean` is the policy's reward: every rollout, the filtered group's too
    # with the mean of each finite number or bool of its agent's Result.info
    info = {"rollout/info/turns": 1.5, "rollout/info/solved": 0.25}
    assert loop._reward_metrics() == {"rollout/reward_mean": (0.2 + 0.5 + 0.5 + 0.9) / 4} | info
    assert loop._reward_metrics() == {}  # none sampled since


def test_default_filters_keep_all_equal_groups_for_estimators_without_a_group_baseline(tmp_path):
    """reinforce compares a rollout with nothing in its group: equal rewards still teach it. Asked for, all-equal
    still filters; `score-range` keeps a group whose mean is strictly inside rollout.score_range."""
    for flags, kept in [((), False), (("--algo.estimator", "reinforce"), True),
                        (("--algo.estimator", "reinforce", "--rollout.filters", "all-equal"), False),
                        (("--algo.estimator", "reinforce", "--rollout.filters", "nonfinite", "all-equal"), False),
                        (("--rollout.filters", "score-range"), False),  # mean 1: not inside (0, 1)
                        (("--rollout.filters", "score-range", "--rollout.score_range", "0", "2"), True)]:  # fmt: skip
        loop = StubLoop(_config(tmp_path, *flags), reward=lambda k: 1.0)
        asyncio.run(loop._group(0))
        assert loop.buffer.qsize() == kept, flags


def test_truncated_sampling_records_the_log_probs_it_sampled_from(tmp_path):
    assert StubLoop(_config(tmp_path)).sampling.logprob_mode == "scaled"
    for flags in (("--rollout.top_p", "0.9"), ("--rollout.top_k", "5")):
        assert StubLoop(_config(tmp_path, *flags)).sampling.logprob_mode == "processed"


def test_a_step_skipped_for_a_non_finite_gradient_is_a_warning_naming_it(tmp_path, caplog):
    loop = StubLoop(_config(tmp_path, "--train.max_steps", "1", "--eval.every", "0"))
    loop.trainer = SimpleNamespace(step=lambda batch: {"train/grad_norm": math.nan, "train/skipped_steps": 1})
    loop.trainer.version, loop.engine.stats, loop.run_t0, loop.sync_s = 1, {}, 0.0, 0.0

    async def nothing(*args):
        return None

    loop._next_batch, loop.sync = nothing, nothing
    loop._compute = lambda fn, *args: asyncio.to_thread(fn, *args)
    with caplog.at_level(logging.WARNING, logger="molt.loop"):
        asyncio.run(loop.train(lambda m: None))
    (line,) = [r.getMessage() for r in caplog.records]
    assert line == "step 1 skipped: the gradient norm is nan, so the optimizer did not step (1 skipped so far)"


def test_a_group_cancelled_when_the_loop_stops_is_restarted_by_the_checkpoint(tmp_path):
    """A group still sampling when the run ends (e.g. one started in place of a filtered group) is cancelled; the
    checkpoint written after that lists it to run again on resume, rather than skipping its prompt."""

    class Hanging(StubLoop):
        async def _rollout(self, row, sampling, limits, **ids):
            await asyncio.Event().wait()  # never done: still sampling when the loop stops

    async def run():
        loop = Hanging(_config(tmp_path))
        loop.running.add(5)  # as `rollout` starts it
        task = asyncio.create_task(loop._group(5))
        await asyncio.sleep(0.01)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return loop.snapshot()

    assert asyncio.run(run()).restart_groups == [5]


def test_the_episodes_of_a_group_restarted_on_resume_are_not_counted_twice(tmp_path):
    """Two episodes of group 5 finished (one failed) before the stop: they run again on resume, so the checkpoint's
    counters leave them out; every sample stays trained or dropped once."""

    class HalfDone(StubLoop):
        failing = (1,)

        async def _rollout(self, row, sampling, limits, **ids):
            if ids["rollout_id"] % self.group_size >= 2:
                await asyncio.Event().wait()
            return await super()._rollout(row, sampling, limits, **ids)

    async def run():
        loop = HalfDone(_config(tmp_path))
        loop.state.rollouts, loop.state.failures = 10, 1  # earlier groups'
        loop.running.add(5)
        task = asyncio.create_task(loop._group(5))
        await asyncio.sleep(0.05)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return loop.state, loop.snapshot()

    live, saved = asyncio.run(run())
    assert (live.rollouts, live.failures) == (12, 2) and (saved.rollouts, saved.failures, saved.restart_groups) == (
        10, 1, [5])  # fmt: skip


def test_a_run_stopped_by_drops_names_every_reason_most_frequent_first():
    """Groups dropped for several reasons in a row (half over the context, half all-equal): the stop names both with
    their counts and advice, not only the last one's."""
    loop = StubLoop(parse_config(["--rollout.prompts_per_step", "2"]))
    with pytest.raises(RunStoppedError) as err:
        for i in range(101):
            loop._check_progress("filter_all_equal" if i % 3 else "prompt_over_context")
    message = str(err.value)
    assert message.startswith("101 groups in a row were dropped: 67 filter_all_equal: every sample of a prompt")
    assert "; 34 prompt_over_context: the prompts do not fit rollout.max_len" in message


def test_early_failures_stop_the_run_when_the_twentieth_rollout_succeeds(tmp_path):
    """7 failures among the first 8 rollouts, then successes: 7 of 20 (35%) is over max_failure_frac 0.2 when the
    20th rollout arrives, though it succeeded (the rate was checked only on a failure: such a run ended at 25%)."""
    loop = StubLoop(_config(tmp_path))
    loop.failing = (0, 1, 2, 3)
    asyncio.run(loop._group(0))  # 4 failed
    loop.failing = (0, 1, 2)
    asyncio.run(loop._group(1))  # 7 of 8 failed: under 20 rollouts, no stop yet
    loop.failing = ()
    for group in (2, 3):
        asyncio.run(loop._group(group))
    assert loop.fatal is None and loop.state.rollouts == 16
    asyncio.run(loop._group(4))  # rollouts 17-20 succeed
    assert isinstance(loop.fatal, AgentFailureRateError)
    assert str(loop.fatal).startswith("7 of 20 rollouts failed (rollout.max_failure_frac=0.2); last error: ValueError")


def test_a_group_baseline_needs_two_surviving_rollouts(tmp_path):
    """RLOO gives a lone rollout its raw reward (no baseline): a group that failures leave with one rollout is dropped
    under a group-baseline estimator, kept under one without (reinforce)."""
    for estimator, kept in (("rloo", False), ("grpo", False), ("reinforce", True)):
        loop = StubLoop(_config(tmp_path, "--algo.estimator", estimator, "--rollout.filters", "nonfinite"))
        loop.failing = (0, 1, 2)
        asyncio.run(loop._group(0))
        assert loop.buffer.empty() is not kept, estimator
        assert loop.state.drops["agent_failure"] == (3 if kept else 4), estimator
