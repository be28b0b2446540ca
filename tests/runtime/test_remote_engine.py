"""An engine replica actor behind `RemoteEngine`: chunked weight sync, missing parameters, a dead replica."""

import asyncio

import pytest
import torch
from conftest import small_model  # noqa: I001 - tests/conftest.py

from molt.cli.main import parse_config
from molt.engine import SamplingParams
from molt.runtime.cluster import ActorFailedError

pytestmark = pytest.mark.slow


def test_chunked_sync_then_missing_names_then_dead_replica_stops_the_run(ray_cluster):
    from molt.runtime.engines import RemoteEngine, chunk_weights

    ray = ray_cluster
    model = small_model()
    cfg = parse_config(["--rollout.max_len", "63", "--rollout.max_in_flight", "2"])  # 4 slots of 64 positions
    args = (cfg, ray.put(model), None, 0)
    engine = RemoteEngine.spawn(0, {"num_cpus": 1, "max_restarts": 0}, args, version=0, chunk_bytes=1 << 14)
    sampling = SamplingParams(max_tokens=4, seed=1)

    async def scenario():
        first = await engine.generate([1, 2, 3], sampling)
        new = {k: v + 0.01 for k, v in model.state_dict().items()}
        chunked = chunk_weights(new, 1 << 14)
        assert len(chunked.refs) > 1 and sorted(chunked) == sorted(new)
        await engine.update_weights(chunked, version=1)
        second = await engine.generate([1, 2, 3], sampling)
        assert engine.version == 1 and set(second.versions) == {1} and second.logprobs != first.logprobs
        partial = {k: v for k, v in new.items() if k != "norm.weight"}
        with pytest.raises(ray.exceptions.RayTaskError, match=r"misses 1 engine parameters: \['norm.weight'\]"):
            await engine.update_weights(partial, version=2)
        ray.kill(engine.actor, no_restart=True)
        with pytest.raises(ActorFailedError, match="engine replica 0 died") as info:
            await engine.generate([1, 2, 3], sampling)
        assert info.value.fatal_to_run  # the loop stops the run on it

    asyncio.run(scenario())
    assert torch.equal(model.norm.weight, small_model().norm.weight)  # the driver's copy is untouched


def test_a_placement_the_local_cluster_cannot_hold_fails_at_once(ray_cluster, monkeypatch):
    """This machine's cluster does not grow: asking it for GPUs it lacks (or more CPUs) is an error before any
    placement group is requested, not after two minutes of waiting in a call that Ctrl-C could not interrupt."""
    from molt.runtime import cluster
    from molt.runtime.cluster import Placement

    def never(*args, **kwargs):
        raise AssertionError("requested a placement group the cluster cannot hold")

    monkeypatch.setattr(cluster, "placement_group", never)
    gpus = parse_config(["--runtime.backend", "ray", "--runtime.gpus_per_actor", "1"]).runtime
    with pytest.raises(ActorFailedError, match=r"cannot place 2 actors of \{'CPU': 1.0, 'GPU': 1.0\}"):
        Placement(gpus, 2, local=True)
    cpus = parse_config(["--runtime.backend", "ray", "--runtime.cpus_per_actor", "5"]).runtime
    with pytest.raises(ActorFailedError, match="cannot place 2 actors"):
        Placement(cpus, 2, local=True)  # 10 of the fixture's 8 CPUs


def test_a_hung_replica_is_restarted_and_its_requests_sent_again(ray_cluster):
    """A replica that stops answering (SIGSTOP: alive, not dead) would stall the run for ever; the watcher kills it
    after `runtime.engine_timeout_s`, Ray restarts it, and the request waiting on it is sent again and answered."""
    import os
    import signal

    from molt.runtime.engines import RemoteEngine

    ray = ray_cluster
    cfg = parse_config(["--rollout.max_len", "63", "--rollout.max_in_flight", "2"])
    args = (cfg, ray.put(small_model()), None, 0)
    engine = RemoteEngine.spawn(0, {"num_cpus": 1, "max_restarts": 1}, args, version=0, chunk_bytes=1 << 14)
    sampling = SamplingParams(max_tokens=4, seed=1)

    async def scenario():
        expected = await engine.generate([1, 2, 3], sampling)
        watcher = asyncio.ensure_future(engine.watch(2.0))
        await asyncio.sleep(1.0)  # it has learnt where the replica runs
        _, pid = await engine.actor.process.remote()
        os.kill(pid, signal.SIGSTOP)
        again = await engine.generate([1, 2, 3], sampling)  # waits on the stopped replica until it is restarted
        watcher.cancel()
        assert engine.num_restarts == 1 and again.token_ids == expected.token_ids

    asyncio.run(scenario())
    ray.kill(engine.actor, no_restart=True)


def test_a_hung_trainer_rank_stops_the_run_naming_it(ray_cluster):
    """A rank that stops answering (SIGSTOP) while the driver waits on it: a clear error, not a wait for ever."""
    import os
    import signal

    from molt.runtime.ranks import RayTrainer

    ray = ray_cluster

    class Slow:
        @ray.method(concurrency_group="ping")
        def ping(self) -> int:
            return os.getpid()

        def work(self) -> int:
            import time

            time.sleep(60)
            return 1

    actor = ray.remote(concurrency_groups={"ping": 1})(Slow).options(num_cpus=1).remote()
    trainer = object.__new__(RayTrainer)  # the waiting and pinging only: no process group
    trainer.cfg = parse_config(["--runtime.backend", "ray", "--runtime.collective_timeout_s", "2"])
    trainer.ranks = [actor]
    os.kill(ray.get(actor.ping.remote()), signal.SIGSTOP)
    with pytest.raises(ActorFailedError, match=r"trainer step failed: trainer rank 0 \(molt-rank-0\) left a ping"):
        trainer._get([actor.work.remote()], "trainer step")
    ray.kill(actor, no_restart=True)
