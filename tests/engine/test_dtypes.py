"""The engine in bf16 and fp16 on CPU (tiny shapes: CPU bf16 matmuls are slow): every path runs in the model's
dtype, and tokens and log-probs agree with the model's own forward, `transformers` and the trainer's scoring
(`token_logprobs` over its packing: fp32 from the logits) within the dtype's rounding.

Low-precision forwards of the same function may differ with the batch's shape (another summation order), so exact
equality is not the contract here: a greedy token must be the reference's argmax up to a small logit gap, and
log-probs must be close on average and at worst. Measured (bf16 / fp16, the worst of the two sampling settings):
on an x86 CPU without native bf16 instructions, mean |diff| 2.9e-4 / 2.2e-4, max 1.7e-2 / 4.9e-3, most bf16 tokens
exact; on one with AVX512-BF16 (AMD EPYC), where PyTorch's CPU attention rounds the probabilities to bf16 in some
shapes (a chunked prefill's) and not in others, bf16 1.5e-3 / 2.2e-2 here and, over this folder and test_paged.py,
means up to 5.0e-3 and maxima up to 3.3e-2. The bf16 bound covers both with margin and stays well under bf16's
own distance from fp32 (1.8e-2 mean on this model, benchmarks/bf16_consistency.py). The trainer's mixed
precision (fp32 master weights under autocast) computes the same function: tests/models/test_bf16_consistency.py.
"""

import asyncio
import copy

import pytest
import torch
from conftest import packed_trainer_logprobs, random_hf, small_model  # noqa: I001 - tests/conftest.py
from engine_refs import prompts, swap_while_decoding
from test_engine import staggered

from molt.engine import SamplingParams, TorchEngine
from molt.engine.sampling import RowParams, sample

DTYPES = [torch.bfloat16, torch.float16]
# (mean, max) |engine - trainer| log-prob bound, and the largest logit gap a greedy token may have to the argmax;
# bf16's allows CPUs whose attention kernel rounds differently with the shape (see the module docstring)
LOGPROB_TOL = {torch.bfloat16: (8e-3, 0.06), torch.float16: (1e-3, 0.01)}
GAP_TOL = {torch.bfloat16: 0.1, torch.float16: 0.02}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3")
    random_hf("qwen3").save_pretrained(path)
    return path


def model_in(folder, dtype: torch.dtype):
    from molt.models import from_pretrained

    return from_pretrained(folder).to(dtype).eval()


def assert_logprobs_close(model, ps, outs, temperature, dtype, tol=None):
    ref = packed_trainer_logprobs(model, ps, outs, temperature)
    diff = torch.cat([(torch.tensor(o.logprobs) - r).abs() for o, r in zip(outs, ref, strict=True)])
    mean_tol, max_tol = tol or LOGPROB_TOL[dtype]
    assert diff.mean() <= mean_tol and diff.max() <= max_tol, (diff.mean(), diff.max())


def assert_greedy(logits_fn, prompt, out, dtype):
    """Each greedy token is the argmax of `logits_fn`'s logits over prompt + completion, up to `GAP_TOL`."""
    ids = torch.tensor([prompt + out.token_ids])
    with torch.no_grad():
        logits = logits_fn(ids)[0, len(prompt) - 1 : -1].float()
    chosen = logits.gather(1, torch.tensor(out.token_ids)[:, None])[:, 0]
    assert (logits.max(-1).values - chosen).max() <= GAP_TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_greedy_follows_transformers_and_the_models_forward(folder, dtype):
    """Continuous batching (3 slots for 6 requests, chunked prefill, staggered) in the model's dtype."""
    model = model_in(folder, dtype)
    hf = random_hf("qwen3").to(dtype)
    engine = TorchEngine(model, num_slots=3, max_seq_len=96, max_num_batched_tokens=16, eos_token_ids=())
    assert engine.core.runner.k.dtype == dtype and not engine.core.runner.own_attention
    ps = prompts([5, 23, 1, 40, 9, 17])
    greedy = SamplingParams(temperature=0, max_tokens=12)
    outs = asyncio.run(staggered(engine, [(p, greedy) for p in ps]))
    for p, out in zip(ps, outs, strict=True):
        assert len(out.token_ids) == 12 and out.finish_reason == "length"
        assert_greedy(lambda ids: hf(ids).logits, p, out, dtype)
        assert_greedy(model, p, out, dtype)
    asyncio.run(engine.close())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.9)])
def test_logprobs_match_the_trainers_scoring(folder, dtype, temperature, top_p):
    model = model_in(folder, dtype)
    engine = TorchEngine(model, num_slots=8, max_seq_len=96, max_num_batched_tokens=24, eos_token_ids=())
    ps = prompts([7, 30, 12, 5], seed=1)
    sampling = SamplingParams(n=2, temperature=temperature, top_p=top_p, max_tokens=16, seed=3)

    async def run():
        return await asyncio.gather(*[engine.generate_group(p, sampling) for p in ps])

    groups = asyncio.run(run())
    outs = [c for group in groups for c in group]
    assert_logprobs_close(model, [p for p in ps for _ in range(2)], outs, temperature, dtype)
    asyncio.run(engine.close())


def test_fp32_trainer_weights_swap_into_a_bf16_engine(folder):
    """An interrupt swap of fp32 weights (the trainer's master copy) into a bf16 engine: cast in place, later
    tokens carry the new version and the new weights' log-probs."""
    old = model_in(folder, torch.bfloat16)
    new_fp32 = model_in(folder, torch.float32)
    with torch.no_grad():
        for p in new_fp32.parameters():
            p.mul_(1.1)
    engine = TorchEngine(copy.deepcopy(old), num_slots=4, max_seq_len=96, eos_token_ids=())
    ps = prompts([6, 11], seed=3)
    outs = asyncio.run(swap_while_decoding(engine, new_fp32, ps, SamplingParams(temperature=1.0, max_tokens=20)))
    new = new_fp32.to(torch.bfloat16)
    for p, out in zip(ps, outs, strict=True):
        switch = out.versions.index(1)
        assert 0 < switch < 20
        lp = torch.tensor(out.logprobs)
        old_ref, new_ref = (packed_trainer_logprobs(m, [p], [out], 1.0)[0] for m in (old, new))
        assert (lp[:switch] - old_ref[:switch]).abs().max() <= LOGPROB_TOL[torch.bfloat16][1]
        assert (lp[switch:] - new_ref[switch:]).abs().max() <= LOGPROB_TOL[torch.bfloat16][1]
    asyncio.run(engine.close())


def test_compiled_decode_in_bf16(folder):
    """The compiled decode step (one graph, softmax in fp32) in bf16: it runs, greedy tokens follow the model's
    argmax and sampled log-probs the trainer's. Fused kernels round differently from the eager model even with
    inductor emulating its casts: measured mean |diff| 1.1e-2, max 5.9e-2 here (the eager engine: 5.6e-3, 2.2e-2
    on the same request)."""
    dtype = torch.bfloat16
    model = model_in(folder, dtype)
    engine = TorchEngine(model, num_slots=4, max_seq_len=96, eos_token_ids=(), compile=True)
    steps = []
    step = engine.core.runner.compiled.step
    engine.core.runner.compiled.step = lambda *args: steps.append(len(args[0])) or step(*args)
    ps = prompts([5, 23, 9], seed=2)
    greedy = asyncio.run(staggered(engine, [(p, SamplingParams(temperature=0, max_tokens=14)) for p in ps]))
    assert engine.core.runner.compiled is not None and len(steps) > 10
    for p, out in zip(ps, greedy, strict=True):
        assert_greedy(model, p, out, dtype)
    group = asyncio.run(engine.generate_group(ps[1], SamplingParams(n=3, temperature=1.0, max_tokens=16, seed=7)))
    assert_logprobs_close(model, [ps[1]] * 3, group, 1.0, dtype, tol=(2e-2, 0.1))
    asyncio.run(engine.close())


def test_moe_in_bf16_records_routing_and_matches_the_trainer():
    """A tiny MoE in bf16 (router in fp32): log-probs within bf16 rounding of the trainer's (measured: mean 8e-8,
    max 5e-7 without native bf16 instructions; 3.5e-3, 1.8e-2 with AVX512-BF16), and the recorded experts agree
    with a direct forward's on nearly every entry (bf16 noise may flip a near-tie)."""
    from molt.models import Routing

    model = small_model(kind="moe", std=0.2).to(torch.bfloat16).eval()
    engine = TorchEngine(model, num_slots=4, max_seq_len=64, max_num_batched_tokens=12, eos_token_ids=())
    gen = torch.Generator().manual_seed(3)
    ps = [torch.randint(0, 64, (n,), generator=gen).tolist() for n in (5, 19, 9)]

    async def run():
        return await asyncio.gather(*[engine.generate(p, SamplingParams(max_tokens=10, seed=1)) for p in ps])

    outs = asyncio.run(run())
    assert_logprobs_close(model, ps, outs, 1.0, torch.bfloat16)
    agree = []
    for p, out in zip(ps, outs, strict=True):
        routing = Routing()
        with torch.no_grad():
            model(torch.tensor([p + out.token_ids]), routing=routing)
        want = routing.chosen_nlk()[:-1].sort(-1).values
        agree.append((out.routing[:-1].long().sort(-1).values == want).float().mean())
    assert min(agree) >= 0.9
    asyncio.run(engine.close())


def test_sampling_takes_low_precision_logits_as_the_trainer_does():
    """The sampler scores bf16 logits exactly as the trainer: fp32 upcast, / T, log-softmax."""
    logits = (torch.randn(3, 50, generator=torch.Generator().manual_seed(0)) * 4).to(torch.bfloat16)
    params = RowParams([0.7, 1.0, 0.0], [1.0, 0.9, 1.0], [0, 0, 5], [1, 2, 3], [4, 5, 6], [False] * 3, [(1, (7,))])
    tokens, logprobs = sample(logits, params)
    assert sample(logits.float(), params) == (tokens, logprobs)
    temperature = torch.tensor([0.7, 1.0, 1.0])[:, None]
    want = torch.log_softmax(logits.float() / temperature, -1).gather(1, torch.tensor(tokens)[:, None])[:, 0]
    assert torch.equal(torch.tensor(logprobs, dtype=torch.float32), want)
    assert tokens[2] == int(logits[2].float().argmax()) and tokens[1] != 7
