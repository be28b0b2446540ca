"""The runtime interface: backends and engine kinds are registered variants; the local runtime places the
trainer and starts one engine from the factory that the loop drives through the engine interface only."""

import asyncio

import pytest
import torch
from conftest import IdleEngine, small_model  # noqa: I001 - tests/conftest.py

from molt.cli.main import parse_config
from molt.engine import SamplingParams, TorchEngine
from molt.runtime.base import RUNTIMES, LocalRuntime, start_runtime
from molt.runtime.factory import ENGINES, build_engine
from molt.train.trainer import Trainer


def test_backends_and_engines_are_registered_by_their_flag_names():
    assert RUNTIMES.names() == ["local", "ray"] and ENGINES.names() == ["torch", "vllm"]
    with pytest.raises(ValueError, match="unknown runtime.engine 'sglang'; choose one of: torch, vllm"):
        ENGINES.get("sglang")


def test_the_engine_factory_sizes_every_engine_by_one_formula():
    cfg = parse_config(["--rollout.max_len", "63", "--rollout.max_in_flight", "3"])
    model = small_model()
    engine = build_engine(cfg, model, None, threads=1, version=4)
    assert isinstance(engine, TorchEngine) and engine.version == 4
    assert engine.max_seq_len == 64 and engine.core.manager.num_slots == 6  # 2 x episodes in flight
    assert engine.model is not model  # a copy: the trainer keeps its own
    served = build_engine(cfg, model, None, threads=1, owned=True, num_slots=2, max_len=31)
    assert served.model is model and served.max_seq_len == 32 and served.core.manager.num_slots == 2


def test_local_runtime_places_the_trainer_and_an_engine_the_loop_can_drive():
    cfg = parse_config(["--rollout.max_len", "63", "--rollout.max_in_flight", "2"])
    runtime = start_runtime(cfg, small_model(), threads=1)
    assert isinstance(runtime, LocalRuntime) and isinstance(runtime.trainer, Trainer)
    assert runtime.metrics() == {}

    async def drive():
        engine = runtime.start_engines(None, runtime.trainer.version)
        await engine.generate([1, 2, 3], SamplingParams(max_tokens=3, seed=0))
        assert engine.stats["steps"] > 0  # declared on the interface; the built-in engine counts its work
        thread = await engine.run_on_engine_thread(lambda: torch.get_num_threads())
        await runtime.close()
        return thread

    assert asyncio.run(drive()) >= 1


def test_the_engine_interface_declares_what_an_engine_may_report():
    class Minimal(IdleEngine):  # only what the interface requires
        async def generate_group(self, prompt_token_ids, sampling=None, **kw):
            return []

    engine = Minimal()
    assert dict(engine.stats) == {}  # no counters: the loop reports no engine work
    assert asyncio.run(engine.run_on_engine_thread(lambda a, b: a + b, 2, 3)) == 5  # default: a worker thread


def test_a_dead_actor_is_named_before_its_peers_broken_connections(monkeypatch):
    """ray.get of several ranks raises the first failure in list order: when rank 1 died, rank 0's gloo error
    ("Connection closed by peer") hid which actor died."""
    import ray.exceptions

    from molt.runtime import cluster
    from molt.runtime.cluster import ActorFailedError

    failures = {"rank0": ray.exceptions.RaySystemError("gloo: Connection closed by peer"),
                "rank1": ray.exceptions.ActorDiedError()}  # fmt: skip

    def get(refs, timeout=None):
        raise failures["rank0"] if isinstance(refs, list) else failures[refs]

    monkeypatch.setattr(cluster.ray, "get", get)
    with pytest.raises(ActorFailedError, match=r"trainer step failed: an actor died \(its peers' errors follow from "
                       r"it\):\nThe actor died unexpectedly"):  # fmt: skip
        cluster.get(["rank0", "rank1"], "trainer step")
    failures["rank1"] = failures["rank0"]  # no death: the first failure, as before
    with pytest.raises(ActorFailedError, match=r"trainer step failed:\n.*gloo: Connection closed by peer"):
        cluster.get(["rank0", "rank1"], "trainer step")
