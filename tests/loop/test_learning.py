"""The default recipe, shortened: the warm-started tiny model learns the calculator tool task with GRPO."""

import pytest

from molt.cli.main import parse_config
from molt.loop.run import run_train

pytestmark = pytest.mark.slow


def test_default_recipe_improves_held_out_reward(tmp_path):
    cfg = parse_config(["--train.max_steps", "20", "--eval.every", "20", "--eval.num_prompts", "60",
                        "--log.run_dir", str(tmp_path / "run")])  # fmt: skip
    result = run_train(cfg)
    before, after = result.eval_before["eval/reward_mean"], result.eval_after["eval/reward_mean"]
    assert after >= before + 0.15, (before, after)
    assert all(m["train/staleness_max"] <= cfg.rollout.max_staleness for m in result.history)
    assert (tmp_path / "run" / "curves.png").exists() and (tmp_path / "run" / "tb").is_dir()
    assert (tmp_path / "run" / "checkpoints" / "step-20" / "model.safetensors").exists()
