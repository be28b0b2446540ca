"""Registries: lookup by name, duplicate protection, and the full set of variant names."""

import re

import pytest

from molt.algo import (
    AGGREGATIONS,
    ESTIMATORS,
    GROUP_FILTERS,
    IS_LEVELS,
    IS_MODES,
    KL_CONTROLLERS,
    KL_ESTIMATORS,
    POLICY_LOSSES,
    Registry,
)


def test_register_and_get_by_name():
    reg = Registry("widget")

    @reg.register("double", arity=1)
    def double(x):
        return 2 * x

    assert reg.get("double")(3) == 6
    assert reg.info("double") == {"arity": 1}
    assert "double" in reg and "triple" not in reg


def test_duplicate_name_is_rejected():
    reg = Registry("widget")
    reg.register("a")(lambda: 1)
    with pytest.raises(ValueError, match="widget 'a' is already registered"):
        reg.register("a")(lambda: 2)


def test_a_variant_without_its_familys_info_is_rejected_when_registered():
    from molt.algo import ESTIMATORS

    with pytest.raises(ValueError, match=r"advantage estimator 'mine': register it with whiten=\.\.\., needs="):
        ESTIMATORS.register("mine")(lambda inputs, params: None)
    assert "mine" not in ESTIMATORS


def test_an_estimator_returning_the_wrong_shapes_is_named():
    import torch

    from molt.algo import AdvantageInputs, compute_advantages

    ESTIMATORS.register("per_sample", whiten=False, needs=("rewards_b",), uses_kl=False, group_baseline=False)(
        lambda inputs, params: (inputs.rewards_b, inputs.rewards_b, {"n": 2.0})  # [B], not [B, T]
    )
    try:
        inputs = AdvantageInputs(torch.ones(2, 3), rewards_b=torch.tensor([1.0, 0.0]))
        shapes = re.escape("estimator 'per_sample' returned shapes [(2,), (2,), ('n', ())]")
        with pytest.raises(ValueError, match=shapes):
            compute_advantages("per_sample", inputs)
    finally:
        del ESTIMATORS._fns["per_sample"], ESTIMATORS._info["per_sample"]


def test_unknown_name_lists_the_choices():
    reg = Registry("widget")
    reg.register("b")(lambda: 1)
    reg.register("a")(lambda: 1)
    with pytest.raises(ValueError, match="unknown widget 'c'; choose one of: a, b"):
        reg.get("c")


def test_info_is_a_copy():
    reg = Registry("widget")
    reg.register("a", modes=("x",))(lambda: 1)
    reg.info("a")["modes"] = ("y",)
    assert reg.info("a") == {"modes": ("x",)}


@pytest.mark.parametrize(
    ("registry", "names"),
    [
        (
            ESTIMATORS,
            ["dr_grpo", "gae", "grpo", "on_policy_distill", "reinforce", "reinforce_baseline", "rloo"],
        ),
        (POLICY_LOSSES, ["cispo", "gspo", "pg", "ppo"]),
        (
            AGGREGATIONS,
            [
                "prompt-mean-token-mean",
                "seq-mean-token-mean",
                "seq-mean-token-sum",
                "seq-mean-token-sum-norm",
                "token-mean",
            ],
        ),
        (KL_ESTIMATORS, ["k1", "k2", "k3"]),
        (KL_CONTROLLERS, ["adaptive", "fixed"]),
        (IS_LEVELS, ["geo", "seq", "token"]),
        (IS_MODES, ["clip", "mask", "trunc"]),
        (GROUP_FILTERS, ["all-equal", "nonfinite", "score-range"]),
    ],
)
def test_every_variant_is_registered(registry, names):
    assert registry.names() == names
