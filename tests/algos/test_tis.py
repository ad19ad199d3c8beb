"""Truncated importance sampling (TIS): hand-computed weights, the weighted loss and its
gradient for every policy loss, on numpy, torch and jax; errors that name the knob."""

from __future__ import annotations

import math

import numpy as np
import pytest

from polyrl.algos import losses as L
from polyrl.algos.registry import get_algorithm

# Hand-computed numbers use math.exp in the test; float64 everywhere: 1e-9 is far below
# any formula mistake.
HAND = dict(rtol=1e-9, atol=1e-9)

# One prompt, three response tokens; token 2 is padding.
OLD = np.array([[-1.0, -2.0, -0.5]])  # the trainer's log-probs of the sampled tokens
ROLLOUT = np.array([[-1.5, -1.0, -9.0]])  # the rollout engine's
MASK = np.array([[1.0, 1.0, 0.0]])
ADV = np.array([[1.0, -2.0, 3.0]])
CAP = 1.5
# exp(-1 - -1.5) = e^0.5 = 1.6487 > cap -> 1.5; exp(-2 - -1) = e^-1; padding: e^8.5 -> 1.5
W = np.array([[CAP, math.exp(-1.0), CAP]])


def _np(bk, x):
    return bk.numpy(x)


def test_weight_and_metrics_by_hand(bk):
    weight, metrics = bk.call(
        lambda o, r, m: L.truncated_is_weight(o, r, m, CAP),
        bk.asarray(OLD),
        bk.asarray(ROLLOUT),
        bk.asarray(MASK),
    )
    np.testing.assert_allclose(_np(bk, weight), W, **HAND)
    # token means over the 2 valid tokens: (1.5 + e^-1) / 2; one of two ratios above cap
    np.testing.assert_allclose(
        _np(bk, metrics["tis_weight_mean"]), (CAP + math.exp(-1.0)) / 2, **HAND
    )
    np.testing.assert_allclose(_np(bk, metrics["tis_clipfrac"]), 0.5, **HAND)


@pytest.mark.parametrize("policy_loss", ["ppo", "gspo", "cispo"])
def test_actor_loss_weights_each_token(bk, make_ctx, policy_loss):
    """log_probs == old_log_probs: every ratio is 1, inside every clip range, so each
    token's policy loss is -A (ppo, gspo) or -A * log_probs (cispo) times its TIS weight;
    token-mean over the 2 valid tokens."""
    spec = get_algorithm("grpo").replace(policy_loss=policy_loss, tis_cap=CAP, agg="token-mean")
    loss_fn = spec.make_actor_loss(use_kl_loss=False)
    factor = OLD if policy_loss == "cispo" else np.ones_like(OLD)
    expected = float((-ADV * factor * W * MASK).sum() / 2)

    def run(lp, old, rollout, adv, mask):
        batch = {
            "old_log_probs": old,
            "rollout_log_probs": rollout,
            "advantages": adv,
            "response_mask": mask,
        }
        return loss_fn({"log_probs": lp}, batch, make_ctx(2.0, 1.0))

    args = [bk.asarray(a) for a in (OLD, OLD, ROLLOUT, ADV, MASK)]
    loss, metrics = bk.call(run, *args)
    np.testing.assert_allclose(_np(bk, loss), expected, **HAND)
    np.testing.assert_allclose(_np(bk, metrics["tis_clipfrac"]), 0.5, **HAND)


def test_weight_is_a_constant_in_the_gradient(gbk, make_ctx):
    """PPO at ratio 1: d loss / d log_probs = -A * w / N_tok; nothing flows into the
    old or rollout log-probs through the weight (it is stop-gradient)."""
    loss_fn = get_algorithm("grpo").make_actor_loss(use_kl_loss=False, tis_cap=CAP)

    def f(lp, old, rollout):
        batch = {
            "old_log_probs": old,
            "rollout_log_probs": rollout,
            "advantages": gbk.asarray(ADV),
            "response_mask": gbk.asarray(MASK),
        }
        return loss_fn({"log_probs": lp}, batch, make_ctx(2.0, 1.0))[0]

    g_lp, g_old, g_rollout = gbk.grad(f, OLD, OLD, ROLLOUT)
    np.testing.assert_allclose(g_lp, -ADV * W * MASK / 2, **HAND)
    # old_log_probs reaches the loss through the PPO ratio only: the exact opposite
    np.testing.assert_allclose(g_old, -g_lp, **HAND)
    np.testing.assert_allclose(g_rollout, np.zeros_like(ROLLOUT), **HAND)


def test_equal_log_probs_change_nothing(make_ctx):
    """rollout == trainer log-probs: every weight is 1, the loss is the plain one."""
    new = OLD + np.array([[0.3, -0.4, 0.1]])
    batch = {"old_log_probs": OLD, "advantages": ADV, "response_mask": MASK}
    ctx = make_ctx(2.0, 1.0)
    plain = get_algorithm("grpo").make_actor_loss()
    tis = get_algorithm("grpo").make_actor_loss(tis_cap=CAP)
    ref = {"ref_log_probs": OLD - 0.2}
    a, _ = plain({"log_probs": new}, {**batch, **ref}, ctx)
    b, m = tis({"log_probs": new}, {**batch, **ref, "rollout_log_probs": OLD}, ctx)
    np.testing.assert_allclose(b, a, **HAND)
    np.testing.assert_allclose(m["tis_weight_mean"], 1.0, **HAND)


def test_errors_name_the_knob(make_ctx):
    with pytest.raises(ValueError, match=r"AlgorithmSpec.tis_cap must be > 0.*got 0"):
        get_algorithm("grpo").replace(tis_cap=0.0)
    loss_fn = get_algorithm("grpo").make_actor_loss(use_kl_loss=False, tis_cap=2.0)
    batch = {"old_log_probs": OLD, "advantages": ADV, "response_mask": MASK}
    with pytest.raises(ValueError, match=r"tis_cap=2.0 needs .*rollout_log_probs"):
        loss_fn({"log_probs": OLD}, batch, make_ctx(2.0, 1.0))
