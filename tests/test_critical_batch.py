"""Claim C40's estimators (labkit.train.critical_batch) on synthetic inputs whose answers are
known exactly: the steps curve S = S_min·(1 + B_crit/B) recovered from points drawn on it,
S_min from a given B_noise, steps to a target on loss sequences written by hand."""
from __future__ import annotations

import pytest

from labkit.train.critical_batch import (fit_steps_curve, predicted_steps, s_min_given_noise,
                                         smoothed, steps_to_target)

BATCHES = [2, 4, 8, 16, 32, 64]


def test_fit_recovers_the_curve_it_was_drawn_from():
    """claim C40: points on S_min·(1 + B_crit/B) give back S_min and B_crit."""
    steps = [predicted_steps(b, 120.0, 24.0) for b in BATCHES]
    assert steps[0] == 120 * 13 and steps[-1] == pytest.approx(165.0)
    s_min, b_crit = fit_steps_curve(BATCHES, steps)
    assert s_min == pytest.approx(120.0, rel=1e-12)
    assert b_crit == pytest.approx(24.0, rel=1e-12)
    assert s_min_given_noise(BATCHES, steps, 24.0) == pytest.approx(120.0, rel=1e-12)
    # B_noise wrong by 2x: the best S_min for it is no longer 120 (the fit can tell)
    assert abs(s_min_given_noise(BATCHES, steps, 48.0) - 120.0) > 10


def test_halving_below_and_saturation_above_the_critical_batch():
    """S/S_min = 1 + B_noise/B: at B = B_noise twice the fewest steps; far below it doubling
    the batch nearly halves the steps; far above it saves almost nothing."""
    assert predicted_steps(10, 50, 10) == 100
    assert predicted_steps(1, 50, 1000) / predicted_steps(2, 50, 1000) == pytest.approx(
        1001 / 501)
    assert predicted_steps(1e5, 50, 10) / predicted_steps(2e5, 50, 10) < 1.0001


def test_steps_to_target_on_known_sequences():
    assert steps_to_target([3, 2, 1, 0.5], 1.0, decay=0) == 3
    assert steps_to_target([3, 2, 1.5], 1.0, decay=0) is None
    # bias-corrected EMA: constant input stays constant from the first step
    assert smoothed([2.0] * 5) == pytest.approx([2.0] * 5)
    # decay 0.5 over [4, 0, 0]: 4, 4/3·0.5·... exactly (4·0.5^t)/(Σ 0.5^i)
    assert smoothed([4, 0, 0], 0.5) == pytest.approx([4, 2 / 1.5, 1 / 1.75])
    assert steps_to_target([4, 0, 0], 1.0, decay=0.5) == 3


@pytest.mark.parametrize("args, words", [
    (([8, 8], [10, 12]), "two distinct batch sizes"),
    (([2, 4], [10, 20]), "B_crit >= 0"),   # steps grow with the batch
    (([2, 4], [20, 5]), "S_min > 0"),      # steps fall faster than 1/B allows
    (([2, 4], [10]), "equal-length"),
    (([0, 4], [10, 20]), "must all be > 0"),
])
def test_fit_refuses_what_has_no_curve(args, words):
    with pytest.raises(ValueError, match=words):
        fit_steps_curve(*args)
