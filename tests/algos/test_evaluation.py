"""pass@k against hand-computed binomial ratios."""

from __future__ import annotations

import numpy as np
import pytest

from polyrl.algos.evaluation import mean_pass_at_k, pass_at_k, pass_at_k_values


@pytest.mark.parametrize(
    "n, c, k, expected",
    [
        (5, 2, 1, 2 / 5),  # pass@1 is the fraction correct
        (5, 2, 2, 1 - 3 / 10),  # 1 - C(3,2)/C(5,2)
        (10, 3, 5, 1 - 21 / 252),  # 1 - C(7,5)/C(10,5)
        (4, 0, 4, 0.0),  # nothing correct
        (5, 4, 2, 1.0),  # fewer than k wrong: every draw of 2 holds a correct one
        (1, 1, 1, 1.0),
    ],
)
def test_pass_at_k(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_mean_over_prompts_and_reported_ks():
    correct = np.array([[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 0, 0]], dtype=bool)
    # pass@2 per prompt: 1 - C(3,2)/C(4,2) = 1/2; 1 - C(2,2)/C(4,2) = 5/6; 0
    assert mean_pass_at_k(correct, 2) == pytest.approx((1 / 2 + 5 / 6 + 0) / 3)
    assert mean_pass_at_k(correct, 1) == pytest.approx(3 / 12)
    assert pass_at_k_values(1) == [1]
    assert pass_at_k_values(8) == [1, 2, 4, 8]
    assert pass_at_k_values(6) == [1, 2, 4, 6]


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="n=3 c=4 k=1"):
        pass_at_k(3, 4, 1)
