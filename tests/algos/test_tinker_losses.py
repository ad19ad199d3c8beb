"""The Tinker API's losses (algos/tinker_losses.py): sums over tokens, values by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest

from polyrl.algos.tinker_losses import tinker_loss

R = math.exp(0.5)  # the ratio exp(-1.0 - -1.5) of every policy case below


def policy_batch(advantage: float) -> tuple[dict, dict]:
    outputs = {"log_probs": np.array([[-1.0, -3.0]])}
    batch = {
        "sampling_logprobs": np.array([[-1.5, -3.0]]),
        "advantages": np.array([[advantage, 0.0]]),
        "response_mask": np.ones((1, 2)),
    }
    return outputs, batch


def test_cross_entropy_is_the_weighted_sum_of_negative_log_probs():
    outputs = {"log_probs": np.array([[-1.0, -2.0], [-0.5, -7.0]])}
    batch = {"weights": np.array([[1.0, 0.5], [2.0, 0.0]]), "response_mask": np.ones((2, 2))}
    loss, _ = tinker_loss("cross_entropy")(outputs, batch)
    assert float(loss) == pytest.approx(1.0 + 1.0 + 1.0)


@pytest.mark.parametrize(
    "name, advantage, want",
    [
        ("importance_sampling", 2.0, -R * 2.0),  # no clip, even far from 1
        ("ppo", 2.0, -1.2 * 2.0),  # the ratio clipped at 1.2 for a positive advantage
        ("ppo", -2.0, R * 2.0),  # min(r A, clip(r) A) keeps r A for a negative one
        ("cispo", 2.0, -1.2 * 2.0 * -1.0),  # -clip(r) A log_probs
    ],
)
def test_policy_losses_by_hand(name, advantage, want):
    outputs, batch = policy_batch(advantage)
    loss, _ = tinker_loss(name)(outputs, batch)
    assert float(loss) == pytest.approx(want, rel=1e-6)


def test_cispo_gradient_keeps_the_clipped_weight_constant():
    import torch

    outputs, batch = policy_batch(2.0)
    lp = torch.tensor(outputs["log_probs"], requires_grad=True)
    loss, _ = tinker_loss("cispo")(
        {"log_probs": lp}, {k: torch.tensor(v) for k, v in batch.items()}
    )
    loss.backward()
    np.testing.assert_allclose(lp.grad.numpy(), [[-1.2 * 2.0, 0.0]])


def test_thresholds_come_from_loss_fn_config():
    outputs, batch = policy_batch(2.0)
    loss, _ = tinker_loss("ppo", {"clip_high_threshold": 1.5})(outputs, batch)
    assert float(loss) == pytest.approx(-1.5 * 2.0)


@pytest.mark.parametrize(
    "name, config, field",
    [
        ("dro", None, "loss_fn='dro'"),
        ("cross_entropy", {"clip_low_threshold": 0.9}, "clip_low_threshold"),
        ("ppo", {"clip_low_threshold": "x"}, "clip_low_threshold"),
        ("ppo", {"clip_low_threshold": 1.1}, "bracket 1"),
    ],
)
def test_bad_names_and_config_are_refused_by_field(name, config, field):
    with pytest.raises(ValueError, match=field):
        tinker_loss(name, config)
