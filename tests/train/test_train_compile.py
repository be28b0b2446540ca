"""Regional compilation (`molt.train.compile`), checked on CPU: compiled layers and LM-head chunks give the eager
log-probs and gradients, with and without activation checkpointing, one compilation serving every layer."""

import copy

import pytest
import torch
from conftest import small_model as _model  # noqa: I001
from conftest import trainer_cfg as _cfg
from conftest import trajectories as _trajs
from torch._dynamo.utils import counters

from molt.models.attention import FlexPacked
from molt.train import logprobs
from molt.train.compile import CompiledForward, compile_layers, compile_model, resolve_compile
from molt.train.logprobs import token_logprobs_entropy
from molt.train.memory import checkpoint_layers
from molt.train.packing import Piece, collate
from molt.train.trainer import Trainer


def _batch(width=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = [[9, width - 9], [width - 5]]
    samples = [torch.randint(0, 64, (n,), generator=g).tolist() for row in lengths for n in row]
    masks = [[0] * 3 + [1] * (len(s) - 3) for s in samples]
    layout, i = [], 0
    for row in lengths:
        layout.append([Piece(i + k, 0, n) for k, n in enumerate(row)])
        i += len(row)
    return collate(samples, masks, layout)


def _logp_and_grads(model, batch, trained_only):
    model.zero_grad(set_to_none=True)
    logp, entropy = token_logprobs_entropy(model, batch, 0.7, trained_only=trained_only, chunk_tokens=16)
    ((logp * batch.loss_mask).sum() + 0.1 * entropy.sum()).backward()
    return logp.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.slow  # dynamo + AOT autograd tracing with dynamic shapes: ~15-25 s per case on 2 busy CPU cores
@pytest.mark.parametrize(("checkpointed", "steps"), [(False, [False, True]), (True, [True])])
def test_compiled_layers_and_head_match_eager(checkpointed, steps, monkeypatch):
    monkeypatch.setattr(logprobs, "REMAT_MIN", 0)  # the head's chunks recompute in backward, inside the graph
    torch._dynamo.reset()
    counters.clear()
    eager = _model()
    compiled = copy.deepcopy(eager)
    if checkpointed:
        checkpoint_layers(compiled)
    assert compile_model(compiled, backend="aot_eager") == len(compiled.layers)
    assert compile_layers(compiled, backend="aot_eager") == 0  # already compiled
    names = [n for n, _ in compiled.named_parameters()]
    assert names == [n for n, _ in eager.named_parameters()]  # parameter names unchanged
    for step, trained_only in enumerate(steps):
        batch = _batch(width=24 + 8 * step, seed=step)  # a new width: the dynamic-shape graphs serve it
        want, want_g = _logp_and_grads(eager, batch, trained_only)
        got, got_g = _logp_and_grads(compiled, batch, trained_only)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        for n in want_g:
            torch.testing.assert_close(got_g[n], want_g[n], atol=1e-5, rtol=1e-4, msg=n)
    # per step at most: the layers' graph, the last layer's trained-queries graph, two head-chunk sizes
    assert counters["stats"]["unique_graphs"] <= 4 * len(steps), dict(counters["stats"])


def test_one_compile_serves_every_layer_and_deep_copies_compile_the_copy():
    torch._dynamo.reset()
    counters.clear()
    model = _model()
    compile_layers(model, backend="eager")
    with torch.no_grad():
        model(torch.randint(0, 64, (2, 8)), doc_ids_bt=torch.tensor([[0] * 4 + [1] * 4, [0] * 8]))
    assert counters["stats"]["unique_graphs"] == 1 < len(model.layers), dict(counters["stats"])
    twin = copy.deepcopy(model)
    fwd = twin.layers[0].forward
    assert isinstance(fwd, CompiledForward) and fwd.forward.__self__ is twin.layers[0]
    with torch.no_grad():
        twin.layers[0].self_attn.o_proj.weight.zero_()
        ids = torch.randint(0, 64, (1, 8))
        assert not torch.equal(model(ids), twin(ids))  # the copy runs its own weights


def test_trainer_compile_flag_trains_like_eager():
    base = _model()
    flags = ("--train.lr", "1e-3")
    eager = Trainer(copy.deepcopy(base), _cfg(*flags, "--train.compile", "off"))
    on = ("--train.compile", "on", "--train.compile_backend", "eager")  # the wiring; numerics: the test above
    compiled = Trainer(copy.deepcopy(base), _cfg(*flags, *on))
    assert isinstance(compiled.model.layers[0].forward, CompiledForward)
    assert not isinstance(eager.model.layers[0].forward, CompiledForward)
    for step in range(2):
        a = eager.step(_trajs(base, num_groups=2, n=2, seed=step, version=eager.version))
        b = compiled.step(_trajs(base, num_groups=2, n=2, seed=step, version=compiled.version))
        assert abs(a["train/loss"] - b["train/loss"]) <= 1e-5, (a["train/loss"], b["train/loss"])
    for (n, p), q in zip(eager.model.named_parameters(), compiled.model.parameters(), strict=True):
        torch.testing.assert_close(q, p, atol=1e-5, rtol=1e-4, msg=n)


def test_resolve_compile():
    assert resolve_compile("auto", "cuda") and resolve_compile("auto", "cuda:1") and resolve_compile("on", "cpu")
    assert not resolve_compile("auto", "cpu") and not resolve_compile("off", "cuda")
    with pytest.raises(ValueError):
        resolve_compile("yes", "cpu")


def test_flex_block_mask_is_built_once_outside_the_layers():
    doc = torch.tensor([[0] * 10 + [1] * 6, [0] * 16])
    flex = FlexPacked(doc)
    assert flex.block_mask is not None  # built at construction: compiled layers only read it
    assert FlexPacked(torch.zeros(2, 16, dtype=torch.long)).block_mask is None  # one sample per row: SDPA causal


def test_flex_attention_traces_into_a_compiled_layer_without_graph_breaks():
    """CUDA's path (FlexAttention inside the compiled layers), forward, on CPU with dynamo's eager backend."""
    torch._dynamo.reset()
    counters.clear()
    model = _model()
    compiled = copy.deepcopy(model)
    compile_layers(compiled, backend="eager")
    ids, doc = torch.randint(0, 64, (2, 32)), torch.tensor([[0] * 10 + [1] * 22, [0] * 5 + [1] * 27])
    cols = torch.tensor([[3, 12, 20], [6, 7, 30]])
    with torch.no_grad():
        for outputs_bq in (None, cols):
            want = model(ids, doc_ids_bt=doc, attention="flex", outputs_bq=outputs_bq)
            got = compiled(ids, doc_ids_bt=doc, attention="flex", outputs_bq=outputs_bq)
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    assert not counters["graph_break"], dict(counters["graph_break"])


@pytest.mark.slow
def test_inductor_compiled_layer_matches_eager():
    """The real backend (CPU inductor, C++ kernels): one layer of a tiny model, forward and backward."""
    torch._dynamo.reset()
    eager = _model(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2)
    compiled = copy.deepcopy(eager)
    compile_layers(compiled)
    batch = _batch(width=16)
    want, want_g = _logp_and_grads(eager, batch, trained_only=False)
    got, got_g = _logp_and_grads(compiled, batch, trained_only=False)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for n in want_g:
        torch.testing.assert_close(got_g[n], want_g[n], atol=1e-5, rtol=1e-4, msg=n)


@pytest.mark.slow
def test_compiled_layers_under_fsdp2_train_like_eager():
    """The Ray rank path (compile in `Trainer`, then FSDP2 around it), one gloo rank in process: same step."""
    import socket

    from molt.train import parallel
    from molt.train.optim import build_optimizer

    base = _model()
    trajs = _trajs(base, num_groups=2, n=2)
    expected = Trainer(copy.deepcopy(base), _cfg("--train.compile", "off")).step(trajs)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    parallel.init_process_group(0, 1, "127.0.0.1", port)
    try:
        trainer = Trainer(copy.deepcopy(base), _cfg("--train.compile", "on", "--train.compile_backend", "eager"))
        parallel.parallelize(trainer.model)
        trainer.opt, trainer.schedule = build_optimizer(trainer.model.parameters(), trainer.cfg.train)
        assert isinstance(trainer.model.layers[0].forward, CompiledForward)
        got = trainer.step(trajs, shard=list(range(len(trajs))))
    finally:
        torch.distributed.destroy_process_group()
    for key in ("train/loss", "train/logprob_diff", "train/grad_norm"):
        assert got[key] == pytest.approx(expected[key], rel=1e-5, abs=1e-6), key
