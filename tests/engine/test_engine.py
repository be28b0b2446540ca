"""The torch engine against references: `transformers` greedy generate, trainer-side log-probs, seeds.

Random-weight tiny Qwen3 and Qwen3-MoE models are built by `transformers`, saved and loaded into
Molt (as the trainer would), so the engine is checked against an independent implementation.
"""

import asyncio

import pytest
import torch
from conftest import random_hf  # noqa: I001 - tests/conftest.py
from engine_refs import prompts, trainer_logprobs

from molt.engine import ContextLengthError, SamplingParams, TorchEngine
from molt.engine.interface import find_stop_string
from molt.models import from_pretrained
from molt.models.tokenizer import build_builtin_tokenizer


@pytest.fixture(scope="module", params=["qwen3", "qwen3-moe"])
def pair(request, tmp_path_factory):
    hf = random_hf(request.param)
    folder = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(folder)
    return hf, from_pretrained(folder).eval()


async def staggered(engine, requests, wait_steps=3):
    """Submit each (prompt, sampling) after the engine has taken `wait_steps` more steps."""
    tasks = []
    for prompt, sampling in requests:
        tasks.append(asyncio.create_task(engine.generate(prompt, sampling)))
        start = engine.stats["steps"]
        while engine.stats["steps"] < start + wait_steps and not all(t.done() for t in tasks):
            await asyncio.sleep(0.001)
    return await asyncio.gather(*tasks)


def torch_attention(engine: TorchEngine, kernel: bool) -> TorchEngine:
    """`kernel=False`: attention in torch ops over a compacted cache, as on a GPU (the CPU otherwise takes Molt's
    kernel, which reads each row's slot wherever it is)."""
    engine.core.runner.own_attention &= kernel
    engine.core.manager.compact = not engine.core.runner.own_attention
    return engine


@pytest.mark.parametrize("kernel", [True, False])
def test_greedy_matches_transformers_with_continuous_batching(pair, kernel):
    hf, molt = pair
    new_tokens = 12
    ps = prompts([5, 23, 1, 40, 9, 17])
    # 3 slots for 6 requests (some wait), a small token budget (long prompts are chunked), staggered arrival
    engine = TorchEngine(molt, num_slots=3, max_seq_len=96, max_num_batched_tokens=16, eos_token_ids=())
    torch_attention(engine, kernel)
    greedy = SamplingParams(temperature=0, max_tokens=new_tokens)
    outs = asyncio.run(staggered(engine, [(p, greedy) for p in ps]))
    for p, out in zip(ps, outs, strict=True):
        with torch.no_grad():
            ids = torch.tensor([p])
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new_tokens)
        ref = ref[0, len(p) :]
        assert out.token_ids == ref.tolist()
        assert out.finish_reason == "length" and out.num_prompt_tokens == len(p)
        assert out.versions == [0] * new_tokens
    assert engine.manager.num_active == 0
    asyncio.run(engine.close())


@pytest.mark.parametrize("kernel", [True, False])
@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.9)])
def test_logprobs_match_trainer_forward(pair, temperature, top_p, kernel):
    _, molt = pair
    engine = torch_attention(TorchEngine(molt, num_slots=8, max_seq_len=96, eos_token_ids=()), kernel)
    ps = prompts([7, 30, 12], seed=1)
    sampling = SamplingParams(n=2, temperature=temperature, top_p=top_p, max_tokens=16, seed=3)
    processed = SamplingParams(temperature=temperature, top_p=top_p, max_tokens=16, logprob_mode="processed")

    async def run():
        groups = await asyncio.gather(*[engine.generate_group(p, sampling) for p in ps])
        return groups, await engine.generate(ps[0], processed)

    groups, proc = asyncio.run(run())
    for p, group in zip(ps, groups, strict=True):
        assert group[0].token_ids != group[1].token_ids  # two samples, one prefill
        assert group[1].num_cached_tokens == len(p)
        for c in group:
            diff = (torch.tensor(c.logprobs) - trainer_logprobs(molt, p, c, temperature)).abs().max()
            assert diff <= 1e-5
    # "processed": the renormalised nucleus the token was drawn from
    ids = torch.tensor([ps[0] + proc.token_ids])
    with torch.no_grad():
        logits = molt(ids)[0, len(ps[0]) - 1 : -1] / temperature
    probs_sorted, order = torch.softmax(logits, -1).sort(-1, descending=True)
    keep = (probs_sorted.cumsum(-1) - probs_sorted) < top_p if top_p < 1 else torch.ones_like(probs_sorted, dtype=bool)
    nucleus = torch.zeros_like(logits, dtype=bool).scatter(1, order, keep)
    ref = torch.log_softmax(logits.masked_fill(~nucleus, float("-inf")), -1)
    ref = ref.gather(1, torch.tensor(proc.token_ids)[:, None])[:, 0]
    assert (torch.tensor(proc.logprobs) - ref).abs().max() <= 1e-5
    asyncio.run(engine.close())


def test_separate_requests_for_one_prompt_share_its_prefill(pair):
    _, molt = pair
    engine = TorchEngine(molt, num_slots=8, max_seq_len=96, eos_token_ids=())
    p = prompts([20], seed=4)[0]
    samplings = [SamplingParams(temperature=t, max_tokens=6, seed=s) for t, s in ((1.0, 1), (0.7, 2), (1.0, 3))]

    async def run():
        return await asyncio.gather(*[engine.generate(p, sp) for sp in samplings])

    outs = asyncio.run(run())
    assert engine.stats["prefill_tokens"] <= len(p) + 2 and sorted(o.num_cached_tokens for o in outs)[1:] >= [19, 19]
    for out, sp in zip(outs, samplings, strict=True):
        diff = (torch.tensor(out.logprobs) - trainer_logprobs(molt, p, out, sp.temperature)).abs().max()
        assert diff <= 1e-5
    alone = asyncio.run(TorchEngine(molt, num_slots=8, max_seq_len=96, eos_token_ids=()).generate(p, samplings[2]))
    assert alone.token_ids == outs[2].token_ids
    asyncio.run(engine.close())


def test_shared_prompts_survive_swaps_and_aborts_with_exact_results(pair):
    """Many requests for a few prompts, arriving staggered, through two recompute swaps (same weights,
    new version) and an abort: every finished one equals the same request run alone, log-probs included."""
    _, molt = pair
    ps = prompts([9, 17, 30], seed=5)
    requests = [(ps[i % 3], SamplingParams(temperature=1.0, max_tokens=12, seed=100 + i)) for i in range(12)]
    engine = TorchEngine(molt, num_slots=16, max_seq_len=96, max_num_batched_tokens=24, eos_token_ids=())
    weights = {k: v.clone() for k, v in molt.state_dict().items()}

    async def run():
        tasks = []
        for i, (p, sp) in enumerate(requests):
            tasks.append(asyncio.create_task(engine.generate(p, sp, request_id=str(i))))
            start = engine.stats["steps"]
            while engine.stats["steps"] < start + 1:
                await asyncio.sleep(0.001)
            if i in (4, 8):
                await engine.update_weights(weights, version=i, mode="interrupt")
            if i == 6:
                await engine.abort("5")
        return await asyncio.gather(*tasks)

    outs = asyncio.run(run())
    assert sum(o.num_cached_tokens > 0 for o in outs) >= 6  # most requests copied a shared prompt
    for i, ((p, sp), out) in enumerate(zip(requests, outs, strict=True)):
        if out.finish_reason == "abort":
            assert i == 5
            continue
        alone = asyncio.run(TorchEngine(molt, num_slots=2, max_seq_len=96, eos_token_ids=()).generate(p, sp))
        assert out.token_ids == alone.token_ids, i
        assert (torch.tensor(out.logprobs) - trainer_logprobs(molt, p, out, 1.0)).abs().max() <= 1e-5
    assert engine.manager.num_active == 0 and not engine.core.scheduler.owners
    asyncio.run(engine.close())


def test_seeded_sampling_is_reproducible_whatever_the_batch(pair):
    _, molt = pair
    ps = prompts([6, 11, 25], seed=2)
    seeded = SamplingParams(temperature=1.0, top_k=20, max_tokens=10, seed=42)

    async def alone():
        engine = TorchEngine(molt, num_slots=4, max_seq_len=64, eos_token_ids=())
        return await engine.generate(ps[0], seeded)

    async def crowded():
        engine = TorchEngine(molt, num_slots=4, max_seq_len=64, eos_token_ids=())
        others = [engine.generate(p, SamplingParams(max_tokens=10)) for p in ps[1:]]
        outs = await asyncio.gather(*others, engine.generate(ps[0], seeded), engine.generate(ps[0], seeded))
        return outs[-2:]

    first = asyncio.run(alone())
    again, twice = asyncio.run(crowded())
    assert first.token_ids == again.token_ids == twice.token_ids
    other_seed = asyncio.run(TorchEngine(molt, eos_token_ids=()).generate(ps[0], SamplingParams(max_tokens=10, seed=7)))
    assert other_seed.token_ids != first.token_ids


class CharTokenizer:  # id i decodes to chr(65 + i % 26)
    eos_token_id = None

    def decode(self, ids):
        return "".join(chr(65 + i % 26) for i in ids)


def test_a_stop_string_counts_when_the_newest_token_completes_it():
    """Checked after each token: an occurrence that ended earlier (ignored before min_tokens) stops nothing."""
    tok = CharTokenizer()
    assert find_stop_string(tok, ["B"], [0, 1, 2]) is None  # "ABC"
    assert find_stop_string(tok, ["X", "BC"], [0, 1, 2]) == "BC"
    assert find_stop_string(tok, ["B"], [0, 1, 2, 1]) == "B"


def test_a_stop_string_of_multi_byte_characters_is_found_by_a_byte_level_tokenizer():
    """A CJK character or an emoji is 3-4 byte tokens: the tail window counts bytes, not characters."""
    tok = build_builtin_tokenizer()
    for stop in ("日本語です", "🙂🙂🙂", "END"):
        ids = tok(f"abc {stop} xyz", add_special_tokens=False)["input_ids"]
        found = [k for k in range(1, len(ids) + 1) if find_stop_string(tok, [stop], ids[:k])]
        assert found and tok.decode(ids[: found[0]]).endswith(stop), stop


def test_stop_tokens_min_tokens_and_stop_strings(pair):
    _, molt = pair
    engine = TorchEngine(molt, num_slots=4, max_seq_len=64, eos_token_ids=())
    p = prompts([8], seed=3)[0]
    free = asyncio.run(engine.generate(p, SamplingParams(temperature=0, max_tokens=12)))
    stop_at = free.token_ids[4]
    first = free.token_ids.index(stop_at)
    stopped = asyncio.run(engine.generate(p, SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_at])))
    assert stopped.token_ids == free.token_ids[: first + 1]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop_at
    late = asyncio.run(
        engine.generate(p, SamplingParams(temperature=0, max_tokens=12, min_tokens=6, stop_token_ids=[stop_at]))
    )
    assert len(late.token_ids) >= 6 and stop_at not in late.token_ids[:6]

    text = CharTokenizer().decode(free.token_ids)
    engine = TorchEngine(molt, tokenizer=CharTokenizer(), num_slots=2, max_seq_len=64, eos_token_ids=())
    by_string = asyncio.run(engine.generate(p, SamplingParams(temperature=0, max_tokens=12, stop=[text[5:7]])))
    assert by_string.finish_reason == "stop" and by_string.stop_reason == text[5:7]
    assert by_string.token_ids == free.token_ids[: text.index(text[5:7]) + 2]


def test_abort_frees_cache_and_too_long_fails_cleanly(pair):
    _, molt = pair
    engine = TorchEngine(molt, num_slots=2, max_seq_len=48, eos_token_ids=())

    async def run():
        long = asyncio.create_task(engine.generate(prompts([5])[0], SamplingParams(max_tokens=40), request_id="x"))
        while engine.stats["decode_tokens"] < 3:
            await asyncio.sleep(0.001)
        assert await engine.abort("x") and not await engine.abort("nope")
        aborted = await long
        cancelled = asyncio.create_task(engine.generate(prompts([5])[0], SamplingParams(max_tokens=40)))
        await asyncio.sleep(0.01)
        cancelled.cancel()
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        with pytest.raises(ContextLengthError, match="max_seq_len=48"):
            await engine.generate(list(range(48)), SamplingParams())
        with pytest.raises(ValueError, match="prompt_token_ids must be integers, got float"):
            await engine.generate([1, 1.5], SamplingParams())  # was truncated to token 1, silently
        with pytest.raises(ValueError, match=r"got str; a tokenizer's output \(a mapping\): pass its \['input_ids'\]"):
            await engine.generate({"input_ids": [1, 2], "attention_mask": [1, 1]}, SamplingParams())
        at_limit = await engine.generate(list(range(40)), SamplingParams(max_tokens=30))
        return aborted, at_limit

    aborted, at_limit = asyncio.run(run())
    assert aborted.finish_reason == "abort" and 0 < len(aborted.token_ids) < 40
    assert at_limit.finish_reason == "length" and at_limit.num_prompt_tokens + len(at_limit.token_ids) == 48
    assert engine.manager.num_active == 0 and engine.num_pending() == 0
    asyncio.run(engine.close())


def test_work_since_counts_between_snapshots_and_after_a_restart():
    from molt.engine.interface import work_since

    a = dict(steps=10, decode_steps=8, decode_tokens=40, busy_s=1.0, decode_s=0.5)
    b = dict(steps=14, decode_steps=10, decode_tokens=52, busy_s=1.5, decode_s=0.75)
    assert work_since(b, a) == pytest.approx({"busy_s": 0.5, "decode_s": 0.25, "decode_batch_mean": 6.0})
    assert work_since(a, {}) == pytest.approx({"busy_s": 1.0, "decode_s": 0.5, "decode_batch_mean": 5.0})
    restarted = dict(steps=2, decode_steps=1, decode_tokens=3, busy_s=0.25, decode_s=0.0)  # a new replica: from 0
    assert work_since(restarted, b) == pytest.approx({"busy_s": 0.25, "decode_s": 0.0, "decode_batch_mean": 3.0})
    assert work_since(b, b)["decode_batch_mean"] == 0
