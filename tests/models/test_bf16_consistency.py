"""One function in low precision: the trainer's mixed-precision forward (fp32 master weights under autocast) is
the forward of the low-precision copy the engine serves, op for op, and the engine's log-probs follow it
(benchmarks/bf16_consistency.py measures it). Tiny shapes: CPU bf16 matmuls are slow.
"""

import asyncio
import copy

import pytest
import torch
from conftest import packed_trainer_logprobs  # noqa: I001 - tests/conftest.py

from molt.engine import SamplingParams, TorchEngine
from molt.models import Routing, Transformer, TransformerConfig, preset
from molt.train.precision import Precision

DTYPES = [torch.bfloat16, torch.float16]
SMALL = dict(vocab_size=97, hidden_size=48, intermediate_size=80, num_layers=2, num_heads=4, num_kv_heads=2,
             head_dim=12, tie_word_embeddings=False)  # fmt: skip


def master(cfg: TransformerConfig, seed: int = 0) -> Transformer:
    """fp32 weights of std 0.2 (logits of a few units) and norm weights 1 +- 0.1 (their rounding matters)."""
    model = Transformer(cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            scale, shift = (0.1, 1.0) if "norm" in name else (0.2, 0.0)
            p.copy_(torch.randn(p.shape, generator=gen) * scale + shift)
    return model.eval()


def both_forwards(model: Transformer, dtype: torch.dtype, *args, **kwargs):
    """(the fp32 master's forward under the trainer's autocast, the low-precision copy's forward)."""
    with torch.no_grad():
        with Precision(dtype, torch.float32, "cpu").autocast():
            mixed = model(*args, **kwargs)
        return mixed, copy.deepcopy(model).to(dtype)(*args, **kwargs)


@pytest.mark.parametrize("dtype", DTYPES)
def test_autocast_forward_is_the_low_precision_copys_forward(dtype):
    """Bitwise: the residual stream, norms (weights cast to the activations' dtype) and rotary tables of the
    autocast forward are those of the copy, packed rows included."""
    model = master(TransformerConfig(model_type="qwen3", **SMALL))
    ids = torch.randint(0, 97, (2, 30), generator=torch.Generator().manual_seed(1))
    doc_ids = torch.tensor([[0] * 12 + [1] * 18, [0] * 30])
    positions = torch.cat([torch.arange(12), torch.arange(18)]).expand(2, -1).contiguous()
    positions[1] = torch.arange(30)
    mixed, pure = both_forwards(model, dtype, ids, positions, doc_ids_bt=doc_ids)
    assert mixed.dtype == pure.dtype == dtype
    assert torch.equal(mixed, pure)


def test_rotary_frequencies_stay_fp32_through_casts():
    """`.to(bf16)` (the engine's copy) and `to_empty` keep exact fp32 frequencies (bf16 ones turn position p's
    angles by ~p * 2^-9 rad)."""
    model = Transformer(preset("tiny"))
    want = model.inv_freq.clone()
    assert torch.equal(model.to(torch.bfloat16).inv_freq, want)
    assert torch.equal(Transformer(preset("tiny")).to("meta").to_empty(device="cpu").inv_freq, want)


def test_moe_router_stays_fp32_under_autocast():
    """The router's matmul and softmax run in fp32 under the trainer's autocast as in the bf16 copy: same logits,
    same expert choices."""
    cfg = TransformerConfig(model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                            **SMALL)  # fmt: skip
    model = master(cfg)
    ids = torch.randint(0, 97, (1, 25), generator=torch.Generator().manual_seed(2))
    routings = Routing(), Routing()
    with torch.no_grad():
        with Precision(torch.bfloat16, torch.float32, "cpu").autocast():
            mixed = model(ids, routing=routings[0])
        pure = copy.deepcopy(model).to(torch.bfloat16)(ids, routing=routings[1])
    assert all(p.dtype == torch.float32 for p in routings[0].probs + routings[1].probs)
    assert torch.equal(mixed, pure)
    assert torch.equal(routings[0].chosen_nlk(), routings[1].chosen_nlk())


def test_vlm_autocast_forward_is_the_copys_forward():
    cfg = preset("tiny-vlm", vocab_size=64, num_layers=1, image_token_id=63)
    model = master(cfg)
    per_image = cfg.vision.tokens_per_image
    ids = torch.tensor([[1, 2] + [63] * per_image + [3, 4, 5]])
    pixels = torch.randint(0, 256, (1, 3, cfg.vision.image_size, cfg.vision.image_size), dtype=torch.uint8)
    mixed, pure = both_forwards(model, torch.bfloat16, ids, pixel_values=pixels)
    assert torch.equal(mixed, pure)


def scored(model: Transformer, pairs, precision: Precision) -> torch.Tensor:
    """The trainer's log-probs of every completion token (`packed_trainer_logprobs`) under `precision`."""
    with precision.autocast():
        return torch.cat(packed_trainer_logprobs(model, [p for p, _ in pairs], [c for _, c in pairs], 1.0))


@pytest.mark.parametrize("paged", [False, True])
def test_engine_logprobs_follow_the_mixed_precision_trainer_in_bf16(paged):
    """A bf16 engine (slot or paged cache; continuous batching, chunked prefill) against the trainer scoring its
    tokens with the fp32 master under autocast: most tokens exact, the rest is CPU SDPA's summation order."""
    model = master(TransformerConfig(model_type="qwen3", **SMALL))
    kv = dict(kv_blocks=64, block_size=16) if paged else {}
    engine = TorchEngine(copy.deepcopy(model).to(torch.bfloat16), num_slots=4, max_seq_len=96,
                         max_num_batched_tokens=24, eos_token_ids=(), seed=0, **kv)  # fmt: skip
    gen = torch.Generator().manual_seed(1)
    ps = [torch.randint(0, 97, (n,), generator=gen).tolist() for n in (5, 23, 40, 9, 17, 31)]
    sampling = SamplingParams(n=2, temperature=1.0, max_tokens=24, seed=3)

    async def run():
        return await asyncio.gather(*[engine.generate_group(p, sampling) for p in ps])

    pairs = [(p, c) for p, group in zip(ps, asyncio.run(run()), strict=True) for c in group]
    asyncio.run(engine.close())
    engine_lp = torch.cat([torch.tensor(c.logprobs) for _, c in pairs])
    diff = (engine_lp - scored(model, pairs, Precision(torch.bfloat16, torch.float32, "cpu"))).abs()
    assert diff.mean() <= 1e-3 and diff.max() <= 3e-2, (diff.mean(), diff.max())
    assert (diff == 0).float().mean() >= 0.5
