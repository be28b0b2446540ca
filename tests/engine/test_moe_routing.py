"""MoE routing capture: the engine's recorded experts equal a direct forward's, on every computed token.

Checked with continuous batching (staggered arrivals, chunked prefill, few slots), n > 1 siblings
sharing their prompt's prefill, prefix-cache reuse across requests, and an interrupt weight swap
with KV recompute (the record is then the new weights' routing, as the KV is).
"""

import asyncio
import copy

import torch
from conftest import small_model  # noqa: I001 - tests/conftest.py

from molt.engine import SamplingParams, TorchEngine
from molt.models import NO_ROUTE, Routing


def _model(seed=0):
    return small_model(seed, kind="moe", std=0.2, num_layers=3).eval()


@torch.no_grad()
def direct_routing(model, tokens):
    routing = Routing()
    model(torch.tensor([tokens]), routing=routing)
    return routing.chosen_nlk()


def assert_recorded_like_direct(model, prompt, completion):
    tokens = list(prompt) + completion.token_ids
    recorded = completion.routing
    assert recorded.shape == (len(tokens), model.cfg.num_moe_layers(), model.cfg.num_experts_per_tok)
    assert (recorded[-1] == NO_ROUTE).all()  # the last sampled token was never an input
    want = direct_routing(model, tokens)[:-1].sort(-1).values
    assert torch.equal(recorded[:-1].long().sort(-1).values, want)


def test_recorded_routing_equals_direct_forward_with_batching_siblings_and_prefix_reuse():
    model = _model()
    engine = TorchEngine(model, num_slots=6, max_seq_len=64, max_num_batched_tokens=12, eos_token_ids=(), seed=0)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 64, (n,), generator=gen).tolist() for n in (5, 19, 9, 27)]

    async def run():
        tasks = []
        for i, p in enumerate(prompts):  # staggered: requests join a running batch
            tasks.append(asyncio.create_task(engine.generate_group(p, SamplingParams(n=1 + i % 3, max_tokens=10 + i))))
            start = engine.stats["steps"]
            while engine.stats["steps"] < start + 2:
                await asyncio.sleep(0.001)
        groups = await asyncio.gather(*tasks)
        # a follow-up turn reuses the finished sequence's KV (prefix cache): its prefix routing comes along
        first = groups[1][0]
        follow = prompts[1] + first.token_ids + [7, 8, 9]
        again = await engine.generate(follow, SamplingParams(max_tokens=6))
        return groups, follow, again

    groups, follow, again = asyncio.run(run())
    for p, group in zip(prompts, groups, strict=True):
        for completion in group:
            assert_recorded_like_direct(model, p, completion)
    assert again.num_cached_tokens > 0
    assert_recorded_like_direct(model, follow, again)
    asyncio.run(engine.close())


def test_interrupt_recompute_records_the_new_weights_routing():
    old, new = _model(0), _model(1)
    engine = TorchEngine(copy.deepcopy(old), num_slots=2, max_seq_len=64, eos_token_ids=())
    prompt = list(range(3, 14))

    async def run():
        task = asyncio.create_task(engine.generate(prompt, SamplingParams(max_tokens=24, seed=5)))
        while engine.stats["decode_tokens"] < 6:
            await asyncio.sleep(0.001)
        await engine.pause()
        await engine.update_weights(new.state_dict(), version=1, mode="interrupt")
        await engine.resume()
        return await task

    out = asyncio.run(run())
    assert 0 < out.versions.index(1) < 24
    assert_recorded_like_direct(new, prompt, out)
    asyncio.run(engine.close())


def test_dense_models_and_disabled_capture_record_nothing():
    dense = small_model()
    moe = _model()

    async def one(model, **kw):
        engine = TorchEngine(model, num_slots=2, max_seq_len=32, eos_token_ids=(), **kw)
        out = await engine.generate([1, 2, 3], SamplingParams(max_tokens=4))
        await engine.close()
        return out

    assert asyncio.run(one(dense)).routing is None
    assert asyncio.run(one(moe, record_routing=False)).routing is None
