"""Router: least-loaded placement, session affinity, fan-out; and prefix reuse across turns on a replica."""

import asyncio

import pytest
from conftest import IdleEngine, random_hf_in_molt  # noqa: I001 - tests/conftest.py
from engine_refs import prompts

from molt.engine import SamplingParams, TorchEngine
from molt.engine.interface import Completion
from molt.engine.router import Router


class HeldEngine(IdleEngine):
    """Records what it was asked; every request waits until `release` is set."""

    def __init__(self):
        self.requests, self.updates, self.aborted = [], [], []
        self.release = asyncio.Event()

    async def generate_group(self, prompt_token_ids, sampling=None, *, request_id=None, session_id=None):
        sampling = sampling or SamplingParams()
        self.requests.append((request_id, session_id))
        await self.release.wait()
        return [Completion(request_id, [1], [0.0], [self.version], "length", len(prompt_token_ids))] * sampling.n

    async def abort(self, request_id):
        self.aborted.append(request_id)
        return True

    async def update_weights(self, weights, version, mode="interrupt"):
        self.updates.append((dict(weights), version, mode))
        self.version = version


def test_least_loaded_and_session_affinity():
    async def run():
        replicas = [HeldEngine() for _ in range(3)]
        router = Router(replicas)
        tasks = [asyncio.create_task(router.generate([1], request_id=f"r{i}")) for i in range(5)]
        tasks.append(asyncio.create_task(router.generate_group([1], SamplingParams(n=3), request_id="group")))
        await asyncio.sleep(0)
        assert router.load() == [2, 2, 4]  # 5 singles spread 2/2/1, then the group of 3 on the lightest
        # a session sticks to its first replica, even when that replica is the busiest
        first = asyncio.create_task(router.generate([1], session_id="episode", request_id="turn1"))
        await asyncio.sleep(0)
        home = router.place("episode")
        assert home == 0 and router.load() == [3, 2, 4]
        turns = [asyncio.create_task(router.generate([1], session_id="episode")) for _ in range(3)]
        await asyncio.sleep(0)
        assert router.load() == [6, 2, 4]
        assert await router.abort("turn1") and replicas[0].aborted == ["turn1"]
        assert not await router.abort("unknown")
        for r in replicas:
            r.release.set()
        await asyncio.gather(*tasks, first, *turns)
        assert router.load() == [0, 0, 0]
        await router.update_weights([("w", 1)], version=4, mode="drain")
        assert all(r.updates == [({"w": 1}, 4, "drain")] for r in replicas) and router.version == 4
        router.end_session("episode")
        assert router.place("episode") == 0  # placed afresh (all idle: lowest index)

    asyncio.run(run())


def test_sessions_are_forgotten_lru():
    router = Router([HeldEngine(), HeldEngine()], max_sessions=2)
    router._in_flight = [0, 5]
    assert [router.place(s) for s in ("a", "b", "c")] == [0, 0, 0]
    router._in_flight = [5, 0]
    assert router.place("a") == 1 and router.place("c") == 0  # "a" was evicted, "c" is remembered


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return random_hf_in_molt("qwen3", tmp_path_factory.mktemp("router"))


def test_second_turn_reuses_the_replicas_prefix_cache(model):
    replicas = [TorchEngine(model, num_slots=4, max_seq_len=96, eos_token_ids=()) for _ in range(2)]
    router = Router(replicas)
    sampling = SamplingParams(max_tokens=8, seed=0)
    turn1_prompt, observation = prompts([20, 6], seed=9)

    async def episode():
        turn1 = await router.generate(turn1_prompt, sampling, session_id="ep")
        turn2_prompt = turn1_prompt + turn1.token_ids + observation
        turn2 = await router.generate(turn2_prompt, sampling, session_id="ep")
        return turn1, turn2

    turn1, turn2 = asyncio.run(episode())
    assert turn1.num_cached_tokens == 0
    # all of turn 1 but its last sampled token (never fed back) is reused on the same replica
    assert turn2.num_cached_tokens == len(turn1_prompt) + len(turn1.token_ids) - 1
    assert sum(r.stats["steps"] > 0 for r in replicas) == 1
    deltas = []  # a streamed request streams from its replica: one delta per token, as the replica's own would
    (streamed,) = asyncio.run(router.generate_streamed(turn1_prompt, sampling, deltas.append, session_id="ep"))
    assert len(deltas) == len(streamed.token_ids) == 8 and [t for d in deltas for t in d.token_ids] == turn1.token_ids
    asyncio.run(router.close())


def test_request_ids_are_unique_in_a_process_and_in_a_forked_child():
    import os

    from molt.engine.interface import new_request_id

    ids = {new_request_id() for _ in range(1000)}
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child's next id, written back to the parent
        os.write(write, new_request_id().encode())
        os._exit(0)
    os.waitpid(pid, 0)
    child = os.read(read, 100).decode()
    assert len(ids) == 1000 and child not in ids | {new_request_id()}
