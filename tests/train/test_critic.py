"""PPO critic (`--algo.estimator gae`): values in the log-prob layout, GAE from them, value loss, checkpoints."""

import copy

import pytest
import torch
from test_trainer import _cfg, _model, _trajs  # noqa: I001 - tests/train/test_trainer.py

from molt.config import AlgoConfig, Config, ConfigError, CriticConfig, RuntimeConfig
from molt.data.trajectory import Trajectory
from molt.loop.checkpoint import load_training_state, save_checkpoint
from molt.loop.rl import LoopState
from molt.models import from_pretrained, save_pretrained
from molt.train.critic import ValueModel
from molt.train.trainer import Trainer

GAE = ("--algo.estimator", "gae", "--critic.lr", "3e-3")


def test_values_follow_the_logprob_layout_with_and_without_shared_prefixes():
    """Position t of a sample holds V(prefix before token t), the same through packing and shared prompts."""
    model = _model()
    trajs = _trajs(model, n=3, same_prompt=True)
    value_model = ValueModel(copy.deepcopy(model))
    torch.nn.init.normal_(value_model.head.weight, std=0.1)
    per_cfg = {}
    for share in ("--train.share_prefix", "--train.no_share_prefix"):
        trainer = Trainer(copy.deepcopy(model), _cfg(share))
        values = [None] * len(trajs)
        for mb in trainer.micro_batches(trajs):
            with torch.no_grad():
                values_bt = mb.unpack(value_model(mb.packed))
            for b, i in enumerate(mb.samples):
                values[i] = values_bt[b, : len(trajs[i].tokens)] * torch.tensor(trajs[i].loss_mask)
        per_cfg[share] = values
    for traj, shared, plain in zip(trajs, *per_cfg.values(), strict=True):
        with torch.no_grad():
            hidden = value_model.body(torch.tensor([traj.tokens]), return_hidden=True)[0]
            expect = torch.cat([torch.zeros(1), value_model.head(hidden)[:-1, 0]]) * torch.tensor(traj.loss_mask)
        assert (shared - expect).abs().max() <= 1e-5 and (plain - expect).abs().max() <= 1e-5


def test_gae_advantages_from_critic_values_equal_a_hand_computation():
    """Two action tokens, an observation token between them: delta_t = r_t + gamma V_next - V_t."""
    trainer = Trainer(_model(), _cfg(*GAE, "--algo.gamma", "0.9", "--algo.lam", "0.8", "--algo.whiten", "False"))
    traj = Trajectory(group_id=0, rollout_id=0, reward=1.0)
    traj.extend_prompt([1, 2])
    traj.extend_action([3], [0.0], [0])
    traj.extend_prompt([4])
    traj.extend_action([5], [0.0], [0])
    values = [[0.0, 0.0, 0.5, 0.0, 0.2]]
    (adv,), _ = trainer.advantages([traj], values)
    delta_last = 1.0 - 0.2  # terminal: V after the last action is 0
    delta_first = 0.0 + 0.9 * 0.2 - 0.5
    assert adv[4] == pytest.approx(delta_last, abs=1e-6)
    assert adv[2] == pytest.approx(delta_first + 0.9 * 0.8 * delta_last, abs=1e-6)
    assert adv[0] == adv[1] == adv[3] == 0.0


def test_critic_trains_in_the_step_and_its_value_loss_falls_on_a_fixed_batch():
    model = _model()
    trajs = _trajs(model)
    trainer = Trainer(model, _cfg(*GAE, "--train.lr", "1e-6"))
    start = copy.deepcopy(trainer.critic.model.state_dict())
    history = [trainer.step(trajs) for _ in range(6)]
    losses = [m["critic/value_loss"] for m in history]
    assert losses[-1] < 0.5 * losses[0]
    assert history[-1]["critic/explained_variance"] > history[0]["critic/explained_variance"]
    assert {"time/critic_s", "critic/value_mean", "critic/clip_frac"} <= set(history[0])
    moved = [not torch.equal(v, start[k]) for k, v in trainer.critic.model.state_dict().items()]
    assert any(moved) and "body.layers.0.self_attn.q_proj.weight" in trainer.critic.model.state_dict()


def test_critic_is_checkpointed_and_resumes_exactly(tmp_path):
    model = _model()
    trajs = _trajs(model)
    cfg = _cfg(*GAE)
    trainer = Trainer(model, cfg)
    trainer.step(trajs)
    folder = save_checkpoint(tmp_path, trainer, LoopState(step=1, drops={}), None)
    resumed = Trainer(from_pretrained(folder), cfg)
    load_training_state(folder, resumed)
    assert torch.equal(resumed.critic.model.head.weight, trainer.critic.model.head.weight)
    after, again = trainer.step(trajs), resumed.step(trajs)
    assert after["critic/value_loss"] == again["critic/value_loss"]
    for (name, p), q in zip(trainer.critic.model.named_parameters(), resumed.critic.model.parameters(), strict=True):
        assert torch.equal(p, q), name


def test_a_critic_from_its_own_folder_is_wrapped_as_the_policy_is(tmp_path):
    folder = str(save_pretrained(_model(seed=3), tmp_path / "critic"))
    for critic_path in ("", folder):
        trainer = Trainer(_model(), _cfg(*GAE, "--critic.path", critic_path, "--train.activation_checkpointing"))
        assert all(getattr(layer, "_molt_checkpointed", False) for layer in trainer.critic.model.body.layers)


def test_critic_flags_need_gae_and_run_on_either_backend():
    with pytest.raises(ConfigError, match="critic"):
        Config(critic=CriticConfig(lr=1e-3))
    Config(algo=AlgoConfig(estimator="gae"), runtime=RuntimeConfig(backend="ray"))  # sharded by the trainer ranks


def test_value_clip_binds_from_the_second_critic_update_against_the_values_gae_used():
    """critic.updates 3: V_old are the first forward's values (GAE's); later updates' V - V_old is clipped, so a
    tight clip holds the critic back and reports its clip fraction. With one update the clip cannot bind."""
    model = _model()
    trajs = _trajs(model)
    runs = {}
    for clip in ("0.2", "0.001"):
        trainer = Trainer(copy.deepcopy(model), _cfg(*GAE, "--critic.updates", "3", "--critic.clip", clip))
        runs[clip] = (trainer, trainer.step(trajs))
    (loose, loose_m), (tight, tight_m) = runs["0.2"], runs["0.001"]
    assert loose_m["critic/value_loss"] == tight_m["critic/value_loss"]  # the first update sees V = V_old
    assert tight_m["critic/clip_frac"] > 0.5 and tight_m["critic/value_loss_last"] > loose_m["critic/value_loss_last"]
    assert loose_m["critic/value_loss_last"] < loose_m["critic/value_loss"]  # three steps on one batch
    assert not torch.equal(loose.critic.model.head.weight, tight.critic.model.head.weight)
    with pytest.raises(SystemExit):  # one update per batch: V = V_old, the clip never binds
        _cfg(*GAE, "--critic.clip", "0.5")


def test_a_critic_folder_that_cannot_serve_is_refused_by_name(tmp_path):
    """A run directory loaded its policy as the critic, silently; a critic of another architecture on resume was an
    internal error from load_state_dict."""
    from molt.models import Transformer, preset

    folder = save_pretrained(_model(), tmp_path / "run" / "checkpoints" / "step-1")
    (folder.parent / "latest").write_text("step-1")
    with pytest.raises(ConfigError, match=r"critic.path: .* is a `molt train` run \(or an unfinished `molt sft`"):
        CriticConfig(path=str(tmp_path / "run"))
    save_pretrained(_model(), tmp_path / "run" / "checkpoint")  # a finished `molt sft` run: its final model
    assert CriticConfig(path=str(tmp_path / "run")).path == str(tmp_path / "run" / "checkpoint")
    trainer = Trainer(_model(), _cfg(*GAE, "--critic.path", str(folder)))  # a checkpoint folder: that policy's body
    state = trainer.critic.state_dict()
    other = save_pretrained(Transformer(preset("tiny", vocab_size=64, hidden_size=32, num_layers=1)), tmp_path / "o")
    with pytest.raises(ConfigError, match=r"critic.path: .*/o is not the architecture of the critic this checkpoint"):
        Trainer(_model(), _cfg(*GAE, "--critic.path", str(other))).critic.load_state_dict(state)


def test_the_critic_fits_the_returns_of_the_runs_own_estimator():
    """A registered estimator that needs `values_bt` and returns gae's returns x10: the critic's targets are those
    returns (critic/return_mean = train/return_mean), not gae's; before, the critic always regressed on gae's."""
    from molt import algo

    @algo.ESTIMATORS.register("gae_x10", whiten=True, needs=("rewards_b", "values_bt"), uses_kl=False,
                              group_baseline=False)  # fmt: skip
    def gae_x10(inputs, params):
        advantages_bt, returns_bt, metrics = algo.ESTIMATORS.get("gae")(inputs, params)
        return advantages_bt, 10 * returns_bt, metrics

    try:
        model = _model()
        trajs = _trajs(model)
        own = Trainer(copy.deepcopy(model), _cfg("--algo.estimator", "gae_x10", "--critic.lr", "3e-3")).step(trajs)
        gae = Trainer(copy.deepcopy(model), _cfg(*GAE)).step(trajs)
        assert own["critic/return_mean"] == pytest.approx(own["train/return_mean"], rel=1e-5)
        assert own["critic/return_mean"] == pytest.approx(10 * gae["critic/return_mean"], rel=1e-5)
        assert own["critic/value_loss"] > 10 * gae["critic/value_loss"]  # V_old = 0 (zero head): 0.5 * R^2
    finally:
        algo.ESTIMATORS.remove("gae_x10")


def test_an_estimator_of_values_and_a_teachers_kl_gets_both_for_the_critics_targets(tmp_path):
    """An estimator of your own that needs values_bt and kl_bt (GAE on the teacher's KL): the critic's targets lacked
    the KL ('needs kl_bt', blamed on the estimator) once they came from the run's estimator."""
    from molt import algo

    needs = ("rewards_b", "values_bt", "kl_bt")
    gae = algo.ESTIMATORS.get("gae")
    algo.ESTIMATORS.add("gae_distill", lambda inputs, params: gae(inputs, params), whiten=True, needs=needs,
                        uses_kl=True, group_baseline=False)  # fmt: skip
    try:
        model = _model()
        teacher = str(save_pretrained(copy.deepcopy(model), tmp_path / "teacher"))
        cfg = _cfg("--algo.estimator", "gae_distill", "--algo.teacher", teacher)
        metrics = Trainer(copy.deepcopy(model), cfg).step(_trajs(model))
        assert metrics["critic/return_mean"] == pytest.approx(metrics["train/return_mean"], rel=1e-5)
    finally:
        algo.ESTIMATORS.remove("gae_distill")
