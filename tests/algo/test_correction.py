"""Train/rollout IS correction: every level x mode by hand, invalid combinations, metrics."""

import math

import pytest
import torch

from molt.algo import ISCorrectionParams, is_correction

F64 = torch.float64

# rho = exp(old - rollout). Sequence 0: [1, 2, 0.25] (product 0.5, geometric mean 0.5^(1/3) = 0.794).
# Sequence 1: [1.5, 1.2, masked 100] (product 1.8, geometric mean sqrt(1.8) = 1.342). Band [0.5, 1.6].
RHO = torch.tensor([[1.0, 2.0, 0.25], [1.5, 1.2, 100.0]], dtype=F64)
ROLLOUT = torch.zeros(2, 3, dtype=F64)  # so old - rollout = log(rho) exactly
OLD = ROLLOUT + RHO.log()
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])


@pytest.mark.parametrize(
    ("level", "mode", "weights", "filter_frac"),
    [
        ("token", "mask", [[1, 0, 0], [1.5, 1.2, 0]], 2 / 5),  # IcePop: 2 and 0.25 fall outside
        ("token", "clip", [[1, 1.6, 0.5], [1.5, 1.2, 0]], 2 / 5),
        ("token", "trunc", [[1, 1.6, 0.25], [1.5, 1.2, 0]], 1 / 5),  # TIS: only 2 > 1.6
        ("seq", "mask", [[1, 2, 0.25], [0, 0, 0]], 2 / 5),  # 0.5 inside (inclusive), 1.8 outside
        ("seq", "clip", [[0.5, 0.5, 0.5], [1.6, 1.6, 0]], 2 / 5),
        ("seq", "trunc", [[0.5, 0.5, 0.5], [1.6, 1.6, 0]], 2 / 5),
        ("geo", "mask", [[1, 2, 0.25], [1.5, 1.2, 0]], 0.0),  # both geometric means inside
    ],
)
def test_levels_and_modes_hand_numbers(level, mode, weights, filter_frac):
    params = ISCorrectionParams(level=level, mode=mode, low=0.5, high=1.6)
    weight, metrics = is_correction(OLD, ROLLOUT, MASK, params)
    torch.testing.assert_close(weight, torch.tensor(weights, dtype=F64), rtol=0, atol=1e-12)
    assert metrics["is_filter_frac"].item() == pytest.approx(filter_frac)
    assert metrics["is_weight_mean"].item() == pytest.approx(sum(map(sum, weights)) / 5)


def test_geo_mask_rejects_a_sequence_outside_the_band():
    weight, metrics = is_correction(OLD, ROLLOUT, MASK, ISCorrectionParams("geo", "mask", low=0.9, high=1.6))
    torch.testing.assert_close(weight, torch.tensor([[0, 0, 0], [1.5, 1.2, 0]], dtype=F64))
    assert metrics["is_filter_frac"].item() == pytest.approx(3 / 5)


def test_off_gives_unit_weights_but_still_measures_the_mismatch():
    weight, metrics = is_correction(OLD.requires_grad_(True), ROLLOUT, MASK, ISCorrectionParams())
    assert weight.tolist() == [[1, 1, 1], [1, 1, 0]] and not weight.requires_grad
    log_rho = [0.0, math.log(2), math.log(0.25), math.log(1.5), math.log(1.2)]
    assert metrics["rollout_kl"].item() == pytest.approx(-sum(log_rho) / 5)
    assert metrics["logprob_diff"].item() == pytest.approx(sum(map(abs, log_rho)) / 5)
    assert metrics["is_filter_frac"].item() == 0.0


def test_weights_are_detached_and_nan_safe():
    old = torch.tensor([[math.nan, 0.0, 0.0]], dtype=F64, requires_grad=True)
    rollout = torch.tensor([[0.0, -math.inf, math.nan]], dtype=F64)
    params = ISCorrectionParams("token", "trunc", high=2.0)
    weight, metrics = is_correction(old, rollout, torch.ones(1, 3), params)
    # NaN log-ratio -> 0 (rho 1); +inf -> 30 (capped at 2); NaN rollout -> 0
    assert weight.tolist() == [[1.0, 2.0, 1.0]] and not weight.requires_grad
    assert all(math.isfinite(float(v)) for v in metrics.values())


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(level="geo", mode="clip"), "does not support mode 'clip'"),
        (dict(level="geo", mode="trunc"), "does not support mode 'trunc'"),
        (dict(level="sentence", mode="mask"), "unknown IS correction level"),
        (dict(level="token", mode="drop"), "unknown IS correction mode"),
        (dict(level="token", mode="mask", low=1.1, high=2.0), "0 <= low <= 1 <= high"),
        (dict(level="token", mode="mask", low=0.5, high=0.9), "0 <= low <= 1 <= high"),
    ],
)
def test_invalid_combinations_are_rejected(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ISCorrectionParams(**kwargs)


def test_a_mode_of_your_own_names_the_levels_it_takes():
    """An IS mode registered with `levels=` serves those built-in levels (it was refused with a message about
    geometric means even for token); an unknown level lists the registered ones."""
    from molt.algo import IS_MODES
    from molt.config import ConfigError
    from molt.config.rl import AlgoConfig

    soft = lambda ratio_bt, stat_bt, low, high: (stat_bt.clamp(low, high), stat_bt > high)  # noqa: E731
    IS_MODES.add("soft", soft, levels=("token",))
    try:
        assert AlgoConfig(is_level="token", is_mode="soft").is_mode == "soft"
        with pytest.raises(ConfigError, match=r"is_level seq takes only mode mask or clip or trunc, not 'soft'; add"):
            AlgoConfig(is_level="seq", is_mode="soft")
        with pytest.raises(ValueError, match=r"does not support mode 'soft' \(allowed: mask, clip, trunc\)$"):
            ISCorrectionParams("seq", "soft")
        with pytest.raises(
            ConfigError, match=r"is_level: unknown 'tokn'; choose from \['geo', 'seq', 'token', 'none'\]"
        ):
            AlgoConfig(is_level="tokn")
    finally:
        IS_MODES.remove("soft")
