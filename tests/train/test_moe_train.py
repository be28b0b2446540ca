"""MoE in the trainer: routing replay (R3) against a bf16-like engine, agreement metric, freeze, aux loss.

Rollouts come from the real `TorchEngine` (with routing capture); the "bf16-like" engine holds the
trainer's weights rounded to bf16, as a bf16 rollout engine would, so some near-tie routing
decisions flip between rollout and trainer.
"""

import copy
import dataclasses

import pytest
import torch
from conftest import moe_rollouts  # noqa: I001 - tests/conftest.py

from molt.cli.main import parse_config
from molt.config import Config, ConfigError
from molt.data.trajectory import Trajectory
from molt.models import Transformer, preset
from molt.train.packing import Piece, collate_routing
from molt.train.routing import forward_routing
from molt.train.trainer import Trainer, token_logprobs


def _model(kind="moe", seed=0):
    kw = dict(vocab_size=64, hidden_size=64, num_layers=2, head_dim=16)
    arch = preset("tiny-moe", moe_intermediate_size=32, **kw) if kind == "moe" else preset("tiny", **kw)
    return Transformer(arch).init_weights(0.1, torch.Generator().manual_seed(seed))


def _bf16_like(model):
    model = copy.deepcopy(model)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    return model


def _cfg(preset_name="tiny-moe", *flags):
    base = ["--data.max_len", "64", "--rollout.max_len", "64", "--train.warmup_steps", "0"]
    return parse_config([*base, "--model.preset", preset_name, "--train.lr", "1e-9", *flags])


@pytest.fixture(scope="module")
def moe_runs():
    """Step metrics of the MoE trainer on equal-weight and bf16-like rollouts, live and replayed routing."""
    model = _model()
    out = {}
    for label, engine_model in (("equal", copy.deepcopy(model)), ("bf16", _bf16_like(model))):
        trajs = moe_rollouts(engine_model)
        for replay in (False, True):
            flags = ["--algo.routing_replay"] if replay else []
            trainer = Trainer(copy.deepcopy(model), _cfg("tiny-moe", *flags))
            out[label, replay] = (trainer, trajs, trainer.step(trajs))
    return out


def test_equal_weights_agree_on_every_token(moe_runs):
    for replay in (False, True):
        metrics = moe_runs["equal", replay][2]
        assert metrics["moe/routing_agreement"] == 1.0
        assert metrics["train/logprob_diff"] <= 1e-5
        assert metrics["moe/recorded_frac"] > 0.9  # all but each sample's last token


def test_bf16_like_engine_flips_routing_and_replay_removes_its_cost(moe_runs):
    live, replayed = moe_runs["bf16", False][2], moe_runs["bf16", True][2]
    assert live["moe/routing_agreement"] < 1.0
    assert replayed["train/logprob_diff"] < 0.75 * live["train/logprob_diff"]
    # the dense level: a dense model of the same shape under the same bf16-like rounding
    dense = _model("dense")
    dense_metrics = Trainer(copy.deepcopy(dense), _cfg("tiny")).step(moe_rollouts(_bf16_like(dense)))
    dense_diff = dense_metrics["train/logprob_diff"]
    assert replayed["train/logprob_diff"] <= 1.5 * dense_diff < live["train/logprob_diff"] * 1.5
    assert not [k for k in dense_metrics if k.startswith("moe/")]  # a dense step runs no MoE extra forward


def test_every_step_reports_the_logprob_diff_with_and_without_replay(moe_runs):
    for replay, mode in ((False, "live"), (True, "replay")):
        bf16, equal = moe_runs["bf16", replay][2], moe_runs["equal", replay][2]
        assert bf16["moe/logprob_diff_live"] > bf16["moe/logprob_diff_replay"]
        assert bf16[f"moe/logprob_diff_{mode}"] == pytest.approx(bf16["train/logprob_diff"], rel=1e-9)
        assert max(equal["moe/logprob_diff_live"], equal["moe/logprob_diff_replay"]) <= 1e-5
    # the extra no-grad forward in the other mode gives what a step in that mode reports
    live, replayed = moe_runs["bf16", False][2], moe_runs["bf16", True][2]
    assert replayed["moe/logprob_diff_live"] == pytest.approx(live["train/logprob_diff"], rel=1e-5)
    assert live["moe/logprob_diff_replay"] == pytest.approx(replayed["train/logprob_diff"], rel=1e-5)


def test_replay_uses_the_engines_experts_on_every_recorded_token(moe_runs):
    for replay in (True, False):
        trainer, trajs, _ = moe_runs["bf16", replay]
        same, total = 0, 0
        for mb in trainer.micro_batches(trajs):
            routing = forward_routing(mb.packed, replay)
            with torch.no_grad():
                token_logprobs(trainer.model, mb.packed, 1.0, routing)
            recorded_nlk = mb.packed.routing.flatten(0, 1).long()
            has = (mb.packed.doc_ids.flatten() >= 0) & (recorded_nlk[:, 0, 0] >= 0)
            used_nlk = routing.chosen_nlk()
            same += int((used_nlk[has] == recorded_nlk[has]).all(-1).all(-1).sum())
            total += int(has.sum())
        assert (same == total) == replay, (replay, same, total)


def test_a_sharded_moe_step_matches_the_plain_one(moe_runs):
    """FSDP2 (one gloo rank, in process) with the data-parallel step path: same metrics as unsharded."""
    import socket

    from molt.train import parallel

    _, trajs, expected = moe_runs["bf16", True]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    parallel.init_process_group(0, 1, "127.0.0.1", port)
    try:
        trainer = Trainer(_model(), _cfg("tiny-moe", "--algo.routing_replay"))
        parallel.parallelize(trainer.model)  # FSDP2 rebuilds dataclass arguments: Routing must survive it
        got = trainer.step(trajs, shard=list(range(len(trajs))))
    finally:
        torch.distributed.destroy_process_group()
    for key in [k for k in expected if k.startswith(("moe/", "train/logprob_diff", "train/loss"))]:
        assert got[key] == pytest.approx(expected[key], rel=1e-5, abs=1e-7), key


def test_freeze_router_keeps_it_out_of_the_optimizer_and_the_sync():
    model = _model()
    trajs = moe_rollouts(copy.deepcopy(model))
    trainer = Trainer(model, _cfg("tiny-moe", "--train.freeze_router", "--train.lr", "1e-2"))
    names = model.router_names()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    for _ in range(2):
        trainer.step(trajs)
    after = model.state_dict()
    assert all(torch.equal(before[n], after[n]) for n in names)
    assert not torch.equal(before["layers.0.mlp.gate_up_proj"], after["layers.0.mlp.gate_up_proj"])
    routers = {id(model.get_parameter(n)) for n in names}
    assert not routers & {id(p) for group in trainer.opt.param_groups for p in group["params"]}
    synced = trainer.weights()
    assert not set(names) & set(synced) and "layers.0.mlp.gate_up_proj" in synced
    assert set(Trainer(_model(), _cfg("tiny-moe")).weights()) >= set(names)


def test_aux_loss_pushes_the_router_toward_balance():
    model = _model()
    trajs = moe_rollouts(copy.deepcopy(model))
    metrics = Trainer(copy.deepcopy(model), _cfg("tiny-moe", "--algo.no_moe_diff_both")).step(trajs)
    assert "moe/logprob_diff_live" in metrics and "moe/logprob_diff_replay" not in metrics  # no extra forward
    assert metrics["moe/aux_loss"] >= 1.0 and metrics["moe/load_cv"] > 0 and metrics["moe/load_max_over_mean"] > 1
    grads = {}
    for coef in ("0", "1"):
        trainer = Trainer(copy.deepcopy(model), _cfg("tiny-moe", "--algo.moe_aux_coef", coef))
        mb = trainer.micro_batches(trajs)[0]
        trainer._backward(mb, trajs, trainer.advantages(trajs)[0], _denoms(trainer, trajs), {})
        grads[coef] = trainer.model.get_parameter("layers.0.mlp.gate.weight").grad.clone()
    assert not torch.allclose(grads["0"], grads["1"])


def test_micro_batch_split_is_exact_except_the_load_balancing_loss():
    """Split into micro-batches (or prompts laid out once), an MoE step's update is the same, except with
    --algo.moe_aux_coef: the Switch loss is computed per micro-batch over its packed positions (documented)."""
    model = _model()
    trajs = moe_rollouts(copy.deepcopy(model))

    def update(*flags):
        trainer = Trainer(copy.deepcopy(model), _cfg("tiny-moe", "--train.grad_clip", "0", *flags))
        trainer.opt = torch.optim.SGD(trainer.trainable(), lr=1.0)
        trainer.step(trajs)
        return torch.cat([p.detach().flatten() for p in trainer.model.parameters()])

    for aux in ((), ("--algo.moe_aux_coef", "1.0")):
        whole, split = update(*aux), update(*aux, "--train.micro_batch_tokens", "64")
        assert ((whole - split).abs().max() > 1e-4) == bool(aux)


def _denoms(trainer, trajs):
    from molt import algo

    mbs = trainer.micro_batches(trajs)
    trainer.step_tokens = sum(mb.packed.num_tokens for mb in mbs)
    return algo.step_denominators([mb.mask_bt for mb in mbs], [trainer._group_ids(mb, trajs) for mb in mbs])


def test_moe_flags_on_a_dense_model_are_config_errors():
    for group, key, value in (("algo", "routing_replay", True), ("train", "freeze_router", True),
                              ("algo", "moe_aux_coef", 0.01)):  # fmt: skip
        sub = dataclasses.replace(getattr(Config(), group), **{key: value})
        with pytest.raises(ConfigError, match=f"{group}.{key}: needs a mixture-of-experts model"):
            Config(**{group: sub})
    cfg = _cfg("tiny-moe", "--algo.routing_replay")  # a loaded dense model is caught by the trainer
    with pytest.raises(ConfigError, match="algo.routing_replay"):
        Trainer(_model("dense"), cfg)


def test_trajectory_routing_merges_by_position_and_packs_by_row():
    traj = Trajectory()
    traj.extend_prompt([1, 2, 3])
    first = torch.tensor([[[0, 1]], [[2, 3]], [[-1, -1]]], dtype=torch.int16)  # [3 positions, 1 layer, k=2]
    traj.add_routing(first)
    traj.extend_action([4, 5], [0.0, 0.0], [0, 0])
    later = torch.tensor([[[-1, -1]], [[4, 5]], [[6, 7]], [[1, 2]], [[-1, -1]]], dtype=torch.int16)
    traj.add_routing(later)
    assert traj.routing[:, 0].tolist() == [[0, 1], [4, 5], [6, 7], [1, 2], [-1, -1]]
    traj.check()
    assert torch.equal(Trajectory.from_dict(traj.to_dict()).routing, traj.routing)
    packed = collate_routing([traj.routing, None], [[Piece(1, 0, 2), Piece(0, 0, 5)]], 8, (1, 2))
    assert packed.shape == (1, 8, 1, 2)
    assert (packed[0, :2] == -1).all() and torch.equal(packed[0, 2:7], traj.routing) and (packed[0, 7] == -1).all()
    # a record that stops short of its sample's last tokens (an unforwarded closing observation): -1 past it
    short = collate_routing([traj.routing[:3]], [[Piece(0, 0, 5)]], 6, (1, 2))
    assert torch.equal(short[0, :3], traj.routing[:3]) and (short[0, 3:] == -1).all()


def test_a_shared_prompt_replays_each_members_own_prompt_routing():
    """A group member recomputed after a weight swap routed its prompt anew; sharing the prompt replayed member 0's
    routing for all (loss -0.263 shared vs -0.277 unshared in the audit)."""
    model = _model()
    trajs = moe_rollouts(_bf16_like(model))
    other = trajs[1].routing.clone()
    other[:8] = (other[:8] + 1) % 4  # its 8 prompt positions routed otherwise
    trajs[1] = dataclasses.replace(trajs[1], routing=other)
    losses = [
        Trainer(copy.deepcopy(model), _cfg("tiny-moe", "--algo.routing_replay", share)).step(trajs)["train/loss"]
        for share in ("--train.share_prefix", "--train.no_share_prefix")
    ]
    assert losses[0] == pytest.approx(losses[1], abs=1e-6)
