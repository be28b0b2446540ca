"""RL trainer: token checks, exact log-probs through packing, micro-batch invariance, versions."""

import copy
import random

import pytest
import torch
import torch.nn.functional as F

from molt.cli.main import parse_config
from molt.data.trajectory import Trajectory
from molt.models import Transformer, preset
from molt.train.trainer import TokenMismatchError, Trainer, _unpack, check_tokens, token_logprobs


def _model(seed=0):
    cfg = preset("tiny", vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=2, head_dim=16)
    return Transformer(cfg).init_weights(0.05, torch.Generator().manual_seed(seed))


@torch.no_grad()
def _true_logprobs(model, tokens, temperature):
    logits = model(torch.tensor([tokens]))[0].float() / temperature
    lp = F.log_softmax(logits, -1)[:-1].gather(-1, torch.tensor(tokens[1:])[:, None])[:, 0]
    return [0.0] + lp.tolist()


def _trajs(model, num_groups=3, n=4, temperature=1.0, version=0, seed=0, same_prompt=False):
    rng = random.Random(seed)
    out = []
    for g in range(num_groups):
        prompt_rng = random.Random(seed * 1000 + g)
        prompt = [prompt_rng.randrange(64) for _ in range(prompt_rng.randint(5, 12))]
        for k in range(n):
            traj = Trajectory(group_id=g, rollout_id=g * n + k, reward=float(rng.random() < 0.5))
            traj.extend_prompt(prompt if same_prompt else [rng.randrange(64) for _ in range(rng.randint(3, 9))])
            for _turn in range(rng.randint(1, 2)):
                ids = [rng.randrange(64) for _ in range(rng.randint(2, 7))]
                traj.extend_action(ids, [0.0] * len(ids), [version] * len(ids), keep_copy=True)
                traj.extend_prompt([rng.randrange(64) for _ in range(2)])
            lp = _true_logprobs(model, traj.tokens, temperature)
            traj.rollout_logprobs = [x if m else 0.0 for x, m in zip(lp, traj.loss_mask, strict=True)]
            out.append(traj)
    return out


def _cfg(*flags):
    return parse_config(["--data.max_len", "64", "--rollout.max_len", "64", "--train.warmup_steps", "0", *flags])


def test_logprob_diff_is_zero_on_policy_and_version_bumps():
    model = _model()
    trainer = Trainer(model, _cfg("--train.micro_batch_tokens", "64"))
    metrics = trainer.step(_trajs(model))
    assert metrics["train/logprob_diff"] <= 1e-5
    assert metrics["train/num_micro_batches"] > 1
    assert metrics["train/staleness_max"] == 0 and trainer.version == 1


def test_temperature_is_applied_like_the_engine():
    model = _model()
    trainer = Trainer(model, _cfg("--rollout.temperature", "0.7"))
    assert trainer.step(_trajs(model, temperature=0.7))["train/logprob_diff"] <= 1e-5


def _sgd_update(base, trajs, *flags):
    """Parameters after one plain-SGD step (update == gradient; Adam's would hide differences), and metrics."""
    model = copy.deepcopy(base)
    trainer = Trainer(model, _cfg("--train.grad_clip", "0", *flags))
    trainer.opt = torch.optim.SGD(model.parameters(), lr=1.0)
    metrics = trainer.step(trajs)
    return torch.cat([p.detach().flatten() for p in model.parameters()]), metrics


def test_micro_batch_split_does_not_change_the_update():
    base = _model()
    trajs = _trajs(base)
    params = [_sgd_update(base, trajs, "--train.micro_batch_tokens", budget)[0] for budget in ("64", "4096")]
    assert (params[0] - params[1]).abs().max() <= 1e-6
    assert (params[0] - torch.cat([p.flatten() for p in base.parameters()])).abs().max() > 1e-5  # it moved


def test_shared_prompt_prefix_gives_the_same_logprobs_and_update_on_fewer_tokens():
    base = _model()
    trajs = _trajs(base, n=5, same_prompt=True)
    trainer = Trainer(copy.deepcopy(base), _cfg())
    shared = sum(mb.packed.num_tokens for mb in trainer.micro_batches(trajs))
    assert shared < sum(len(t.tokens) for t in trajs) - 2 * 3 * 4  # each group's prompt laid out once
    (new, on), (old, off) = (
        _sgd_update(base, trajs, *f) for f in (["--train.share_prefix"], ["--train.no_share_prefix"])
    )
    assert on["train/logprob_diff"] <= 1e-5 and abs(on["train/loss"] - off["train/loss"]) <= 1e-6
    assert (new - old).abs().max() <= 1e-6


def test_staleness_is_measured_from_token_versions():
    model = _model()
    trainer = Trainer(model, _cfg())
    trainer.version = 3
    metrics = trainer.step(_trajs(model, version=1))
    assert metrics["train/staleness_max"] == 2 and metrics["train/staleness_mean"] == 2


def test_token_checks_catch_tampering():
    model = _model()
    trajs = _trajs(model, num_groups=1, n=2)
    check_tokens(trajs, exhaustive=True)
    bad = copy.deepcopy(trajs)
    start = bad[0].actions[0][0]
    bad[0].tokens[start] = (bad[0].tokens[start] + 1) % 64  # not what the engine emitted
    with pytest.raises(TokenMismatchError, match="differ from the engine's"):
        check_tokens(bad)
    bad = copy.deepcopy(trajs)
    bad[1].loss_mask[0], bad[1].versions[0] = 1, 0  # a prompt token trained as if generated
    with pytest.raises(TokenMismatchError, match="were not generated by the engine"):
        check_tokens(bad)


@pytest.mark.parametrize("same_prompt, budget", [(True, "4096"), (False, "4096"), (False, "64")])
def test_last_layer_on_trained_positions_only_equals_the_full_forward(same_prompt, budget):
    """`trained_only` (what the trainer runs on dense models) computes the last layer at trained targets and
    forks only: the same log-probs there, 0 elsewhere, and the same gradient of a masked loss."""
    model = _model()
    trajs = _trajs(model, n=4, same_prompt=same_prompt)
    for mb in Trainer(model, _cfg("--train.micro_batch_tokens", budget)).micro_batches(trajs):
        grads = []
        for trained_only in (False, True):
            model.zero_grad()
            logp_bt = _unpack(token_logprobs(model, mb.packed, 0.8, trained_only=trained_only), mb)
            (logp_bt * mb.mask_bt).sum().backward()
            grads.append((logp_bt.detach(), torch.cat([p.grad.flatten() for p in model.parameters()])))
        (full, g_full), (pruned, g_pruned) = grads
        assert (pruned - full * mb.mask_bt).abs().max() <= 1e-5
        assert (g_pruned - g_full).abs().max() <= 1e-5 and g_full.abs().max() > 0


def test_selected_outputs_of_a_plain_causal_forward_equal_the_full_logits():
    model = _model()
    ids_bt = torch.randint(0, 64, (2, 9))
    cols_bq = torch.tensor([[0, 4, 8], [2, 3, 3]])
    full = model(ids_bt)
    picked = model(ids_bt, outputs_bq=cols_bq)
    assert (picked - full[torch.arange(2)[:, None], cols_bq]).abs().max() <= 1e-5


def test_entropy_coef_changes_the_loss_by_coef_times_the_mean_entropy():
    base = _model()
    trajs = _trajs(base)
    params_off, off = _sgd_update(base, trajs)
    params_on, on = _sgd_update(base, trajs, "--algo.entropy_coef", "0.1")
    assert on["train/loss"] == pytest.approx(off["train/loss"] - 0.1 * off["train/entropy"], abs=1e-5)
    assert (params_on - params_off).abs().max() > 1e-6  # the bonus has a gradient
