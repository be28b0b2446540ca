"""The engine over the paged KV cache (`TorchEngine(kv_blocks=...)`) against the slot cache, `transformers` and the
trainer's log-probs on CPU: continuous batching, chunked prefill, shared prompts, preemption, weight swaps, sizing."""

import asyncio
import copy

import pytest
import torch
from conftest import random_hf, random_hf_in_molt  # noqa: I001 - tests/conftest.py
from engine_refs import prompts, trainer_logprobs
from test_dtypes import assert_greedy, assert_logprobs_close

from molt.engine import SamplingParams, TorchEngine
from molt.engine.blocks import BlockManager, OutOfBlocks, bytes_per_block
from molt.engine.sampling import sample_seed
from molt.engine.scheduler import Group


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return random_hf("qwen3"), random_hf_in_molt("qwen3", tmp_path_factory.mktemp("qwen3"))  # the same weights


def paged(model, kv_blocks=64, block_size=4, **kw) -> TorchEngine:
    """The paged engine as it runs on CUDA: decode-only steps through the graphed path (`graphs.py`, eager here)."""
    kw = dict(num_slots=8, max_seq_len=64, eos_token_ids=(), graphs=True) | kw
    return TorchEngine(model, kv_blocks=kv_blocks, block_size=block_size, **kw)


async def staggered(engine, requests, wait_steps=2):
    tasks = []
    for prompt, sampling in requests:
        tasks.append(asyncio.create_task(engine.generate(prompt, sampling)))
        start = engine.stats["steps"]
        while engine.stats["steps"] < start + wait_steps and not all(t.done() for t in tasks):
            await asyncio.sleep(0.001)
    return await asyncio.gather(*tasks)


def check_drained(engine: TorchEngine) -> None:
    blocks = engine.manager.blocks
    blocks.check()
    assert engine.manager.num_active == 0 and blocks.num_free_blocks() == blocks.num_blocks
    assert (engine.manager.tables_sm == blocks.num_blocks).all()  # every slot's block-table row back to padding


def test_greedy_matches_transformers_and_logprobs_the_trainer(models):
    hf, molt = models
    ps = prompts([5, 23, 1, 40, 9, 17])
    engine = paged(molt, num_slots=3, max_num_batched_tokens=16)  # few slots, chunked prefill, staggered
    greedy = SamplingParams(temperature=0, max_tokens=12)
    outs = asyncio.run(staggered(engine, [(p, greedy) for p in ps]))
    for p, out in zip(ps, outs, strict=True):
        ids = torch.tensor([p])
        with torch.no_grad():
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=12)
        assert out.token_ids == ref[0, len(p) :].tolist()
        assert (torch.tensor(out.logprobs) - trainer_logprobs(molt, p, out, 0)).abs().max() <= 1e-5
    check_drained(engine)
    asyncio.run(engine.close())


def test_shared_prompts_and_samples_equal_the_slot_cache(models):
    """n samples fork one prefill; separate requests for a prompt hit its computed blocks; a finished
    prompt's blocks stay cached for the next: every result equals the slot-cache engine's."""
    _, molt = models
    ps = prompts([9, 17, 30], seed=5)
    requests = [(ps[i % 3], SamplingParams(n=2, temperature=1.0, max_tokens=10, seed=100 + i)) for i in range(6)]

    def run(engine):
        async def go():
            groups = [asyncio.create_task(engine.generate_group(p, sp)) for p, sp in requests[:4]]
            await asyncio.gather(*groups)
            later = [asyncio.create_task(engine.generate_group(p, sp)) for p, sp in requests[4:]]
            return await asyncio.gather(*groups, *later)

        return asyncio.run(go())

    engine = paged(molt)
    outs = run(engine)
    ref = run(TorchEngine(molt, num_slots=8, max_seq_len=64, eos_token_ids=()))
    for (p, _), group, ref_group in zip(requests, outs, ref, strict=True):
        assert [c.token_ids for c in group] == [c.token_ids for c in ref_group]
        assert group[1].num_cached_tokens == len(p)  # the sibling forked the leader's prefill
        for c in group:
            assert (torch.tensor(c.logprobs) - trainer_logprobs(molt, p, c, 1.0)).abs().max() <= 1e-5
    assert outs[4][0].num_cached_tokens >= 4  # a finished request's full blocks were hit (block size 4)
    check_drained(engine)
    asyncio.run(engine.close())


def test_out_of_blocks_preempts_and_recomputes_exactly(models):
    _, molt = models
    ps = prompts([10, 7, 12, 9, 11, 6], seed=2)
    requests = [(p, SamplingParams(temperature=1.0, max_tokens=24, seed=i)) for i, p in enumerate(ps)]
    engine = paged(molt, kv_blocks=16, max_seq_len=48)  # 64 positions for 6 sequences growing to ~35
    outs = asyncio.run(staggered(engine, requests, wait_steps=1))
    assert engine.core.scheduler.num_preemptions > 0
    for (p, sp), out in zip(requests, outs, strict=True):
        alone = asyncio.run(TorchEngine(molt, num_slots=2, max_seq_len=48, eos_token_ids=()).generate(p, sp))
        assert out.token_ids == alone.token_ids
        assert (torch.tensor(out.logprobs) - trainer_logprobs(molt, p, out, 1.0)).abs().max() <= 1e-5
    check_drained(engine)
    asyncio.run(engine.close())


def test_a_cache_of_one_context_serves_sequences_one_at_a_time(models):
    """kv_blocks x block_size == max_seq_len: a preempted sequence that needs every block is readmitted alone."""
    _, molt = models
    ps = prompts([10, 12], seed=4)
    requests = [(p, SamplingParams(temperature=1.0, max_tokens=40, seed=i)) for i, p in enumerate(ps)]
    engine = paged(molt, kv_blocks=8, max_seq_len=32)
    outs = asyncio.run(staggered(engine, requests, wait_steps=1))
    assert engine.core.scheduler.num_preemptions > 0
    for (p, sp), out in zip(requests, outs, strict=True):
        alone = asyncio.run(TorchEngine(molt, num_slots=2, max_seq_len=32, eos_token_ids=()).generate(p, sp))
        assert out.token_ids == alone.token_ids and len(p) + len(out.token_ids) == 32
    check_drained(engine)
    asyncio.run(engine.close())


def test_groups_under_block_pressure_equal_the_slot_cache(models):
    """n = 3 samples per prompt with few blocks: forks that find no block prefill their sample themselves,
    preempted samples recompute; every sample equals the slot-cache engine's."""
    _, molt = models
    ps = prompts([13, 6, 9], seed=3)
    requests = [(p, SamplingParams(n=3, temperature=1.0, max_tokens=16, seed=7 + i)) for i, p in enumerate(ps)]

    def run(engine):
        async def go():
            return await asyncio.gather(*[engine.generate_group(p, sp) for p, sp in requests])

        return asyncio.run(go())

    engine = paged(molt, kv_blocks=12, max_seq_len=40)
    outs = run(engine)
    ref = run(TorchEngine(molt, num_slots=9, max_seq_len=40, eos_token_ids=()))
    assert engine.core.scheduler.num_preemptions > 0
    for (p, _), group, ref_group in zip(requests, outs, ref, strict=True):
        assert [c.token_ids for c in group] == [c.token_ids for c in ref_group]
        for c in group:
            assert (torch.tensor(c.logprobs) - trainer_logprobs(molt, p, c, 1.0)).abs().max() <= 1e-5
    check_drained(engine)
    asyncio.run(engine.close())


def test_a_fork_without_blocks_prefills_its_sample_itself(models, monkeypatch):
    """Blocks taken between a group's admission and the end of its prefill: the samples that cannot fork
    get blocks later and compute the prompt themselves (forced here: every other fork finds none)."""
    _, molt = models
    fork, calls = BlockManager.fork, []

    def starved_fork(self, *args, **kwargs):
        calls.append(args)
        if len(calls) % 2:
            raise OutOfBlocks("starved")
        return fork(self, *args, **kwargs)

    monkeypatch.setattr(BlockManager, "fork", starved_fork)
    p = prompts([11], seed=8)[0]
    sp = SamplingParams(n=4, temperature=1.0, max_tokens=8, seed=5)
    engine = paged(molt)
    group = asyncio.run(engine.generate_group(p, sp))
    ref = asyncio.run(TorchEngine(molt, num_slots=4, max_seq_len=64, eos_token_ids=()).generate_group(p, sp))
    assert len(calls) == 3 and [c.token_ids for c in group] == [c.token_ids for c in ref]
    for c in group:
        assert (torch.tensor(c.logprobs) - trainer_logprobs(molt, p, c, 1.0)).abs().max() <= 1e-5
    check_drained(engine)
    asyncio.run(engine.close())


def test_an_aborted_prefill_leaves_its_computed_blocks_to_the_next(models):
    """Driven step by step on the engine core: a group (n = 2, its sibling waiting) is aborted mid-way through
    its chunked prefill; the next request for the prompt starts from the full blocks computed so far."""
    _, molt = models
    p = prompts([30], seed=9)[0]
    engine = paged(molt, max_num_batched_tokens=8)  # the prompt's prefill takes 4 steps
    done = {}

    def submit(request_id: str, sp: SamplingParams) -> None:
        seeds = [sample_seed(sp.seed, i) for i in range(sp.n)]
        engine.core.add(Group(request_id, p, sp, seeds, lambda r: done.setdefault(request_id, r)))

    submit("first", SamplingParams(n=2, temperature=1.0, max_tokens=6, seed=4))
    engine.core.step()
    engine.core.step()
    leader, sibling = engine.core.scheduler.running
    assert sibling.waits_for is leader and leader.num_computed == 16
    engine.core.abort("first")
    sp = SamplingParams(temperature=1.0, max_tokens=6, seed=5)
    submit("second", sp)
    while engine.core.scheduler.has_work(True):
        engine.core.step()
    assert [c.finish_reason for c in done["first"]] == ["abort", "abort"]
    second = done["second"][0]
    alone = asyncio.run(TorchEngine(molt, num_slots=2, max_seq_len=64, eos_token_ids=()).generate(p, sp))
    assert second.token_ids == alone.token_ids and second.num_cached_tokens == 16
    assert (torch.tensor(second.logprobs) - trainer_logprobs(molt, p, second, 1.0)).abs().max() <= 1e-5
    check_drained(engine)


def test_recompute_swap_and_abort(models):
    _, molt = models
    ps = prompts([9, 17], seed=6)
    requests = [(ps[i % 2], SamplingParams(temperature=1.0, max_tokens=12, seed=50 + i)) for i in range(6)]
    engine = paged(molt, max_num_batched_tokens=12)
    weights = {k: v.clone() for k, v in molt.state_dict().items()}

    async def run():
        tasks = []
        for i, (p, sp) in enumerate(requests):
            tasks.append(asyncio.create_task(engine.generate(p, sp, request_id=str(i))))
            start = engine.stats["steps"]
            while engine.stats["steps"] < start + 1:
                await asyncio.sleep(0.001)
            if i in (2, 4):
                await engine.update_weights(weights, version=i, mode="interrupt")
            if i == 3:
                await engine.abort("1")
        return await asyncio.gather(*tasks)

    outs = asyncio.run(run())
    for i, ((p, sp), out) in enumerate(zip(requests, outs, strict=True)):
        if out.finish_reason == "abort":
            assert i == 1
            continue
        alone = asyncio.run(TorchEngine(molt, num_slots=2, max_seq_len=64, eos_token_ids=()).generate(p, sp))
        assert out.token_ids == alone.token_ids, i
        assert (torch.tensor(out.logprobs) - trainer_logprobs(molt, p, out, 1.0)).abs().max() <= 1e-5
    check_drained(engine)
    asyncio.run(engine.close())


def test_bf16_follows_the_model_and_the_trainer(models):
    """The paged path in bf16: n samples and chunked prefill, log-probs close to the trainer's packed scoring,
    greedy tokens the model's argmax (within the tolerances of `test_dtypes.py`)."""
    _, molt = models
    model = copy.deepcopy(molt).to(torch.bfloat16)
    engine = paged(model, max_num_batched_tokens=16)
    ps = prompts([7, 30, 12], seed=1)
    sampling = SamplingParams(n=2, temperature=1.0, max_tokens=12, seed=3)
    greedy = SamplingParams(temperature=0, max_tokens=12)

    async def run():
        groups = await asyncio.gather(*[engine.generate_group(p, sampling) for p in ps])
        return groups, await asyncio.gather(*[engine.generate(p, greedy) for p in ps])

    groups, greedy_outs = asyncio.run(run())
    outs = [c for group in groups for c in group]
    assert_logprobs_close(model, [p for p in ps for _ in range(2)], outs, 1.0, torch.bfloat16)
    for p, out in zip(ps, greedy_outs, strict=True):
        assert_greedy(model, p, out, torch.bfloat16)
    check_drained(engine)
    asyncio.run(engine.close())


def test_sizing_and_refusals(models, tmp_path):
    _, molt = models
    cfg = molt.cfg
    block_bytes = bytes_per_block(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 4, 16)
    engine = TorchEngine(molt, max_seq_len=64, kv_bytes=10 * block_bytes + 1)
    assert engine.manager.blocks.num_blocks == 10 and engine.core.runner.cache_bytes() == 10 * block_bytes
    with pytest.raises(ValueError, match="free CUDA memory"):
        TorchEngine(molt, kv_memory_fraction=0.5)
    with pytest.raises(ValueError, match="hold less than one sequence of 64 positions"):
        TorchEngine(molt, max_seq_len=64, kv_blocks=3)
    with pytest.raises(ValueError, match="the slot cache's decode step"):  # never a compile silently ignored
        TorchEngine(molt, max_seq_len=64, kv_blocks=64, compile=True)
    with pytest.raises(ValueError, match="dense text models"):
        TorchEngine(random_hf_in_molt("qwen3-moe", tmp_path), kv_blocks=64)


@pytest.mark.parametrize("kv_blocks", [None, 64], ids=["slots", "paged"])
def test_kv_kept_across_a_swap_never_reaches_a_new_request(models, kv_blocks):
    """kv_on_update="keep": a sequence running at the swap leaves no cached prefix (slot cache) and registers no
    block it fills later (paged); new requests over its tokens get exactly the new policy's log-probs."""
    _, molt = models
    new, gen = copy.deepcopy(molt), torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in new.parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=gen))
    kw = dict(kv_blocks=kv_blocks, block_size=4, num_slots=4, max_seq_len=64, eos_token_ids=(), kv_on_update="keep")
    engine = TorchEngine(copy.deepcopy(molt), **kw)
    p = prompts([12], seed=5)[0]

    async def run():
        task = asyncio.create_task(engine.generate(p, SamplingParams(max_tokens=30, seed=1)))
        while engine.stats["decode_tokens"] < 3:
            await asyncio.sleep(0.001)
        await engine.update_weights(dict(new.state_dict()), version=1)
        first = await task
        follow = p + first.token_ids[:-1]
        return first, follow, [await engine.generate(follow, SamplingParams(max_tokens=4, seed=2)) for _ in range(2)]

    first, follow, outs = asyncio.run(run())
    assert first.versions.index(1) > 0
    for out in outs:
        assert (torch.tensor(out.logprobs) - trainer_logprobs(new, follow, out, 1.0)).abs().max() <= 1e-5
    assert outs[1].num_cached_tokens > 0  # KV computed under the new weights is reused
    asyncio.run(engine.close())


def test_a_failed_step_leaves_no_unwritten_block_to_reuse(models):
    """A decode step that raises (e.g. CUDA out of memory) fails its request; the block that step would have
    filled never becomes a prefix: a later prompt extending that request's tokens is computed, not read."""
    _, molt = models
    p, greedy = prompts([6], seed=7)[0], SamplingParams(temperature=0, max_tokens=12)
    first = asyncio.run(TorchEngine(molt, max_seq_len=64, eos_token_ids=()).generate(p, greedy)).token_ids
    engine = paged(molt, graphs=False)
    forward = engine.core.runner.forward

    def failing_at_position_7(decode, *args):
        if any(position == 7 for *_, position in decode):  # the step that would fill block 1 (positions 4-7)
            engine.core.runner.forward = forward
            raise RuntimeError("out of memory")
        return forward(decode, *args)

    engine.core.runner.forward = failing_at_position_7
    with pytest.raises(RuntimeError, match="out of memory"):
        asyncio.run(engine.generate(p, greedy))
    assert engine.stats["step_errors"] == 1
    q = p + first[:2] + [5, 6, 7]
    out = asyncio.run(engine.generate(q, greedy))
    assert out.num_cached_tokens == 4  # block 0 only, written by the prefill
    assert (torch.tensor(out.logprobs) - trainer_logprobs(molt, q, out, 1.0)).abs().max() <= 1e-5
    check_drained(engine)


def test_a_drain_swap_waits_for_preempted_sequences(models):
    """`update_weights(mode="drain")` lets every admitted sequence finish on the old weights, those preempted for
    blocks included: no completion mixes versions (before the fix, a preempted one switched mid-way)."""
    _, molt = models
    new = copy.deepcopy(molt)
    with torch.no_grad():
        new.lm_head.weight.mul_(1.5)
    engine = paged(molt, kv_blocks=16, num_slots=4)

    async def run():
        tasks = [
            asyncio.create_task(engine.generate(p, SamplingParams(temperature=1.0, max_tokens=40, seed=i)))
            for i, p in enumerate(prompts([20, 20, 20], seed=1))
        ]
        while engine.core.scheduler.num_preemptions == 0:
            await asyncio.sleep(0.001)
        await engine.update_weights(dict(new.state_dict()), version=1, mode="drain")
        return await asyncio.gather(*tasks)

    outs = asyncio.run(run())
    assert [len(set(out.versions)) for out in outs] == [1, 1, 1]  # one not yet admitted runs on the new weights
    asyncio.run(engine.close())
