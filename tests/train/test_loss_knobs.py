"""Loss and reward knobs in the trainer: adaptive KL (logged, checkpointed), reward clipping, overlong penalty."""

import copy

import pytest
from test_trainer import _cfg, _model, _trajs  # noqa: I001 - tests/train/test_trainer.py

import molt
from molt.algo import adaptive_kl_coef
from molt.config import ConfigError
from molt.config.rl import check_rollout_algo
from molt.loop.checkpoint import load_training_state, save_checkpoint
from molt.loop.rl import LoopState
from molt.models import from_pretrained, save_pretrained
from molt.train.optim import lr_factor
from molt.train.trainer import Trainer

ADAPTIVE = ("--algo.kl_coef", "0.5", "--algo.kl_target", "1e-4", "--algo.kl_horizon", "24", "--train.lr", "1e-2")
ADAPTIVE += ("--rollout.prompts_per_step", "3", "--rollout.n_samples_per_prompt", "4")  # the 12 samples of _trajs


def test_adaptive_kl_coefficient_follows_the_measured_kl_each_step_and_resumes():
    model = _model()
    trajs = _trajs(model)  # 12 samples
    trainer = Trainer(model, _cfg(*ADAPTIVE))
    steps = [trainer.step(trajs) for _ in range(3)]
    assert steps[0]["train/kl_coef"] == 0.5
    for before, after in zip(steps, steps[1:], strict=False):
        expect = adaptive_kl_coef(before["train/kl_coef"], before["train/kl"], 1e-4, len(trajs), 24)
        assert after["train/kl_coef"] == pytest.approx(expect)
    assert steps[2]["train/kl_coef"] > steps[1]["train/kl_coef"]  # the KL is above target once the policy moved
    resumed = Trainer(copy.deepcopy(model), _cfg(*ADAPTIVE))
    resumed.load_extra_state(trainer.extra_state())
    assert resumed.step(trajs)["train/kl_coef"] == trainer.step(trajs)["train/kl_coef"] != 0.5
    assert "train/kl_coef" in Trainer(_model(), _cfg("--algo.kl_coef", "0.1")).step(trajs)  # fixed: logged too


def test_advantages_see_the_clipped_and_overlong_penalised_reward():
    """GRPO on shaped rewards equals GRPO on rewards shaped by hand: penalty on each rollout's generated tokens
    (max_len 32, buffer 30: -(n - 2) / 30 * 0.5 for n generated tokens), then clipping to +-0.4."""
    model = _model()
    trajs = _trajs(model)
    flags = ("--algo.overlong_buffer", "30", "--algo.overlong_max_len", "32", "--algo.overlong_coef", "0.5")
    flags += ("--algo.reward_clip", "0.4")
    shaped = Trainer(copy.deepcopy(model), _cfg(*flags))
    by_hand = copy.deepcopy(trajs)
    for traj in by_hand:
        penalty = -0.5 * min(max(traj.num_action_tokens - 2, 0) / 30, 1.0)
        traj.reward = min(max(traj.reward + penalty, -0.4), 0.4)
    rewards, metrics = shaped.rewards(trajs)
    assert rewards.tolist() == pytest.approx([t.reward for t in by_hand])
    assert {"overlong_penalty_mean", "reward_clip_frac"} <= set(metrics)
    advantages, _ = shaped.advantages(trajs)
    expect, _ = Trainer(copy.deepcopy(model), _cfg()).advantages(by_hand)
    assert [a for row in advantages for a in row] == pytest.approx([a for row in expect for a in row], abs=1e-6)
    assert "train/reward_clip_frac" in shaped.step(trajs)
    with pytest.raises(ConfigError, match="algo.overlong_max_len: set it with algo.overlong_buffer when rollout"):
        molt.make_config({"algo.overlong_buffer": 30})  # 4 turns: one turn's max_tokens is no budget for them all
    assert _cfg("--algo.overlong_buffer", "30", "--rollout.max_turns", "1").overlong_budget() == 32


def test_a_resume_trains_with_the_optimizer_and_kl_settings_it_is_given(tmp_path):
    """Saved with one config, resumed with a new lr, max_steps, AdamW settings, critic lr and (fixed) KL coefficient:
    the resumed step uses the new ones, its lr from the new schedule at the resumed step."""
    model, trajs = _model(), _trajs(_model())
    trainer = Trainer(model, _cfg("--algo.estimator", "gae", "--algo.kl_coef", "0.5", "--train.max_steps", "4"))
    trainer.step(trajs), trainer.step(trajs)
    folder = save_checkpoint(tmp_path, trainer, LoopState(step=2, drops={}), None)
    new = ("--train.lr", "3e-3", "--train.max_steps", "8", "--train.weight_decay", "0.1", "--train.betas", "0.5",
           "0.9", "--critic.lr", "1e-3", "--algo.kl_coef", "0.2")  # fmt: skip
    resumed = Trainer(from_pretrained(folder), _cfg("--algo.estimator", "gae", *new))
    load_training_state(folder, resumed)
    metrics = resumed.step(trajs)
    assert metrics["train/lr"] == pytest.approx(3e-3 * lr_factor(2, 0, 8, 0.1))
    assert metrics["critic/lr"] == pytest.approx(1e-3 * lr_factor(2, 0, 8, 0.1))
    assert metrics["train/kl_coef"] == 0.2
    decay, no_decay = resumed.opt.param_groups
    assert (decay["weight_decay"], no_decay["weight_decay"], decay["betas"]) == (0.1, 0.0, (0.5, 0.9))


def test_reward_metrics_count_each_rollout_once_and_keep_the_shaped_mean():
    model = _model()
    trajs = _trajs(model, num_groups=1, n=2)
    trajs[0].reward, trajs[1].reward = 1.0, 0.0
    second = copy.deepcopy(trajs[0])  # rollout 0 again, as a second segment
    metrics = Trainer(model, _cfg("--algo.reward_clip", "0.5")).step([*trajs, second])
    assert metrics["train/reward_mean"] == 0.5  # (1 + 0) / 2 rollouts, not (1 + 0 + 1) / 3 segments
    assert metrics["train/shaped_reward_mean"] == 0.25  # the estimator's: rewards clipped to 0.5, 0


@pytest.mark.parametrize(
    "flags",
    [
        ("--algo.entropy_coef", "nan"),
        ("--algo.kl_coef", "inf"),
        ("--algo.overlong_buffer", "5", "--algo.overlong_coef", "inf"),
        ("--algo.estimator", "gae", "--critic.lr", "inf"),
        ("--algo.kl_coef", "0.1", "--algo.kl_target", "inf"),
        ("--train.betas", "0.9", "nan"),
    ],
)
def test_non_finite_settings_are_config_errors_naming_the_key(flags, capsys):
    key = next(f for f in flags[::-1] if f.startswith("--"))[2:]
    assert f"config error: {key}: must be a finite number" in _refused(capsys, *flags)


def _refused(capsys, *flags: str) -> str:
    """The one-line config error of `molt train` with `flags`."""
    with pytest.raises(SystemExit):
        _cfg(*flags)
    return capsys.readouterr().err


def test_settings_that_cannot_act_as_asked_are_refused_saying_what_to_do(tmp_path, capsys):
    assert "algo.entropy_coef: must be >= 0" in _refused(capsys, "--algo.entropy_coef", "-0.1")
    err = _refused(capsys, "--algo.kl_coef", "0.1", "--algo.kl_estimator", "k1")
    assert (
        "algo.kl_estimator: k1 cannot be the KL loss: its expected gradient is 0" in err
        and "use k2 (its expected gradient is KL(policy || ref)'s) or k3" in err
    )
    err = _refused(capsys, "--algo.is_level", "geo")
    assert "algo.is_mode: --algo.is_level geo takes only mode mask" in err and "add --algo.is_mode mask" in err
    assert _cfg("--algo.is_high", "inf").algo.is_high == float("inf")  # no upper bound: deliberate
    for key, value in (("top_p", "0.9"), ("top_k", "5")):  # `molt train` checks it first (eval samples freely)
        cfg = _cfg(f"--rollout.{key}", value, "--algo.is_level", "none")
        with pytest.raises(ConfigError, match=f"rollout.{key}: samples from a truncated .* enable the IS correction"):
            check_rollout_algo(cfg.rollout, cfg.algo)
    teacher = str(save_pretrained(_model(seed=1), tmp_path / "teacher"))
    distill = ("--algo.estimator", "on_policy_distill", "--algo.teacher", teacher)
    check_rollout_algo(_cfg(*distill).rollout, _cfg(*distill).algo)  # `auto` filters: nonfinite only there
    for filters in (("all-equal",), ("nonfinite", "score-range"), ("nonfinite", "all-equal")):
        cfg = _cfg(*distill, "--rollout.filters", *filters)
        with pytest.raises(ConfigError, match="rollout.filters: .* never uses: it would drop groups that carry signal"):
            check_rollout_algo(cfg.rollout, cfg.algo)
    one = ("--rollout.n_samples_per_prompt", "1")  # a group of one: no baseline to compare with
    for estimator, filters, refusal in (("grpo", "nonfinite", "advantage 0"), ("dr_grpo", "nonfinite", "advantage 0"),
                                        ("rloo", "auto", "all-equal filter of rollout.filters drops"),
                                        ("rloo", "nonfinite", None), ("reinforce", "auto", None)):  # fmt: skip
        cfg = _cfg(*one, "--algo.estimator", estimator, "--rollout.filters", filters)
        if refusal is None:
            check_rollout_algo(cfg.rollout, cfg.algo)
            continue
        with pytest.raises(ConfigError, match=f"rollout.n_samples_per_prompt: 1 .*{refusal}"):
            check_rollout_algo(cfg.rollout, cfg.algo)


def test_a_resumed_float16_run_keeps_its_loss_scales(tmp_path):
    """float16 mixed precision: the policy's and the critic's dynamic loss scales are checkpointed, so a resumed run
    does not restart from the initial scale (and skip steps finding it again)."""
    flags = ("--model.dtype", "float16", "--algo.estimator", "gae")
    trainer = Trainer(_model(), _cfg(*flags))
    trainer.step(_trajs(trainer.model))  # both scalers in use
    for scaler, scale in ((trainer.scaler, 1024.0), (trainer.critic.scaler, 32.0)):
        scaler.update(new_scale=scale)  # as if it had found infs
    folder = save_checkpoint(tmp_path, trainer, LoopState(step=1, drops={}), None)
    resumed = Trainer(from_pretrained(folder), _cfg(*flags))
    assert resumed.scaler.get_scale() != 1024.0
    load_training_state(folder, resumed)
    assert (resumed.scaler.get_scale(), resumed.critic.scaler.get_scale()) == (1024.0, 32.0)
