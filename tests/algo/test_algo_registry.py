"""Registries: lookup by name, duplicate protection, and the full set of variant names."""

import re
import sys

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


@pytest.mark.parametrize(
    ("register", "problem"),
    [
        (lambda: ESTIMATORS.register("e", whiten="no", needs=(), uses_kl=False, group_baseline=False), "whiten='no'"),
        (
            lambda: ESTIMATORS.register("e", whiten=False, needs=("reward_b",), uses_kl=False, group_baseline=False),
            "needs=('reward_b',) must be a tuple of names from",
        ),  # fmt: skip
        (
            lambda: ESTIMATORS.register("e", whiten=False, needs="rewards_b", uses_kl=False, group_baseline=False),
            "needs='rewards_b'",
        ),  # fmt: skip
        (
            lambda: ESTIMATORS.register("e", whiten=0, needs=(), uses_kl=False, group_baseline=False, reads=("gama",)),
            "reads=('gama',)",
        ),  # fmt: skip
        (lambda: POLICY_LOSSES.register("e", pg_at_ratio_one=1), "pg_at_ratio_one=1 must be True or False"),
        (lambda: AGGREGATIONS.register("e", needs_norm_len="yes"), "needs_norm_len='yes'"),
        (lambda: IS_LEVELS.register("e", modes="mask"), "modes='mask' must be a tuple"),
        (lambda: GROUP_FILTERS.register("auto"), "'auto' is --rollout.filters' own word"),
    ],
)
def test_a_variants_info_is_checked_when_registered(register, problem):
    """A typo in a registration would silently change behaviour (a truthy string whitens; a misspelt `needs` field
    fails at the first step): it is an error naming the variant and the value."""
    with pytest.raises(ValueError, match=f"'(e|auto)': {re.escape(problem)}"):
        register()(lambda *a, **k: None)
    assert "e" not in ESTIMATORS and "e" not in POLICY_LOSSES and "auto" not in GROUP_FILTERS


@pytest.mark.parametrize(("value", "problem"), [(float("nan"), "NaN or inf advantages on 6"), (1, "torch.int64")])
def test_an_estimator_returning_non_finite_or_integer_advantages_is_named(value, problem):
    """NaN advantages trained nothing (every token dropped as non-finite, the run went on); integer ones were
    truncated."""
    import torch

    from molt.algo import AdvantageInputs, compute_advantages

    ESTIMATORS.register("odd", whiten=False, needs=(), uses_kl=False, group_baseline=False)(
        lambda inputs, params: (torch.full((2, 3), value), torch.zeros(2, 3), {})
    )
    try:
        with pytest.raises(ValueError, match=f"estimator 'odd' returned {problem}"):
            compute_advantages("odd", AdvantageInputs(torch.ones(2, 3)))
    finally:
        del ESTIMATORS._fns["odd"], ESTIMATORS._info["odd"]


def test_non_finite_critic_values_are_named_as_the_critics():
    import torch

    from molt.algo import AdvantageInputs, compute_advantages

    inputs = AdvantageInputs(
        torch.ones(1, 3), rewards_b=torch.ones(1), values_bt=torch.tensor([[0.0, float("nan"), 0]])
    )
    with pytest.raises(ValueError, match="the critic's values are NaN or inf on 1 action tokens"):
        compute_advantages("gae", inputs)


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


@pytest.mark.parametrize(
    ("make", "problem"),
    [
        (lambda torch: ("filter", lambda s, g, p: torch.zeros(len(s), dtype=torch.bool)), "returned torch.bool (4,)"),
        (lambda torch: ("filter", lambda s, g, p: torch.zeros(g.num_groups)), "returned torch.float32 (2,)"),
        (lambda torch: ("loss", lambda lp, old, a, m, p: ((lp * a).sum(1), {})), "returned a torch.float32 (2,)"),
        (lambda torch: ("agg", lambda loss, m, d, **k: loss.sum(1)), "returned (2,): need a scalar"),
    ],
)
def test_own_variants_returning_the_wrong_thing_are_named(make, problem):
    """A filter's drop mask per rollout instead of per group, a float mask, a per-sample policy loss, a per-sample
    aggregation: each is an error naming the variant (they were torch errors from Molt's internals, or trained)."""
    import torch

    from molt.algo import (
        ObjectiveParams,
        PolicyBatch,
        filter_groups,
        policy_objective,
        step_denominators,
    )

    kind, fn = make(torch)
    registry = {"filter": GROUP_FILTERS, "loss": POLICY_LOSSES, "agg": AGGREGATIONS}[kind]
    registry.register("own")(fn)
    try:
        with pytest.raises(ValueError, match=f"'own' {re.escape(problem)}"):
            if kind == "filter":
                filter_groups(torch.tensor([1.0, 0.0, 1.0, 1.0]), torch.tensor([0, 0, 1, 1]), filters=("own",))
            else:
                mask = torch.ones(2, 3)
                batch = PolicyBatch(torch.zeros(2, 3, requires_grad=True), mask, torch.ones(2, 3))
                params = ObjectiveParams(**{"policy_loss" if kind == "loss" else "loss_agg": "own"})
                policy_objective(batch, step_denominators([mask]), params)
    finally:
        del registry._fns["own"], registry._info["own"]


def test_plugins_register_variants_the_config_then_knows(tmp_path):
    """`--algo.plugins my_algo.py`: the command line knows your own names (before, only the Python API did), a
    failing plugin names its file and line, and config.yaml records the file's absolute path (resume, replay)."""
    from molt import make_config
    from molt.cli.main import parse_config
    from molt.config import ConfigError
    from molt.user_code import import_user_module

    plugin, broken = tmp_path / "my_variants.py", tmp_path / "broken.py"
    plugin.write_text(
        "from molt import algo\n\n"
        "@algo.GROUP_FILTERS.register('low-var')\n"
        "def drop_low_var(scores_r, groups, params):\n"
        "    return groups.group_reduce(scores_r, 'amax') - groups.group_reduce(scores_r, 'amin') < 0.1\n"
    )
    broken.write_text(
        "from molt import algo\nalgo.GROUP_FILTERS.register('half')(lambda s, g, p: s)\nraise RuntimeError('no')\n"
    )
    try:
        cfg = parse_config(["--algo.plugins", str(plugin), "--rollout.filters", "low-var", "nonfinite"])
        assert cfg.rollout.filters == ("low-var", "nonfinite") and "low-var" in GROUP_FILTERS
        assert cfg.file_form()["algo"]["plugins"] == [str(plugin.resolve())]
        again = parse_config(["--algo.plugins", str(plugin), "--rollout.filters", "low-var"])  # imported once
        assert again.rollout.filters == ("low-var",)
        assert import_user_module(str(plugin)) is import_user_module(str(plugin))  # also as a reward file: run once
        for _ in range(2):  # the same error again, not "'half' is already registered" (a config file's retry)
            with pytest.raises(ConfigError, match=f"importing .* failed at {re.escape(str(broken))}:3: RuntimeError"):
                make_config({"algo.plugins": [str(broken)]})
    finally:
        for name in ("low-var", "half"):
            GROUP_FILTERS._fns.pop(name, None)
            GROUP_FILTERS._info.pop(name, None)
        sys.modules.pop("molt_agent_my_variants", None)


NAN = float("nan")


@pytest.mark.parametrize(
    ("kind", "fn", "problem"),
    [
        ("loss", lambda lp, old, a, m, p: (lp * NAN, {}), "returned NaN or inf on 6 action tokens"),
        ("loss", lambda lp, old, a, m, p: (-a * lp, {"w": a[0]}), "returned metric 'w' of shape (3,): need a 0-dim"),
        ("agg", lambda loss, m, d, **k: loss.sum() / 0.0, "returned inf from per-token losses finite"),
        ("kl", lambda x: x * NAN, "returned NaN or inf on 6 action tokens"),
        ("kl", lambda x: x.mean(), "returned a torch.float32 (): need a per-token float KL shaped like its log-ratio"),
    ],
)
def test_own_variants_returning_nan_or_a_scalar_kl_are_named_with_their_flag(kind, fn, problem):
    """A policy loss, aggregation or KL estimator returning NaN on action tokens skipped every optimizer step and
    ended "done" with unchanged weights; a KL estimator's scalar broadcast and trained a negative KL; a per-token
    metric failed in float(). Each is now an error naming the variant and its flag."""
    import torch

    from molt.algo import ObjectiveParams, PolicyBatch, policy_objective, step_denominators

    registry, field, flag = {"loss": (POLICY_LOSSES, "policy_loss", "algo.policy_loss"),
                             "agg": (AGGREGATIONS, "loss_agg", "algo.loss_agg"),
                             "kl": (KL_ESTIMATORS, "kl_estimator", "algo.kl_estimator")}[kind]  # fmt: skip
    registry.register("own")(fn)
    try:
        mask = torch.ones(2, 3)
        logp = torch.full((2, 3), -1.0, requires_grad=True)
        batch = PolicyBatch(logp, mask, -torch.ones(2, 3), ref_logp_bt=torch.full((2, 3), -1.5))
        params = ObjectiveParams(**{field: "own"}, kl_loss_coef=0.1)
        with pytest.raises(ValueError, match=f"'own' {re.escape(problem)}.*\\(--{flag} own\\)"):
            policy_objective(batch, step_denominators([mask]), params)
    finally:
        del registry._fns["own"], registry._info["own"]


def test_a_variant_that_cannot_be_called_as_its_family_calls_it_is_refused_when_registered(tmp_path):
    """A policy loss without `params`, an aggregation without `**_` for the keywords: bare TypeErrors at the first
    step ("takes 4 positional arguments but 5 were given"); now refused at registration, and from a plugin a config
    error naming its file and line."""
    from molt import make_config
    from molt.config import ConfigError

    with pytest.raises(
        ValueError, match=r"policy loss 'four': <lambda>\(lp, old, a, m\) cannot be called as fn\(logp_bt, "
    ):
        POLICY_LOSSES.register("four")(lambda lp, old, a, m: (lp, {}))
    with pytest.raises(ValueError, match="loss aggregation 'plain': .* unexpected keyword argument 'group_ids_b'"):
        AGGREGATIONS.register("plain")(lambda loss_bt, mask_bt, denoms: loss_bt.sum())
    assert "four" not in POLICY_LOSSES and "plain" not in AGGREGATIONS
    plugin = tmp_path / "short_kl.py"
    plugin.write_text("from molt import algo\n\n\n@algo.KL_ESTIMATORS.register('k0')\ndef k0():\n    return 0\n")
    try:
        problem = "ValueError: KL estimator 'k0': k0\\(\\) cannot be called as fn\\(log_ratio_bt\\)"
        with pytest.raises(
            ConfigError, match=f"algo.plugins: importing .* failed at {re.escape(str(plugin))}:4: {problem}"
        ):
            make_config({"algo.plugins": [str(plugin)]})
    finally:
        sys.modules.pop("molt_agent_short_kl", None), sys.modules.pop("short_kl", None)


def test_an_edited_plugin_imported_again_replaces_its_own_variants(tmp_path):
    """A notebook edits its plugin and builds the config again: the file ran anew but its names were refused ("policy
    loss 'clip_cov' is already registered (by clip_cov)"). A new version from the same file now replaces them; a
    name taken by another file, or a built-in one, is still refused."""
    import os

    from molt import make_config
    from molt.config import ConfigError

    plugin, other, builtin = tmp_path / "nb_algo.py", tmp_path / "other_algo.py", tmp_path / "my_ppo.py"
    source = (
        "from molt import algo\n\nSCALE = {}\n\n\n@algo.POLICY_LOSSES.register('clip_cov')\n"
        "def clip_cov(logp_bt, old_logp_bt, advantages_bt, mask_bt, params):\n    return -SCALE * logp_bt, {{}}\n"
    )
    other.write_text(source.format(3.0))
    builtin.write_text(source.format(1.0).replace("'clip_cov'", "'ppo'"))
    modules = ("molt_agent_nb_algo", "nb_algo", "molt_agent_other_algo", "other_algo", "molt_agent_my_ppo", "my_ppo")
    try:
        for version, scale in enumerate((1.0, 2.0)):
            plugin.write_text(source.format(scale))
            os.utime(plugin, (1_000_000 + version, 1_000_000 + version))  # a new version, whatever the clock
            make_config({"algo.plugins": [str(plugin)]})
            assert POLICY_LOSSES.get("clip_cov").__globals__["SCALE"] == scale
        with pytest.raises(
            ConfigError, match=r"policy loss 'clip_cov' is already registered \(by clip_cov at .*nb_algo"
        ):
            make_config({"algo.plugins": [str(other)]})
        with pytest.raises(ConfigError, match=r"policy loss 'ppo' is already registered \(by ppo at .*policy_loss.py"):
            make_config({"algo.plugins": [str(builtin)]})
    finally:
        POLICY_LOSSES._fns.pop("clip_cov", None), POLICY_LOSSES._info.pop("clip_cov", None)
        for name in modules:
            sys.modules.pop(name, None)


def test_a_notebook_cell_that_registers_a_variant_runs_again():
    """Each run of a cell is a file of its own in `__main__`: running it again was refused as a second definition."""
    main = sys.modules["__main__"].__dict__
    cell = "@GROUP_FILTERS.register('cell_filter')\ndef cell_filter(scores_r, groups, params):\n    return {}\n"
    main["GROUP_FILTERS"] = GROUP_FILTERS  # the cell's import
    try:
        for run in range(2):  # the cell, edited, run again
            exec(compile(cell.replace("{}", f"{{{run}}}"), f"/tmp/ipykernel_1/{run}.py", "exec"), main)
            assert GROUP_FILTERS.get("cell_filter")(None, None, None) == {run}
        exec(compile(cell, "/tmp/ipykernel_1/1.py", "exec"), main)  # a cell run again unchanged: its file's name
        with pytest.raises(ValueError, match="group filter 'cell_filter' is already registered"):  # two in one file
            exec(compile("\n" + cell, "/tmp/ipykernel_1/1.py", "exec"), main)
    finally:
        main.pop("cell_filter", None), main.pop("GROUP_FILTERS", None)
        GROUP_FILTERS.remove("cell_filter")
