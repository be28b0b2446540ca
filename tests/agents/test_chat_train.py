"""`molt train --rollout.agent examples/...` with ChatAgents: every example runs; the tool agent learns."""

from pathlib import Path

import pytest

from molt.cli.main import parse_config
from molt.cli.train import run_train

EXAMPLES = Path(__file__).parents[2] / "examples"
FAST = [
    "--model.warmstart_steps", "0", "--rollout.prompts_per_step", "2", "--rollout.n_samples_per_prompt", "2",
    "--rollout.max_tokens", "6", "--rollout.max_turns", "2", "--rollout.filters", "nonfinite",
    "--eval.every", "2", "--eval.num_prompts", "2", "--eval.n_samples", "1", "--train.warmup_steps", "0",
    "--data.num_train", "16", "--data.num_eval", "4", "--log.every", "100", "--train.max_steps", "2",
]  # fmt: skip


@pytest.mark.parametrize(
    "example, task",
    [("openai_agent.py", "arithmetic"), ("anthropic_agent.py", "arithmetic"), ("tool_agent.py", "calculator")],
)
def test_examples_train_end_to_end(tmp_path, example, task):
    flags = [*FAST, "--data.task", task, "--rollout.agent", str(EXAMPLES / example), "--log.run_dir", str(tmp_path)]
    cfg = parse_config(flags + (["--chat.no_render_tools"] if example == "tool_agent.py" else []))
    result = run_train(cfg)
    assert [m["step"] for m in result.history] == [1, 2]
    last = result.history[-1]
    assert last["rollout/failures"] == 0 and last["eval/failures"] == 0 and last["train/num_samples"] >= 4
    assert last["train/staleness_max"] <= cfg.rollout.max_staleness


@pytest.mark.slow
def test_tool_chat_agent_improves_held_out_reward(tmp_path):
    """The SDK tool-calling loop trains the warm-started policy like the built-in calculator Env does."""
    cfg = parse_config([
        "--rollout.agent", str(EXAMPLES / "tool_agent.py"), "--chat.no_render_tools",
        "--train.max_steps", "10", "--rollout.prompts_per_step", "4", "--train.warmup_steps", "2",
        "--eval.every", "10", "--eval.num_prompts", "32", "--log.run_dir", str(tmp_path / "run"),
    ])  # fmt: skip
    result = run_train(cfg)
    before, after = result.eval_before["eval/reward_mean"], result.eval_after["eval/reward_mean"]
    assert after >= before + 0.1, (before, after)
    assert all(m["rollout/failures"] == 0 for m in result.history)


def test_a_chat_agent_trains_from_agent_workers(tmp_path):
    """`--rollout.agent_workers 2`: the openai example runs in two worker processes against the run's engine; its
    rollouts train, eval runs there too, and the reward function's metrics reach the step logs."""
    flags = [*FAST, "--data.task", "arithmetic", "--rollout.agent", str(EXAMPLES / "openai_agent.py"),
             "--rollout.agent_workers", "2", "--rollout.reward", "exact", "--log.run_dir", str(tmp_path)]  # fmt: skip
    result = run_train(parse_config(flags))
    last = result.history[-1]
    assert [m["step"] for m in result.history] == [1, 2]
    assert last["rollout/failures"] == 0 and last["eval/failures"] == 0 and last["train/num_samples"] >= 4
    assert "eval/reward/exact" in last and any("reward/exact" in m for m in result.history)
