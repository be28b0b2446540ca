"""Trainer at GPU scale, checked on CPU: mixed precision, activation checkpointing, chunked log-probs,
the FlexAttention packed backend against SDPA, entropy and the fresh-token log-prob diff."""

import copy

import pytest
import torch
from test_trainer import _cfg, _model, _trajs  # noqa: I001 - tests/train/test_trainer.py

from molt.config import ConfigError, check_device
from molt.models.attention import FlexPacked, PackedCausal
from molt.train import logprobs
from molt.train.logprobs import head_logprobs, token_logprobs_entropy
from molt.train.memory import checkpoint_layers
from molt.train.precision import Precision
from molt.train.trainer import Trainer


def _losses(flags, steps=5):
    base = _model()
    trainer = Trainer(copy.deepcopy(base), _cfg("--train.lr", "1e-3", *flags))
    losses = []
    for step in range(steps):
        losses.append(trainer.step(_trajs(base, seed=step, version=trainer.version))["train/loss"])
    return losses, trainer


def test_bf16_mixed_matches_fp32_and_keeps_fp32_master_weights():
    fp32, _ = _losses(["--model.dtype", "float32"])
    mixed, trainer = _losses(["--model.dtype", "bfloat16"])
    assert trainer.precision.mixed and trainer.precision.compute == torch.bfloat16
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())
    assert all(s.dtype == torch.float32 for st in trainer.opt.state.values() for s in st.values() if s.numel() > 1)
    assert fp32 != mixed  # the forward really ran in bf16
    for a, b in zip(fp32, mixed, strict=True):  # losses here are ~0.005-0.2; bf16 moves them by <1e-3
        assert abs(a - b) <= 3e-3, (fp32, mixed)
    _, pure = _losses(["--model.dtype", "bfloat16", "--train.precision", "pure"], steps=1)
    assert all(p.dtype == torch.bfloat16 for p in pure.model.parameters())


def test_fp16_mixed_scales_the_loss_and_trains():
    losses, trainer = _losses(["--model.dtype", "float16"], steps=2)
    assert trainer.scaler is not None and all(torch.isfinite(torch.tensor(losses)))
    assert trainer.num_skipped_steps <= 1  # the first scale may overflow once


def _logp_and_grads(model, trainer, trajs):
    mbs = trainer.micro_batches(trajs)
    model.zero_grad()
    logp, entropy = token_logprobs_entropy(model, mbs[0].packed, 0.9, trained_only=True, chunk_tokens=7)
    (logp.sum() + 0.1 * entropy.sum()).backward()
    return logp.detach(), entropy.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("remat_min", [0, 1 << 24])  # 0: every chunk's logits are recomputed in backward
def test_checkpointing_and_chunks_give_the_same_logprobs_and_gradients(monkeypatch, remat_min):
    monkeypatch.setattr(logprobs, "REMAT_MIN", remat_min)
    base = _model()
    trajs = _trajs(base, same_prompt=True)
    trainer = Trainer(copy.deepcopy(base), _cfg())
    plain = copy.deepcopy(base)
    logp, ent, grads = _logp_and_grads(plain, trainer, trajs)
    mbs = trainer.micro_batches(trajs)
    whole = token_logprobs_entropy(plain, mbs[0].packed, 0.9, trained_only=True, chunk_tokens=1 << 20)
    assert (whole[0] - logp).abs().max() <= 1e-6 and (whole[1] - ent).abs().max() <= 1e-6
    remat = copy.deepcopy(base)
    assert checkpoint_layers(remat) == len(remat.layers)
    logp2, ent2, grads2 = _logp_and_grads(remat, trainer, trajs)
    assert (logp - logp2).abs().max() <= 1e-6 and (ent - ent2).abs().max() <= 1e-6
    for g, g2 in zip(grads, grads2, strict=True):
        assert (g - g2).abs().max() <= 1e-6


def test_head_logprobs_are_log_softmax_and_entropy():
    head = torch.nn.Linear(8, 11, bias=False)
    h = torch.randn(9, 8)
    targets = torch.randint(0, 11, (9,))
    logp, entropy = head_logprobs(head, h, targets, 0.5, chunk_tokens=4)
    ref = torch.log_softmax(head(h) / 0.5, -1)
    assert torch.allclose(logp, ref.gather(1, targets[:, None])[:, 0], atol=1e-6)
    assert torch.allclose(entropy, -(ref.exp() * ref).sum(-1), atol=1e-6)


def test_trainer_reports_entropy_and_fresh_logprob_diff():
    model = _model()
    trainer = Trainer(model, _cfg("--train.activation_checkpointing", "--train.logprob_chunk_tokens", "5"))
    metrics = trainer.step(_trajs(model))
    assert metrics["train/logprob_diff_fresh"] <= 1e-5 and metrics["train/fresh_tokens"] > 0
    assert metrics["train/entropy"] > 0


def _packed_inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    doc = torch.tensor([[0] * 6 + [1] * 5 + [2] * 4 + [-1, -2, -3], [0] * 10 + [1] * 8])
    parent = torch.tensor([[0] * 6 + [0] * 5 + [0] * 4 + [-1, -2, -3], [0] * 10 + [1] * 8])  # row 0 shares doc 0
    q, k, v = (torch.randn(2, h, 18, 16, generator=g) for h in (4, 2, 2))
    return doc, parent, q, k, v


@pytest.mark.parametrize("with_parent", [False, True])
def test_flex_backend_agrees_with_sdpa(with_parent):
    doc, parent, q, k, v = _packed_inputs()
    parent = parent if with_parent else None
    ref = PackedCausal(doc, parent)(0, q, k, v)
    out = FlexPacked(doc, parent)(0, q, k, v)
    assert (out - ref).abs().max() <= 1e-5
    cols = torch.tensor([[3, 7, 12, 14], [0, 9, 10, 17]])
    q_sel = q.gather(2, cols[:, None, :, None].expand(-1, 4, -1, 16))
    ref_sel = PackedCausal(doc, parent).select_queries(cols)(0, q_sel, k, v)
    out_sel = FlexPacked(doc, parent).select_queries(cols)(0, q_sel, k, v)
    assert (out_sel - ref_sel).abs().max() <= 1e-5


def test_model_logprobs_through_flex_equal_sdpa():
    base = _model()
    trajs = _trajs(base, same_prompt=True)
    packed = Trainer(copy.deepcopy(base), _cfg()).micro_batches(trajs)[0].packed
    with torch.no_grad():
        kwargs = dict(doc_ids_bt=packed.doc_ids, parent_ids_bt=packed.parent_ids)
        sdpa = base(packed.input_ids, packed.position_ids, **kwargs, attention="sdpa")
        flex = base(packed.input_ids, packed.position_ids, **kwargs, attention="flex")
    assert (sdpa - flex).abs().max() <= 1e-5


def test_device_errors_are_config_errors():
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="runtime.device: 'cuda' but CUDA is not available"):
            check_device("cuda")
    with pytest.raises(ConfigError, match="bad device index"):
        check_device("cpu:x")
    assert Precision.of("auto", "mixed", "cpu") == Precision()
