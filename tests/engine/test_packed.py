"""Prepacked linear weights and Molt's kernels in the engine (`molt/engine/cpu/packed.py`, `kernels.py`): the
kernels equal `F.linear`, softmax attention and `F.rms_norm` up to rounding, the packs are invisible outside the
engine's forward and never stale after an in-place weight load, and the engine stays exact (eager and compiled)."""

import asyncio
import contextlib
import copy

import pytest
import torch
from conftest import random_hf, random_hf_in_molt  # noqa: I001 - tests/conftest.py
from engine_refs import assert_old_then_new, prompts, swap_while_decoding, trainer_logprobs
from test_engine import staggered

from molt.engine import SamplingParams, TorchEngine
from molt.engine.cpu import kernels
from molt.engine.cpu.packed import MAX_ROWS, KernelRMSNorm, LinearPacks, PackedLinear
from molt.models import from_pretrained
from molt.models.transformer import RMSNorm

pytestmark = pytest.mark.skipif(not kernels.load(), reason="the kernels need x86 AVX2/FMA and a C++ compiler")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return tuple(random_hf_in_molt("qwen3", tmp_path_factory.mktemp(n), seed) for seed, n in enumerate("ab"))


@pytest.mark.parametrize("rows", [1, 5, 6, 7, 64, 301])
@pytest.mark.parametrize(("k", "n"), [(1, 1), (3, 16), (64, 17), (96, 250), (700, 48)])
def test_kernel_equals_linear_at_every_shape(rows, k, n):
    """Row counts around the 6-row tile, columns around the 16-column panel (padding), odd depths."""
    torch.manual_seed(rows * 1000 + k + n)
    x, w = torch.randn(2, rows, k), torch.randn(n, k)
    got = kernels.matmul(x, kernels.pack(w), n)
    assert got.shape == (2, rows, n)
    assert torch.allclose(got, torch.nn.functional.linear(x, w), rtol=1e-5, atol=1e-5 * k**0.5)


def test_kernel_refuses_what_it_would_misread():
    packed = kernels.pack(torch.randn(8, 16))
    for x, n in ((torch.randn(3, 15), 8), (torch.randn(3, 16, dtype=torch.float64), 8), (torch.randn(3, 16), 17)):
        with pytest.raises(RuntimeError, match="molt gemm"):
            kernels.matmul(x, packed, n)
    with pytest.raises(RuntimeError, match="molt gemm"):
        kernels.matmul(torch.randn(3, 8), packed.transpose(0, 1), 8)  # not the packed layout


@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(4, 2, 64), (3, 3, 17), (8, 1, 8), (6, 2, 40)])
@pytest.mark.parametrize("own_key", [False, True])
def test_decode_attention_equals_softmax_attention(heads, kv_heads, dim, own_key):
    """Rows at scattered slots and lengths (1 and the whole cache included), grouped kv heads (an odd group too),
    odd head sizes, with and without the row's own new key; scores with std 3, so the kernel's own exp sees a
    wide range."""
    torch.manual_seed(heads * 100 + dim)
    cache = torch.randn(2, 5, kv_heads, 23, dim)
    slots, lens = torch.tensor([3, 0, 4]), torch.tensor([0, 22, 9] if own_key else [1, 23, 9])
    q = torch.randn(3, heads, dim) * 3
    new = torch.randn(2, 3, kv_heads, dim) if own_key else [None, None]
    got = kernels.decode_attention(q, cache[0], cache[1], slots, lens, new[0], new[1])
    for b in range(3):
        keys, values = (c[slots[b], :, : lens[b]] for c in cache)
        if own_key:
            keys, values = torch.cat([keys, new[0][b, :, None]], 1), torch.cat([values, new[1][b, :, None]], 1)
        group = heads // kv_heads
        probs = torch.softmax(q[b, :, None] @ keys.repeat_interleave(group, 0).mT * dim**-0.5, -1)
        want = (probs @ values.repeat_interleave(group, 0))[:, 0]
        assert torch.allclose(got[b], want, rtol=1e-5, atol=1e-5)


def test_decode_attention_refuses_what_it_would_misread():
    k = torch.zeros(2, 1, 8, 4)
    q, one = torch.randn(1, 2, 4), torch.tensor([1])
    for slots, lens in ((torch.tensor([2]), one), (torch.tensor([0]), torch.tensor([9])), (one, torch.tensor([0]))):
        with pytest.raises(RuntimeError, match="molt decode_attention"):
            kernels.decode_attention(q, k, k, slots, lens)  # a slot or length past the cache; nothing to attend
    with pytest.raises(RuntimeError, match="molt decode_attention"):
        kernels.decode_attention(torch.randn(1, 2, 5), k, k, one, one)  # head size


def test_rms_norm_kernel_equals_torch_and_runs_only_inside_the_engine_forward():
    torch.manual_seed(0)
    for shape in ((3, 17), (5, 4, 64), (300, 256)):  # the last splits its rows over the threads
        x, w = torch.randn(shape) * 3, torch.randn(shape[-1])
        want = torch.nn.functional.rms_norm(x, (shape[-1],), w, 1e-6)
        assert torch.allclose(kernels.rms_norm(x, w, 1e-6), want, rtol=1e-6, atol=1e-6)
    with pytest.raises(RuntimeError, match="molt rms_norm"):
        kernels.rms_norm(torch.randn(2, 8), torch.randn(7), 1e-6)
    norm = RMSNorm(64, 1e-6)
    packs = LinearPacks(torch.nn.Sequential(torch.nn.Linear(64, 64), norm))
    assert type(norm) is KernelRMSNorm
    x = torch.randn(4, 64)

    def ops_run(inside: bool) -> tuple[torch.Tensor, set[str]]:
        with torch.profiler.profile() as prof, packs.active() if inside else contextlib.nullcontext():
            out = norm(x)
        return out, {e.name for e in prof.events()}

    (outside, outside_ops), (inside, inside_ops) = ops_run(False), ops_run(True)
    assert "molt_kernels::rms_norm" in inside_ops and "molt_kernels::rms_norm" not in outside_ops
    assert torch.allclose(inside, outside, rtol=1e-6, atol=1e-6)


def test_no_kernel_leaves_the_model_alone(monkeypatch, tmp_path):
    monkeypatch.setenv("MOLT_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    assert kernels.load.__wrapped__() is False  # a failed build is logged, not raised
    monkeypatch.setattr(kernels, "load", lambda: False)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8))
    LinearPacks(model)
    assert type(model[0]) is torch.nn.Linear


def test_packed_linear_is_plain_linear_outside_the_engine_and_follows_weight_loads():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.Linear(96, 32, bias=False))
    packs = LinearPacks(model)
    assert all(type(m) is PackedLinear for m in model)
    x = torch.randn(5, 64)

    def plain(x):
        return torch.nn.functional.linear(
            torch.nn.functional.linear(x, model[0].weight, model[0].bias), model[1].weight
        )

    ref = plain(x)
    assert torch.equal(model(x), ref)  # outside `active()`: the very same function, bit for bit
    model(x).sum().backward()  # and autograd works
    assert model[0].weight.grad is not None and model[0].packed is None
    with torch.inference_mode(), packs.active():
        assert (model(x) - ref).abs().max() <= 1e-5 and all(m.packed is not None for m in model)
        big = torch.randn(MAX_ROWS + 1, 64)
        assert torch.equal(model(big), plain(big))  # more rows than MAX_ROWS: sgemm
    with torch.no_grad():
        model[1].weight.mul_(-2.0)  # an in-place load: the packed copy must be redone
    with torch.inference_mode(), packs.active():
        assert (model(x) + 2 * ref).abs().max() <= 1e-5
    assert type(copy.deepcopy(model)[0]) is PackedLinear
    half = torch.nn.Sequential(torch.nn.Linear(8, 8)).to(torch.bfloat16)
    LinearPacks(half)
    assert type(half[0]) is torch.nn.Linear  # only fp32 CPU models are packed


def test_engine_with_packed_weights_matches_transformers_and_the_trainer(tmp_path):
    hf = random_hf("qwen3")
    hf.save_pretrained(tmp_path)
    model = from_pretrained(tmp_path).eval()
    engine = TorchEngine(model, num_slots=3, max_seq_len=96, max_num_batched_tokens=16, eos_token_ids=())
    ps = prompts([5, 23, 1, 40, 9, 17])
    greedy = SamplingParams(temperature=0, max_tokens=12)
    outs = asyncio.run(staggered(engine, [(p, greedy) for p in ps]))
    assert all(m.packed is not None for m in engine.core.runner.packs.layers)  # the packed path ran
    for p, out in zip(ps, outs, strict=True):
        ids = torch.tensor([p])
        with torch.no_grad():
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=12)
        assert out.token_ids == ref[0, len(p) :].tolist()
    group = asyncio.run(engine.generate_group(ps[3], SamplingParams(n=3, temperature=1.0, max_tokens=16, seed=7)))
    for c in group:
        assert (torch.tensor(c.logprobs) - trainer_logprobs(model, ps[3], c, 1.0)).abs().max() <= 1e-5
    asyncio.run(engine.close())


@pytest.mark.parametrize("compile", [False, True])
def test_packed_weights_follow_an_interrupt_swap(models, compile):
    """Eager, and compiled (whose graph multiplies by the packs): tokens after the swap are the new weights'."""
    old, new = models
    engine = TorchEngine(copy.deepcopy(old), num_slots=4, max_seq_len=96, eos_token_ids=(), compile=compile)
    ps = prompts([6, 11], seed=3)
    runner, compiled_steps = engine.core.runner, []
    if compile:
        step = runner.compiled.step
        runner.compiled.step = lambda *args: compiled_steps.append(1) or step(*args)
        with torch.inference_mode():  # the graph reads the packs, not the weights: zeroed packs give zero logits
            assert torch.count_nonzero(runner.compiled.step([1, 2], [3, 3], [0, 1])) > 0
            for layer in runner.packs.layers:
                layer.packed.zero_()
            assert torch.count_nonzero(runner.compiled.step([1, 2], [3, 3], [0, 1])) == 0
            for layer in runner.packs.layers:
                layer.packed_from = ()  # repacked on the next step
        # greedy tokens equal those of an eager engine holding the same (packed) weights
        eager = TorchEngine(copy.deepcopy(old), num_slots=4, max_seq_len=96, eos_token_ids=())
        greedy = SamplingParams(temperature=0, max_tokens=14)
        want, got = (asyncio.run(staggered(e, [(p, greedy) for p in ps])) for e in (eager, engine))
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        asyncio.run(eager.close())
    compiled_steps.clear()
    outs = asyncio.run(swap_while_decoding(engine, new, ps, SamplingParams(temperature=1.0, max_tokens=20, seed=5)))
    assert all(layer.packed is not None for layer in runner.packs.layers)  # the packed products ran
    assert bool(compiled_steps) == compile  # through the compiled graph when compiling
    assert_old_then_new(old, new, ps, outs, max_tokens=20)
    asyncio.run(engine.close())


@pytest.mark.parametrize("compile", [False, True])
def test_a_second_engine_over_the_same_model_packs_it_and_follows_its_weights(models, compile):
    """Engines made one after another over one model object (as the benchmark does): the later one packs the
    layers an earlier one swapped, and a weight change in between is seen (a compiled graph never reads a
    stale pack)."""
    old, new = models
    model, p = copy.deepcopy(old), prompts([9], seed=4)[0]
    greedy = SamplingParams(temperature=0, max_tokens=10)

    def tokens(m, compile=False):
        engine = TorchEngine(m, num_slots=2, max_seq_len=64, eos_token_ids=(), compile=compile)
        out = asyncio.run(engine.generate(p, greedy))
        asyncio.run(engine.close())
        assert engine.core.runner.packs.layers  # it packs (and refreshes) every linear layer
        return out.token_ids

    assert tokens(model, compile) == tokens(copy.deepcopy(old))
    with torch.no_grad():
        for dst, src in zip(model.parameters(), new.parameters(), strict=True):
            dst.copy_(src)
    assert tokens(model, compile) == tokens(copy.deepcopy(new))
