"""The default recipe, shortened: the warm-started tiny model learns the calculator tool task with GRPO; PPO with a
critic and on-policy distillation measured against a shrunk GRPO run."""

import pytest

from molt.cli.main import parse_config
from molt.cli.train import run_train

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


# Lean comparisons on a shrunk default recipe (4 prompts x 4 samples a step, 32 x 2 eval episodes, lr 3e-4): GRPO is
# the reference; PPO with a critic gets 1.5x its steps; on-policy distillation learns from its final checkpoint. The
# runs are synchronous (max_staleness 0): each is then the same on a busy machine (async runs' mix of policy versions
# follows the load: measured PPO gains 0.30 and 0.22 in two runs of the same async comparison, 0.27 in both sync ones).
SHRUNK = ["--rollout.prompts_per_step", "4", "--rollout.n_samples_per_prompt", "4", "--train.lr", "3e-4",
          "--train.warmup_steps", "0", "--eval.num_prompts", "32", "--eval.n_samples", "2",
          "--rollout.max_staleness", "0"]  # fmt: skip
GRPO_STEPS = 8
EVAL_NOISE = 0.05  # ~3 of the 64 eval episodes: both runs share the warm start, eval rows and eval seeds


def _run(tmp_path, name: str, steps: int, *flags: str):
    cfg = parse_config([*SHRUNK, "--train.max_steps", str(steps), "--eval.every", str(steps),
                        "--log.run_dir", str(tmp_path / name), *flags])  # fmt: skip
    result = run_train(cfg)
    return result, result.eval_after["eval/reward_mean"] - result.eval_before["eval/reward_mean"]


@pytest.fixture(scope="module")
def grpo_reference(tmp_path_factory):
    """The shrunk default recipe (GRPO): its result, eval gain and final checkpoint."""
    tmp_path = tmp_path_factory.mktemp("grpo")
    result, gain = _run(tmp_path, "grpo", GRPO_STEPS)
    return result, gain, tmp_path / "grpo" / "checkpoints" / f"step-{GRPO_STEPS}"


def test_ppo_with_a_critic_reaches_the_grpo_gain_within_one_and_a_half_times_the_steps(tmp_path, grpo_reference):
    _, grpo_gain, _ = grpo_reference
    assert grpo_gain >= 0.15, grpo_gain  # the reference learned: the comparison means something
    same_data = ("--rollout.filters", "nonfinite", "all-equal")  # as GRPO's (gae's own default keeps all-equal groups)
    result, gain = _run(tmp_path, "gae", GRPO_STEPS * 3 // 2, "--algo.estimator", "gae", *same_data)
    assert gain >= grpo_gain - EVAL_NOISE, (gain, grpo_gain)
    losses = [m["critic/value_loss"] for m in result.history]
    assert min(losses[-3:]) < losses[0], losses  # the critic learns too


def test_distillation_from_a_trained_checkpoint_closes_most_of_the_gap(tmp_path, grpo_reference):
    """Student: a fresh warm start; teacher: the GRPO run's last checkpoint. Reverse KL to the teacher alone (no
    task reward) moves the student's eval halfway to the teacher's (within eval noise), in fewer steps than the
    teacher took. Measured: gains 0.19 and 0.25 over gaps of 0.30 and 0.25; one run in seven fell under half the gap.
    The KL to the teacher falls (last step below the first failed one run in eleven: the halves are compared)."""
    teacher_result, _, teacher = grpo_reference
    flags = ("--algo.estimator", "on_policy_distill", "--algo.teacher", str(teacher), "--rollout.filters", "nonfinite")
    result, gain = _run(tmp_path, "distill", 6, *flags)
    gap = teacher_result.eval_after["eval/reward_mean"] - result.eval_before["eval/reward_mean"]
    assert gap >= 0.15 and gain >= 0.5 * gap - EVAL_NOISE, (gain, gap)
    kl = [m["train/distill_kl"] for m in result.history]  # per step, noisy (k1 estimates, even < 0): halves compared
    assert sum(kl[3:]) < sum(kl[:3]), kl  # measured 0.45 / 0.45 / 0.47 -> 0.11 / 0.19 / 0.11
