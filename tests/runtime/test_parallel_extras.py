"""The models beside the policy on data-parallel Ray trainer ranks (FSDP2 over gloo) equal one process: the PPO
critic, the KL reference and the adaptive KL coefficient; LoRA with a teacher. The sharded checkpoint holds the
critic, the reference and the coefficient, so a 2-rank run resumes on one rank and continues identically."""

import copy

import pytest
import torch
from conftest import batch, small_model  # noqa: I001 - tests/conftest.py
from test_parallel_trainer import _cfg, _ranks  # tests/runtime/test_parallel_trainer.py

from molt.models import from_pretrained, save_pretrained
from molt.runtime.ranks import RayTrainer
from molt.train.trainer import Trainer

SKIP = ("time/", "train/tokens_per_s", "train/num_micro_batches")  # timings; micro-batches are per rank


def _assert_same_metrics(got: dict, expected: dict) -> None:
    for key, value in expected.items():
        if not key.startswith(SKIP):
            assert got[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key


def _assert_same_weights(remote: RayTrainer, local: Trainer) -> None:
    """The gathered (with LoRA merged) weights equal the one process's."""
    weights = remote.weights()
    for name, value in local.weights().items():
        assert (weights[name] - value).abs().max() <= 1e-4, name


@pytest.mark.slow
def test_critic_reference_and_adaptive_kl_match_one_process_and_resume_on_one_rank(ray_cluster, tmp_path):
    ray = ray_cluster
    flags = ("--algo.estimator", "gae", "--critic.lr", "3e-3", "--algo.kl_coef", "0.1", "--algo.kl_target", "0.001",
             "--algo.kl_horizon", "10", "--train.lr", "1e-3", "--rollout.prompts_per_step", "4",
             "--rollout.n_samples_per_prompt", "2")  # fmt: skip
    cfg = _cfg(*flags, "--runtime.trainer_ranks", "2")
    model = small_model()
    batches = [batch(model, seed=s) for s in range(3)]
    torch.manual_seed(cfg.train.seed)
    local = Trainer(copy.deepcopy(model), cfg)
    ranks = _ranks(ray, cfg, model, 2)
    try:
        remote = RayTrainer(cfg, ranks)
        for trajs in batches[:2]:
            _assert_same_metrics(remote.step(trajs), local.step(trajs))
        state = remote.save(tmp_path / "ckpt", tokenizer=None) | {"version": remote.version}
    finally:
        for r in ranks:
            ray.kill(r)
    assert state["kl_coef"] != 0.1  # the controller moved it; the checkpoint keeps where it is
    cfg1 = _cfg(*flags)
    ranks = _ranks(ray, cfg1, from_pretrained(tmp_path / "ckpt"), 1)  # the policy at step 2, not the reference
    try:
        resumed = RayTrainer(cfg1, ranks)
        resumed.load(tmp_path / "ckpt", state)
        got, expected = resumed.step(batches[2]), local.step(batches[2])
        _assert_same_metrics(got, expected)
        assert expected["train/kl"] > 0 and expected["critic/value_loss"] > 0
        _assert_same_weights(resumed, local)
    finally:
        for r in ranks:
            ray.kill(r)


@pytest.mark.slow
def test_lora_with_a_teacher_and_the_adapters_off_reference_match_one_process_and_reload(ray_cluster, tmp_path):
    ray = ray_cluster
    teacher = str(save_pretrained(small_model(seed=3), tmp_path / "teacher"))
    flags = ("--train.lora_rank", "4", "--train.lr", "1e-2", "--algo.teacher", teacher, "--algo.kl_coef", "0.1",
             "--rollout.prompts_per_step", "4", "--runtime.trainer_ranks", "2")  # fmt: skip
    cfg = _cfg(*flags)
    model = small_model()
    batches = [batch(model, seed=s) for s in range(2)]
    torch.manual_seed(cfg.train.seed)  # the ranks seed theirs so: equal adapters at the start
    local = Trainer(copy.deepcopy(model), cfg)
    ranks = _ranks(ray, cfg, model, 2)
    try:
        remote = RayTrainer(cfg, ranks)
        _assert_same_metrics(remote.step(batches[0]), local.step(batches[0]))
        state = remote.save(tmp_path / "ckpt", tokenizer=None) | {"version": remote.version}
        merged = from_pretrained(tmp_path / "ckpt").state_dict()
        for name, value in local.weights().items():
            assert (merged[name] - value).abs().max() <= 1e-4, name
        assert (tmp_path / "ckpt" / "adapter" / "adapter_model.safetensors").exists()
        got, expected = remote.step(batches[1]), local.step(batches[1])
        _assert_same_metrics(got, expected)
        assert abs(expected["train/distill_kl"]) > 1e-3 and expected["train/kl"] > 0
        _assert_same_weights(remote, local)
        remote.load(tmp_path / "ckpt", state)  # back to step 1: adapters and their AdamW moments
        _assert_same_metrics(remote.step(batches[1]), expected)
    finally:
        for r in ranks:
            ray.kill(r)


@pytest.mark.slow
def test_an_estimator_of_your_own_reaches_the_ranks(ray_cluster):
    """Registered in the driver before training (as docs/algorithms.md says), it is registered on every rank too,
    sent by value: the rank's process does not import the module that defined it."""
    from molt import algo

    @algo.ESTIMATORS.register("half_rloo", whiten=False, needs=("rewards_b", "group_ids_b"), uses_kl=False,
                              group_baseline=True)  # fmt: skip
    def half_rloo(inputs, params):
        advantages_bt, returns_bt, metrics = algo.ESTIMATORS.get("rloo")(inputs, params)
        return advantages_bt / 2, returns_bt / 2, metrics

    algo.POLICY_LOSSES.add("pg_again", algo.POLICY_LOSSES.get("pg"))  # a built-in under a name of yours: sent too
    try:
        assert [name for _, name, _, _ in algo.own_variants()] == ["half_rloo", "pg_again"]
        cfg = _cfg("--algo.estimator", "half_rloo", "--algo.policy_loss", "pg_again", "--rollout.prompts_per_step", "4")
        model = small_model()
        trajs = batch(model, seed=0)
        (rank,) = _ranks(ray_cluster, cfg, model, 1)
        try:
            _assert_same_metrics(RayTrainer(cfg, [rank]).step(trajs), Trainer(copy.deepcopy(model), cfg).step(trajs))
        finally:
            ray_cluster.kill(rank)
    finally:
        del algo.ESTIMATORS._fns["half_rloo"], algo.ESTIMATORS._info["half_rloo"]
        del algo.POLICY_LOSSES._fns["pg_again"], algo.POLICY_LOSSES._info["pg_again"]
