"""polyrl.observe.shadow's arithmetic on hand-made log-probs: the pairwise gaps, their buckets,
which side is named, the worst tokens, and the health warning that names the side."""

from __future__ import annotations

import numpy as np
import pytest

from polyrl.observe import shadow
from polyrl.observe.health import HealthMonitor


class _Tok:
    def decode(self, ids):
        return " ".join(f"t{i}" for i in ids)


MASK = np.array([[1, 1, 1, 0], [1, 1, 0, 0]], np.float32)
RESP = np.array([[5, 5, 7, 0], [5, 9, 0, 0]])


def _sides(train_off=0.0, shadow_off=0.0):
    base = np.array([[-1.0, -2.0, -0.5, 0.0], [-3.0, -0.25, 0.0, 0.0]])
    return {
        "rollout": base,
        "train": base + train_off * MASK,
        "shadow": base + shadow_off * MASK,
    }


def test_gaps_by_pair_position_and_frequency():
    lp = _sides(shadow_off=0.0)
    lp["train"] = lp["train"] + np.array([[0.1, 0.0, 0.4, 9.0], [0.0, 0.2, 9.0, 9.0]])
    m = shadow.gap_metrics(lp, MASK, RESP)
    # |train - rollout| over the 5 valid tokens: 0.1, 0, 0.4, 0, 0.2 (9.0 on padding: out)
    assert m["shadow/gap_mean/rollout_train"] == pytest.approx(0.7 / 5)
    assert m["shadow/gap_max/rollout_train"] == pytest.approx(0.4)
    assert m["shadow/gap_mean/rollout_shadow"] == 0.0
    assert m["shadow/gap_mean/train_shadow"] == pytest.approx(0.7 / 5)
    assert m["shadow/gap_mean/rollout_train/pos_0_4"] == pytest.approx(0.7 / 5)
    assert "shadow/gap_mean/rollout_train/pos_4_16" not in m  # no token there
    # id 5 occurs 3 times, ids 7 and 9 once: frequencies 1,1,3,3,3, terciles at 5/3 and
    # 3: tokens 7 (0.4) and 9 (0.2) are low, the 5s (0.1, 0, 0) mid, none above 3
    assert m["shadow/gap_mean/rollout_train/freq_low"] == pytest.approx(0.3)
    assert m["shadow/gap_mean/rollout_train/freq_mid"] == pytest.approx(0.1 / 3)
    assert "shadow/gap_mean/rollout_train/freq_high" not in m
    assert m["shadow/tokens"] == 5


@pytest.mark.parametrize(
    "train_off,shadow_off,want",
    [(0.0, 0.0, None), (0.5, 0.0, "train"), (0.0, 0.5, "shadow"), (0.5, 0.5, "rollout")],
)
def test_the_side_that_disagrees_is_named(train_off, shadow_off, want):
    m = shadow.gap_metrics(_sides(train_off, shadow_off), MASK, RESP)
    assert shadow.odd_side(m, tolerance=0.02) == want


def test_three_different_sides_are_all_named():
    m = shadow.gap_metrics(_sides(0.5, -0.5), MASK, RESP)  # gaps 0.5, 0.5, 1.0
    assert shadow.odd_side(m, tolerance=0.02) == "all"


def test_worst_tokens_come_first_with_their_text():
    lp = _sides()
    lp["shadow"] = lp["shadow"] + np.array([[0.0, 0.0, 0.3, 5.0], [0.0, 0.9, 0.0, 0.0]])
    worst = shadow.worst_tokens(lp, MASK, RESP, _Tok(), count=2)
    assert [(w["row"], w["position"]) for w in worst] == [(1, 1), (0, 2)]
    assert worst[0]["token"] == "t9" and worst[0]["context"] == "t5 t9"
    assert worst[0]["spread"] == pytest.approx(0.9)


def test_health_warning_names_the_side_and_its_stack():
    said = []
    health = HealthMonitor(
        echo=said.append,
        shadow_tolerance=0.02,
        shadow_sides={"rollout": "vLLM", "train": "torch_fsdp", "shadow": "jax_pjit"},
    )
    healthy = shadow.gap_metrics(_sides(), MASK, RESP)
    assert health.check(healthy)["health/logprob_side"] == 0.0 and not said
    broken = shadow.gap_metrics(_sides(shadow_off=0.5), MASK, RESP)
    assert health.check(broken)["health/logprob_side"] == 1.0
    assert said[0].startswith(
        "[health] WARNING logprob_side: the shadow (jax_pjit) log-probs disagree with the two"
    )


def test_scored_rows_are_the_first_of_each_prompt_filled_to_the_workers():
    groups = np.array([0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3])
    np.testing.assert_array_equal(shadow.scored_rows(groups, 1), [0, 3, 6, 9])
    np.testing.assert_array_equal(shadow.scored_rows(groups, 2), [0, 1, 3, 4, 6, 7, 9, 10])
    # 4 rows over 3 workers: two more, the first rows not chosen
    np.testing.assert_array_equal(shadow.scored_rows(groups, 1, 3), [0, 1, 2, 3, 6, 9])
    np.testing.assert_array_equal(shadow.scored_rows(groups, 5), np.arange(12))
    # groups need not be contiguous (a refilled DAPO batch)
    np.testing.assert_array_equal(shadow.scored_rows(np.array([4, 2, 4, 2]), 1), [0, 1])
