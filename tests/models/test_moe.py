"""MoE routing: replay semantics of `route`, the explicit `Routing` record, fp32 router, metric math."""

import pytest
import torch
import torch.nn.functional as F
from conftest import small_model  # noqa: I001 - tests/conftest.py

from molt import algo
from molt.models import NO_ROUTE, Routing, TransformerConfig
from molt.models.moe import SparseMoE, route


def test_route_replays_given_experts_with_live_gate_values():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.0, 3.0, 1.0, 2.0]], requires_grad=True)
    replay = torch.tensor([[3, 2], [NO_ROUTE, NO_ROUTE]])
    weights, experts = route(logits, 2, normalize=True, replay_nk=replay)
    probs = F.softmax(logits.detach(), -1)
    assert experts.tolist() == [[3, 2], [1, 3]]  # row 0 replayed, row 1 routed live
    expected0 = probs[0, [3, 2]] / probs[0, [3, 2]].sum()
    torch.testing.assert_close(weights[0], expected0)
    weights[0, 0].backward()  # the router still learns through the replayed experts' gate values
    assert logits.grad[0].abs().sum() > 0


def test_routing_record_and_self_replay_reproduce_the_forward():
    model = small_model(kind="moe", std=0.2)
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    live = Routing()
    with torch.no_grad():
        logits = model(ids, routing=live)
        plain = model(ids)
    assert len(live.chosen) == model.cfg.num_moe_layers() == 2
    assert live.chosen_nlk().shape == (18, 2, 2)
    torch.testing.assert_close(logits, plain, rtol=0, atol=0)
    assert all(torch.equal(c, v) for c, v in zip(live.chosen, live.live, strict=True))
    replayed = Routing(replay_nlk=live.chosen_nlk())
    with torch.no_grad():
        torch.testing.assert_close(model(ids, routing=replayed), plain, rtol=0, atol=1e-6)
    # replaying other experts changes the output, and chosen records what was used
    other = (live.chosen_nlk() + 1) % model.cfg.num_experts
    forced = Routing(replay_nlk=other)
    with torch.no_grad():
        assert not torch.allclose(model(ids, routing=forced), plain)
    assert torch.equal(forced.chosen_nlk(), other)


def test_fp32_router_in_a_bf16_model():
    torch.manual_seed(0)
    cfg = TransformerConfig(hidden_size=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16)
    moe = SparseMoE(cfg).to(torch.bfloat16)  # normalized top-k, fp32 router: the defaults
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(1, 50, 32).to(torch.bfloat16)
    routing = Routing()
    with torch.no_grad():
        out = moe(x, routing)
    assert out.dtype == torch.bfloat16 and routing.probs[0].dtype == torch.float32
    expected = F.softmax(F.linear(x.reshape(-1, 32).float(), moe.gate.weight.float()), -1)
    torch.testing.assert_close(routing.probs[0], expected)
    moe.fp32 = False
    low = Routing()
    with torch.no_grad():
        moe(x, low)
    assert low.probs[0].dtype == torch.bfloat16


def test_router_names_are_the_moe_gates_only():
    assert small_model(kind="moe").router_names() == ["layers.0.mlp.gate.weight", "layers.1.mlp.gate.weight"]
    assert small_model().router_names() == []


def test_routing_metrics_by_hand():
    live = torch.tensor([[0, 1], [2, 3], [1, 0], [3, 2]])
    recorded = torch.tensor([[1, 0], [2, 1], [1, 0], [NO_ROUTE, NO_ROUTE]])
    valid = torch.tensor([True, True, True, False])
    assert algo.routing_agreement(live, recorded, valid) == (2.0, 3.0)  # sets, not order
    load = algo.expert_load(live, valid, 4)
    assert load.tolist() == [2.0, 2.0, 1.0, 1.0]
    cv, max_over_mean = algo.load_imbalance(load)
    assert cv == pytest.approx(1 / 3) and max_over_mean == pytest.approx(4 / 3)
    uniform = torch.full((4, 4), 0.25)
    balanced = torch.tensor([[0, 1], [2, 3], [0, 1], [2, 3]])
    assert float(algo.load_balance_loss(uniform, balanced, torch.ones(4, dtype=torch.bool))) == pytest.approx(1.0)
    collapsed = torch.tensor([[1.0, 0, 0, 0]] * 4)
    all_zero = torch.tensor([[0, 1]] * 4)  # f = (0.5, 0.5, 0, 0), P = (1, 0, 0, 0)
    assert float(algo.load_balance_loss(collapsed, all_zero, torch.ones(4, dtype=torch.bool))) == pytest.approx(2.0)
