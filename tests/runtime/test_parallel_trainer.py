"""Data-parallel training over Ray actors (FSDP2 over gloo) equals single-process training."""

import copy

import pytest
from conftest import batch, small_model  # noqa: I001 - tests/runtime/conftest.py

from molt.cli.main import parse_config
from molt.train.parallel import split_by_tokens
from molt.train.trainer import Trainer


def _cfg(*flags):
    return parse_config(["--data.max_len", "64", "--rollout.max_len", "64", "--train.warmup_steps", "0",
                         "--train.micro_batch_tokens", "64", *flags])  # fmt: skip


def test_split_keeps_groups_whole_and_balances_tokens():
    trajs = batch(small_model(), num_groups=5, n=3)
    shards = split_by_tokens(trajs, 2)
    assert sorted(i for s in shards for i in s) == list(range(len(trajs)))
    for shard in shards:
        for g in {trajs[i].group_id for i in shard}:
            assert {i for i, t in enumerate(trajs) if t.group_id == g} <= set(shard)
    load = [sum(len(trajs[i].tokens) for i in s) for s in shards]
    biggest_group = max(sum(len(t.tokens) for t in trajs if t.group_id == g) for g in range(5))
    assert abs(load[0] - load[1]) <= biggest_group


@pytest.mark.slow
@pytest.mark.parametrize("aggregation", ["token-mean", "prompt-mean-token-mean"])
def test_two_ranks_match_one_process(ray_cluster, aggregation):
    from molt.runtime.ranks import RayTrainer, spawn_rank

    ray = ray_cluster
    cfg = _cfg("--algo.loss_agg", aggregation, "--rollout.prompts_per_step", "4", "--runtime.backend", "ray",
               "--runtime.trainer_ranks", "2")  # fmt: skip
    model = small_model()
    batches = [batch(model, seed=s) for s in range(3)]
    local = Trainer(copy.deepcopy(model), cfg)
    ranks = [spawn_rank(cfg, ray.put(model), r, 2, {"num_cpus": 1}) for r in range(2)]
    try:
        remote = RayTrainer(cfg, ranks)
        for trajs in batches:
            expected, got = local.step(trajs), remote.step(trajs)
            for key in ("train/loss", "train/grad_norm", "train/logprob_diff", "train/action_tokens"):
                assert got[key] == pytest.approx(expected[key], rel=1e-5, abs=1e-7), key
        weights = remote.weights()
        for name, param in local.model.state_dict().items():
            assert (weights[name] - param).abs().max() <= 1e-4, (name, float((weights[name] - param).abs().max()))
        assert remote.version == local.version == 3
    finally:
        for r in ranks:
            ray.kill(r)
