"""Off-policy corrections beyond token-level TIS: sequence-level (product / geometric
mean) truncated IS and masked IS (IcePop band, token or sequence level), hand-computed on
numpy, torch and jax; their metrics, their place in the actor loss, stop-gradient, and
errors that name the AlgorithmSpec field."""

from __future__ import annotations

import math

import numpy as np
import pytest

from polyrl.algos import losses as L
from polyrl.algos.registry import get_algorithm

# Hand-computed numbers use math.exp in the test; float64 everywhere: 1e-9 is far below
# any formula mistake.
HAND = dict(rtol=1e-9, atol=1e-9)

# Two responses; row 0's last token is padding.
OLD = np.array([[-1.0, -2.0, -0.5], [-0.5, -0.5, -3.0]])  # trainer log-probs
ROLLOUT = np.array([[-1.5, -1.0, -9.0], [-1.0, -0.7, 0.0]])  # rollout engine's
MASK = np.array([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
ADV = np.array([[1.0, -2.0, 3.0], [-1.0, 0.5, 2.0]])
# Token log-ratios old - rollout: row 0: 0.5, -1.0 (pad 8.5); row 1: 0.5, 0.2, -3.0.
TOKEN_RATIOS = [math.exp(0.5), math.exp(-1.0), math.exp(0.5), math.exp(0.2), math.exp(-3.0)]
SEQ = (math.exp(0.5 - 1.0), math.exp(0.5 + 0.2 - 3.0))  # products: e^-0.5, e^-2.3
GEO = (math.exp(-0.5 / 2), math.exp(-2.3 / 3))  # geometric means: e^-0.25, e^-0.7667
N_TOK, N_SEQ = 5, 2


def _args(bk):
    return bk.asarray(OLD), bk.asarray(ROLLOUT), bk.asarray(MASK)


def _check(bk, out, weight, metrics):
    got_w, got_m = out
    np.testing.assert_allclose(bk.numpy(got_w) * MASK, np.asarray(weight) * MASK, **HAND)
    for key, want in metrics.items():
        np.testing.assert_allclose(bk.numpy(got_m[key]), want, **HAND, err_msg=key)


@pytest.mark.parametrize(
    ("level", "cap", "weight", "metrics"),
    [
        # token: e^0.5 > 1.5 twice (one per row) -> 1.5
        (
            "token",
            1.5,
            [[1.5, math.exp(-1.0), 0.0], [1.5, math.exp(0.2), math.exp(-3.0)]],
            {
                "tis_clipfrac": 2 / N_TOK,
                "tis_clip_seqfrac": 2 / N_SEQ,
                "tis_ratio_mean": sum(TOKEN_RATIOS) / N_TOK,
                "tis_weight_mean": (3.0 + math.exp(-1.0) + math.exp(0.2) + math.exp(-3.0)) / 5,
            },
        ),
        # sequence: row 0's product e^-0.5 = 0.607 > 0.5 -> 0.5 on both its tokens
        (
            "sequence",
            0.5,
            [[0.5, 0.5, 0.0], [SEQ[1]] * 3],
            {
                "tis_clipfrac": 2 / N_TOK,
                "tis_clip_seqfrac": 1 / N_SEQ,
                "tis_ratio_mean": (2 * SEQ[0] + 3 * SEQ[1]) / N_TOK,
                "tis_weight_mean": (2 * 0.5 + 3 * SEQ[1]) / N_TOK,
            },
        ),
        # geometric: row 0's e^-0.25 = 0.779 > 0.7 -> 0.7; row 1's 0.465 stays
        (
            "geometric",
            0.7,
            [[0.7, 0.7, 0.0], [GEO[1]] * 3],
            {
                "tis_clipfrac": 2 / N_TOK,
                "tis_clip_seqfrac": 1 / N_SEQ,
                "tis_ratio_mean": (2 * GEO[0] + 3 * GEO[1]) / N_TOK,
                "tis_weight_mean": (2 * 0.7 + 3 * GEO[1]) / N_TOK,
            },
        ),
    ],
)
def test_truncated_is_levels_by_hand(bk, level, cap, weight, metrics):
    out = bk.call(lambda o, r, m: L.truncated_is_weight(o, r, m, cap, level=level), *_args(bk))
    _check(bk, out, weight, metrics)


@pytest.mark.parametrize(
    ("level", "low", "high", "keep", "metrics"),
    [
        # token band [0.3, 2]: only row 1's last token (e^-3 = 0.05) leaves it
        (
            "token",
            0.3,
            2.0,
            [[1, 1, 0], [1, 1, 0]],
            {
                "is_mask_frac": 1 / N_TOK,
                "is_mask_seqfrac": 1 / N_SEQ,
                "is_mask_ratio_mean": sum(TOKEN_RATIOS) / N_TOK,
            },
        ),
        # token band [0.5, 1.5]: e^0.5 (both rows), e^-1 and e^-3 leave it
        (
            "token",
            0.5,
            1.5,
            [[0, 0, 0], [0, 1, 0]],
            {"is_mask_frac": 4 / N_TOK, "is_mask_seqfrac": 2 / N_SEQ},
        ),
        # sequence band [0.5, 2]: row 1's product e^-2.3 = 0.10 is out: its 3 tokens go
        (
            "sequence",
            0.5,
            2.0,
            [[1, 1, 1], [0, 0, 0]],
            {
                "is_mask_frac": 3 / N_TOK,
                "is_mask_seqfrac": 1 / N_SEQ,
                "is_mask_ratio_mean": (2 * SEQ[0] + 3 * SEQ[1]) / N_TOK,
            },
        ),
        # geometric, lower bound only: row 1's 0.465 < 0.5 is out, row 0's 0.779 stays
        ("geometric", 0.5, None, [[1, 1, 1], [0, 0, 0]], {"is_mask_frac": 3 / N_TOK}),
        # geometric, upper bound only: both means are below 1, nothing is masked
        ("geometric", None, 1.2, [[1, 1, 1], [1, 1, 1]], {"is_mask_frac": 0.0}),
    ],
)
def test_masked_is_by_hand(bk, level, low, high, keep, metrics):
    out = bk.call(lambda o, r, m: L.masked_is_weight(o, r, m, low, high, level=level), *_args(bk))
    _check(bk, out, keep, metrics)


def test_metrics_sum_over_micro_batches():
    """With the global counts given, each row's metrics (a micro-batch of one row) sum to
    the full batch's, the convention every loss metric follows."""
    kw = dict(low=0.3, high=2.0, global_tokens=N_TOK, global_seqs=N_SEQ)
    _, full = L.masked_is_weight(OLD, ROLLOUT, MASK, **kw)
    parts = [
        L.masked_is_weight(OLD[i : i + 1], ROLLOUT[i : i + 1], MASK[i : i + 1], **kw)[1]
        for i in range(2)
    ]
    for key, value in full.items():
        np.testing.assert_allclose(sum(p[key] for p in parts), value, **HAND, err_msg=key)


def _loss_fn(**overrides):
    spec = get_algorithm("grpo").replace(agg="token-mean", **overrides)
    return spec.make_actor_loss(use_kl_loss=False)


def _run(loss_fn, make_ctx):
    def run(lp, old, rollout, adv, mask):
        batch = {
            "old_log_probs": old,
            "rollout_log_probs": rollout,
            "advantages": adv,
            "response_mask": mask,
        }
        return loss_fn({"log_probs": lp}, batch, make_ctx(float(N_TOK), float(N_SEQ)))

    return run


def test_actor_loss_applies_both_corrections(bk, make_ctx):
    """log_probs == old_log_probs: PPO's ratio is 1 everywhere, so each token's loss is
    -A * w with w = sequence TIS (cap 0.5) x token mask (band [0.3, 2]); token-mean over 5."""
    loss_fn = _loss_fn(tis_cap=0.5, tis_level="sequence", is_mask_low=0.3, is_mask_high=2.0)
    w = np.array([[0.5, 0.5, 0.0], [SEQ[1], SEQ[1], 0.0]])
    expected = float((-ADV * w * MASK).sum() / N_TOK)
    args = [bk.asarray(a) for a in (OLD, OLD, ROLLOUT, ADV, MASK)]
    loss, metrics = bk.call(_run(loss_fn, make_ctx), *args)
    np.testing.assert_allclose(bk.numpy(loss), expected, **HAND)
    np.testing.assert_allclose(bk.numpy(metrics["is_mask_frac"]), 1 / N_TOK, **HAND)
    np.testing.assert_allclose(bk.numpy(metrics["tis_clip_seqfrac"]), 1 / N_SEQ, **HAND)


def test_corrections_are_constants_in_the_gradient(gbk, make_ctx):
    """d loss / d log_probs = -A * w / N_tok; nothing flows into the rollout log-probs, and
    the old log-probs reach the loss only through PPO's ratio (the exact opposite)."""
    loss_fn = _loss_fn(tis_cap=0.7, tis_level="geometric", is_mask_low=0.3, is_mask_level="token")
    run = _run(loss_fn, make_ctx)

    def f(lp, old, rollout):
        return run(lp, old, rollout, gbk.asarray(ADV), gbk.asarray(MASK))[0]

    g_lp, g_old, g_rollout = gbk.grad(f, OLD, OLD, ROLLOUT)
    w = np.array([[0.7, 0.7, 0.0], [GEO[1], GEO[1], 0.0]])
    np.testing.assert_allclose(g_lp, -ADV * w * MASK / N_TOK, **HAND)
    np.testing.assert_allclose(g_old, -g_lp, **HAND)
    np.testing.assert_allclose(g_rollout, np.zeros_like(ROLLOUT), **HAND)


def test_errors_name_the_field(make_ctx):
    grpo = get_algorithm("grpo")
    with pytest.raises(ValueError, match=r"AlgorithmSpec.tis_level: unknown value 'seq'"):
        grpo.replace(tis_level="seq")
    with pytest.raises(ValueError, match=r"AlgorithmSpec.is_mask_level: unknown value"):
        grpo.replace(is_mask_level="tokens")
    for low, high in ((1.0, 2.0), (0.5, 0.9), (-0.1, None)):
        with pytest.raises(ValueError, match=r"is_mask_low / is_mask_high: the band must hold"):
            grpo.replace(is_mask_low=low, is_mask_high=high)
    loss_fn = _loss_fn(is_mask_high=2.0)
    batch = {"old_log_probs": OLD, "advantages": ADV, "response_mask": MASK}
    with pytest.raises(ValueError, match=r"AlgorithmSpec.is_mask_low/high needs .*rollout_log"):
        loss_fn({"log_probs": OLD}, batch, make_ctx(5.0, 2.0))
    with pytest.raises(ValueError, match=r"set low, high or both"):
        L.masked_is_weight(OLD, ROLLOUT, MASK, None, None)
    with pytest.raises(ValueError, match=r"unknown level 'row'"):
        L.rollout_log_ratio(OLD, ROLLOUT, MASK, "row")
