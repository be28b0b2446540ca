"""Weight swaps and versions: interrupt (recompute / keep KV), drain, HF and Molt names, bad updates."""

import asyncio
import copy

import pytest
import torch
from conftest import random_hf_in_molt  # noqa: I001 - tests/conftest.py
from engine_refs import prompts, trainer_logprobs

from molt.engine import SamplingParams, TorchEngine
from molt.models.hf_io import to_hf_state

MAX_TOKENS = 24


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(old, new): two MoE models with different random weights (MoE exercises the HF expert mapping)."""
    return tuple(random_hf_in_molt("qwen3-moe", tmp_path_factory.mktemp(n), seed) for seed, n in enumerate("ab"))


async def until_decoded(engine, num_tokens):
    while engine.stats["decode_tokens"] < num_tokens:
        await asyncio.sleep(0.001)


async def swap_mid_generation(engine, new_weights, prompt, sampling):
    step = engine.core.step_safely

    def step_then_pause(admit=True):  # paused by the engine thread itself: a busy machine cannot finish the request
        step(admit)
        engine._paused = engine.stats["decode_tokens"] >= 6

    engine.core.step_safely = step_then_pause
    task = asyncio.create_task(engine.generate(prompt, sampling))
    await until_decoded(engine, 6)
    engine.core.step_safely = step
    await engine.pause()  # a token boundary; the request stays in its slot
    await engine.update_weights(new_weights, version=1, mode="interrupt")
    await engine.resume()
    return await task


@pytest.mark.parametrize("kv_on_update", ["recompute", "keep"])
def test_interrupt_swaps_at_a_token_boundary(models, kv_on_update):
    old, new = models
    engine = TorchEngine(copy.deepcopy(old), num_slots=2, max_seq_len=64, eos_token_ids=(), kv_on_update=kv_on_update)
    cache_ptr, param_ptr = engine.core.runner.k.data_ptr(), engine.model.lm_head.weight.data_ptr()
    prompt = prompts([9], seed=4)[0]
    sampling = SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, seed=5)
    out = asyncio.run(swap_mid_generation(engine, to_hf_state(new), prompt, sampling))
    switch = out.versions.index(1)
    assert 0 < switch < MAX_TOKENS and out.versions == [0] * switch + [1] * (MAX_TOKENS - switch)
    assert engine.version == 1 and out.finish_reason == "length"
    # weights copied in place: neither the cache nor the parameters were reallocated
    assert engine.core.runner.k.data_ptr() == cache_ptr and engine.model.lm_head.weight.data_ptr() == param_ptr
    for got, want in zip(engine.model.state_dict().values(), new.state_dict().values(), strict=True):
        assert torch.equal(got, want)
    lp = torch.tensor(out.logprobs)
    assert (lp[:switch] - trainer_logprobs(old, prompt, out, 1.0)[:switch]).abs().max() <= 1e-5
    if kv_on_update == "recompute":  # later tokens are exactly the new policy's
        assert (lp[switch:] - trainer_logprobs(new, prompt, out, 1.0)[switch:]).abs().max() <= 1e-5
    asyncio.run(engine.close())


def test_drain_finishes_running_requests_first(models):
    old, new = models
    engine = TorchEngine(copy.deepcopy(old), num_slots=2, max_seq_len=64, eos_token_ids=())
    p1, p2 = prompts([7, 12], seed=6)
    sampling = SamplingParams(max_tokens=MAX_TOKENS, seed=1)

    async def run():
        first = asyncio.create_task(engine.generate(p1, sampling))
        await until_decoded(engine, 3)
        update = asyncio.create_task(engine.update_weights(dict(new.state_dict()), version=7, mode="drain"))
        await asyncio.sleep(0.01)
        second = asyncio.create_task(engine.generate(p2, sampling))  # waits for the swap
        done_first = await first
        assert not second.done()
        await update
        return done_first, await second

    a, b = asyncio.run(run())
    assert a.versions == [0] * MAX_TOKENS and b.versions == [7] * MAX_TOKENS
    assert (torch.tensor(a.logprobs) - trainer_logprobs(old, p1, a, 1.0)).abs().max() <= 1e-5
    assert (torch.tensor(b.logprobs) - trainer_logprobs(new, p2, b, 1.0)).abs().max() <= 1e-5


def test_partial_molt_named_update_and_bad_names(models):
    old, new = models
    engine = TorchEngine(copy.deepcopy(old), num_slots=2, max_seq_len=64, eos_token_ids=())
    part = {"norm.weight": new.norm.weight.detach(), "layers.1.mlp.gate_up_proj": new.layers[1].mlp.gate_up_proj}

    async def run():
        await engine.update_weights(part.items(), version=2)
        with pytest.raises(ValueError, match="unknown names .*nope"):
            await engine.update_weights({"nope.weight": torch.zeros(3)}, version=3)
        with pytest.raises(ValueError, match="shape mismatches"):
            await engine.update_weights({"norm.weight": torch.zeros(3)}, version=3)
        return await engine.generate(prompts([5])[0], SamplingParams(max_tokens=4))

    out = asyncio.run(run())
    assert torch.equal(engine.model.norm.weight, new.norm.weight)
    assert torch.equal(engine.model.layers[0].mlp.gate_up_proj, old.layers[0].mlp.gate_up_proj)
    assert engine.version == 2 and out.versions == [2] * 4  # the failed updates changed nothing
