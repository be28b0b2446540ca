"""Data-parallel training over Ray actors (FSDP2 over gloo) equals single-process training, and its
sharded checkpoint resumes on a different number of ranks."""

import copy

import pytest
from conftest import batch, moe_rollouts, small_model  # noqa: I001 - tests/conftest.py

from molt.cli.main import parse_config
from molt.models import from_pretrained
from molt.train import parallel
from molt.train.parallel import split_by_tokens
from molt.train.trainer import Trainer


def _cfg(*flags):
    # a collective timeout of 120 s: ranks whose collectives do not line up fail the test in minutes
    return parse_config(["--data.max_len", "64", "--rollout.max_len", "64", "--train.warmup_steps", "0",
                         "--train.micro_batch_tokens", "64", "--runtime.backend", "ray",
                         "--runtime.collective_timeout_s", "120", *flags])  # fmt: skip


MIXED = "cpu:gloo,cuda:nccl"


@pytest.mark.parametrize(("device", "backend"), [("cpu", "gloo"), ("cuda", MIXED), ("cuda:1", MIXED)])
def test_cuda_ranks_move_cpu_tensors_over_gloo(monkeypatch, device, backend):
    """The step all-reduces CPU tensors (denominators, metric sums), which NCCL refuses: on CUDA the group pairs NCCL
    (FSDP2's CUDA tensors) with gloo for them. Isolated from a real group: no GPU here."""
    seen = []
    monkeypatch.setattr(parallel.dist, "init_process_group", lambda backend, *a, **k: seen.append(backend))
    parallel.init_process_group(0, 2, "127.0.0.1", 1, device=device)
    assert seen == [backend]


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


def _assert_same_params(remote, local):
    weights = remote.weights()
    for name, param in local.model.state_dict().items():
        assert (weights[name] - param).abs().max() <= 1e-4, name


def _ranks(ray, cfg, model, n):
    from molt.runtime.ranks import spawn_rank

    return [spawn_rank(cfg, ray.put(model), r, n, {"num_cpus": 1}) for r in range(n)]


@pytest.mark.slow
@pytest.mark.parametrize("aggregation", ["token-mean", "prompt-mean-token-mean"])
def test_two_ranks_match_one_process_and_resume_on_one_rank(ray_cluster, tmp_path, aggregation):
    from molt.runtime.ranks import RayTrainer

    ray = ray_cluster
    cfg = _cfg("--algo.loss_agg", aggregation, "--rollout.prompts_per_step", "4", "--runtime.trainer_ranks", "2")
    model = small_model()
    batches = [batch(model, seed=s) for s in range(4)]
    local = Trainer(copy.deepcopy(model), cfg)
    ranks = _ranks(ray, cfg, model, 2)
    try:
        remote = RayTrainer(cfg, ranks)
        for trajs in batches[:3]:
            expected, got = local.step(trajs), remote.step(trajs)
            for key in ("train/loss", "train/grad_norm", "train/logprob_diff", "train/action_tokens"):
                assert got[key] == pytest.approx(expected[key], rel=1e-5, abs=1e-7), key
        _assert_same_params(remote, local)
        assert remote.version == local.version == 3
        state = remote.save(tmp_path / "ckpt", tokenizer=None) | {"version": remote.version}
    finally:
        for r in ranks:
            ray.kill(r)
    # resume on ONE rank from the 2-rank shards: optimizer moments too, so step 4 matches
    cfg1 = _cfg("--algo.loss_agg", aggregation, "--rollout.prompts_per_step", "4")
    ranks = _ranks(ray, cfg1, from_pretrained(tmp_path / "ckpt"), 1)
    try:
        resumed = RayTrainer(cfg1, ranks)
        resumed.load(tmp_path / "ckpt", state)
        expected, got = local.step(batches[3]), resumed.step(batches[3])
        assert got["train/loss"] == pytest.approx(expected["train/loss"], rel=1e-5)
        _assert_same_params(resumed, local)
        assert resumed.version == 4
    finally:
        for r in ranks:
            ray.kill(r)


@pytest.mark.slow
def test_an_moe_policy_trains_on_two_ranks_as_in_one_process(ray_cluster):
    from molt.runtime.ranks import RayTrainer

    flags = ["--model.preset", "tiny-moe", "--train.freeze_router", "--runtime.trainer_ranks", "2"]
    cfg = _cfg(*flags, "--rollout.prompts_per_step", "4")
    model = small_model(kind="moe")
    trajs = moe_rollouts(copy.deepcopy(model))  # recorded routing: a no-grad forward routes the other way too
    local, ranks = Trainer(copy.deepcopy(model), cfg), _ranks(ray_cluster, cfg, model, 2)
    try:  # that no-grad forward must leave no parameter unsharded for the optimizer step
        remote = RayTrainer(cfg, ranks)
        for _ in range(2):
            expected, got = local.step(trajs), remote.step(trajs)
            for key in ("train/loss", "train/grad_norm", "moe/logprob_diff_live", "moe/logprob_diff_replay"):
                assert got[key] == pytest.approx(expected[key], rel=1e-5, abs=1e-7), key
        weights, expected_weights = remote.weights(), local.weights()  # frozen routers are not synced
        assert set(weights) == set(expected_weights) and len(weights) < len(local.model.state_dict())
        for name, value in expected_weights.items():
            assert (weights[name] - value).abs().max() <= 1e-4, name
    finally:
        for r in ranks:
            ray_cluster.kill(r)
