"""The compiled decode step (`TorchEngine(compile=True)`): the same tokens and log-probs as the eager engine
and the trainer, including after an in-place weight swap. One compilation (~25 s on 2 cores) serves the file."""

import asyncio
import copy

import pytest
import torch
from conftest import random_hf_in_molt  # noqa: I001 - tests/conftest.py
from engine_refs import assert_old_then_new, prompts, swap_while_decoding, trainer_logprobs
from test_engine import staggered, torch_attention

from molt.engine import SamplingParams, TorchEngine

SLOTS, MAX_LEN = 4, 96


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return tuple(random_hf_in_molt("qwen3", tmp_path_factory.mktemp(n), seed) for seed, n in enumerate("ab"))


def compiled_engine(model, **kwargs):
    """A compiling engine recording the batch size of each compiled decode step in `engine.compiled_steps`."""
    engine = TorchEngine(model, num_slots=SLOTS, max_seq_len=MAX_LEN, eos_token_ids=(), compile=True, **kwargs)
    runner, engine.compiled_steps = engine.core.runner, []
    step = runner.compiled.step

    def counted(ids, positions, slots):
        engine.compiled_steps.append(len(ids))
        return step(ids, positions, slots)

    runner.compiled.step = counted
    return engine


@pytest.mark.parametrize("kernel", [True, False])
def test_compiled_decode_matches_the_eager_engine_and_the_trainer(models, kernel):
    model, _ = models
    ps = prompts([5, 23, 1, 40, 9, 17], seed=2)
    greedy = SamplingParams(temperature=0, max_tokens=14)
    eager = TorchEngine(model, num_slots=SLOTS, max_seq_len=MAX_LEN, max_num_batched_tokens=16, eos_token_ids=())
    want = asyncio.run(staggered(torch_attention(eager, kernel), [(p, greedy) for p in ps]))
    engine = torch_attention(compiled_engine(model, max_num_batched_tokens=16), kernel)  # chunked prefills mixed
    got = asyncio.run(staggered(engine, [(p, greedy) for p in ps]))
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert len(engine.compiled_steps) > 10 and max(engine.compiled_steps) == SLOTS  # not just the warm-up
    sampling = SamplingParams(n=3, temperature=1.0, max_tokens=16, seed=7)
    group = asyncio.run(engine.generate_group(ps[3], sampling))
    for c in group:
        assert (torch.tensor(c.logprobs) - trainer_logprobs(model, ps[3], c, 1.0)).abs().max() <= 1e-5
    asyncio.run(engine.close())
    asyncio.run(eager.close())


def test_compiled_decode_sees_weights_swapped_in_place(models):
    old, new = models
    engine = compiled_engine(copy.deepcopy(old))
    ps = prompts([6, 11], seed=3)
    sampling = SamplingParams(temperature=1.0, max_tokens=20, seed=5)

    steps_before = len(engine.compiled_steps)
    outs = asyncio.run(swap_while_decoding(engine, new, ps, sampling))
    assert len(engine.compiled_steps) > steps_before + 10
    assert_old_then_new(old, new, ps, outs, max_tokens=20)
    asyncio.run(engine.close())


def test_a_lone_request_decodes_compiled_and_never_writes_cache_row_1(models):
    """One decoding row runs through the graph padded to two; the pad reads its own slot (Molt's kernel) or cache
    row 1 (a view of rows 0..1), and never writes either."""
    model, _ = models
    p = prompts([9], seed=4)[0]
    greedy = SamplingParams(temperature=0, max_tokens=12)
    eager = TorchEngine(model, num_slots=SLOTS, max_seq_len=MAX_LEN, eos_token_ids=())
    want = asyncio.run(eager.generate(p, greedy))
    engine = compiled_engine(model, prefix_cache=False)
    asyncio.run(engine.generate(prompts([5], seed=5)[0], greedy))  # the engine thread is up and warmed
    runner, steps_before = engine.core.runner, len(engine.compiled_steps)
    runner.k[:, 1].normal_()  # stands in for another sequence's cached keys and values
    runner.v[:, 1].normal_()
    row_1 = runner.k[:, 1].clone(), runner.v[:, 1].clone()
    got = asyncio.run(engine.generate(p, greedy))
    assert got.token_ids == want.token_ids
    assert engine.compiled_steps[steps_before:].count(1) >= 10
    assert torch.equal(runner.k[:, 1], row_1[0]) and torch.equal(runner.v[:, 1], row_1[1])
    sampled = asyncio.run(engine.generate(p, SamplingParams(temperature=1.0, max_tokens=12, seed=3)))
    assert (torch.tensor(sampled.logprobs) - trainer_logprobs(model, p, sampled, 1.0)).abs().max() <= 1e-5
    asyncio.run(engine.close())
    asyncio.run(eager.close())
