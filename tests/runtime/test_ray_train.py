"""`molt train --runtime.backend ray` on the session's local cluster: 2 engine replicas, 2 trainer ranks (the
rollouts of the learning run in 2 agent worker processes, which reach the replicas through the driver's router)."""

import json
import threading
import time

import pytest

from molt.cli.main import parse_config
from molt.cli.train import run_train

pytestmark = pytest.mark.slow

RAY = ["--runtime.backend", "ray", "--runtime.engines", "2", "--train.warmup_steps", "0", "--log.every", "100"]


@pytest.fixture(scope="module")
def ray_run(ray_cluster, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("ray") / "run"
    flags = ["--train.max_steps", "6", "--eval.every", "6", "--eval.num_prompts", "40", "--rollout.max_staleness",
             "0", "--runtime.trainer_ranks", "2", "--train.lr", "2e-4", "--log.run_dir", str(run_dir),
             "--runtime.collective_timeout_s", "180", "--rollout.agent_workers", "2"]  # fmt: skip
    return run_train(parse_config([*RAY, *flags])), run_dir


def test_two_engines_two_ranks_learn_and_keep_the_consistencies(ray_run):
    result, run_dir = ray_run
    steps = [m for m in result.history if "train/loss" in m]
    assert len(steps) == 6
    assert result.eval_after["eval/reward_mean"] > result.eval_before["eval/reward_mean"]
    assert all(m["train/staleness_max"] == 0 and m["train/logprob_diff"] <= 1e-5 for m in steps)
    assert all(m["rollout/failures"] == 0 for m in steps)  # token check ran in every step (it raises otherwise)
    last = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["engine/0/requests"] > 0 and last["engine/1/requests"] > 0  # both replicas served
    busy = [m[f"engine/{i}/busy_s"] for m in result.history for i in (0, 1)]  # each replica's model-step seconds
    assert all(b >= 0 for b in busy) and sum(busy) > 0 and max(busy) < result.history[-1]["time/elapsed_s"]
    assert last["sync/gb"] > 0 and last["sync/gb_per_s"] > 0
    assert last["train/rank0_tokens"] > 0 and last["train/rank1_tokens"] > 0
    assert (run_dir / "checkpoints" / "step-6" / "dcp").is_dir()


def test_resume_from_two_rank_checkpoint_on_one_rank(ray_run):
    _, run_dir = ray_run
    args = ["--config", str(run_dir / "config.yaml"), "--ckpt.resume", str(run_dir), "--train.max_steps", "7",
            "--runtime.trainer_ranks", "1", "--eval.every", "0"]  # fmt: skip
    resumed = run_train(parse_config(args))
    assert [m["step"] for m in resumed.history] == [7]
    assert resumed.history[0]["version"] == 7 and resumed.history[0]["train/staleness_max"] == 0


def _kill_replica_after_first_step(ray, run_dir, killed):
    metrics = run_dir / "metrics.jsonl"
    while not (metrics.exists() and '"train/loss"' in metrics.read_text()):
        time.sleep(0.2)
    ray.kill(ray.get_actor("molt-engine-0"), no_restart=False)  # Ray restarts it
    killed.set()


def test_killed_engine_replica_restarts_and_no_sample_is_lost(ray_cluster, tmp_path):
    run_dir = tmp_path / "run"
    killed = threading.Event()
    threading.Thread(target=_kill_replica_after_first_step, args=(ray_cluster, run_dir, killed), daemon=True).start()
    flags = ["--train.max_steps", "4", "--eval.every", "0", "--rollout.max_staleness", "1", "--log.run_dir",
             str(run_dir)]  # fmt: skip
    result = run_train(parse_config([*RAY, *flags]))
    assert killed.is_set()
    steps = [m for m in result.history if "train/loss" in m]
    assert len(steps) == 4 and steps[-1]["engine/0/restarts"] == 1 and steps[-1]["engine/0/resent"] >= 1
    assert all(m["rollout/failures"] == 0 for m in steps)
    # every sample is trained or dropped with a counted reason; the restart's delay may make a group stale
    allowed = ("drop/filter", "drop/stale")
    assert not any(k.startswith("drop/") and not k.startswith(allowed) for m in steps for k in m)
    assert all(m["train/num_samples"] == 64 and m["train/staleness_max"] <= 1 for m in steps)
