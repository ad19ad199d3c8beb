"""polyrl.algos.distillation: hand-computed advantages on numpy, torch and jax, the gradient
of the policy loss fed with them (the reverse KL's, by hand), and error messages."""

from __future__ import annotations

import math

import numpy as np
import pytest

from polyrl.algos.distillation import distillation_advantages

# Hand values are sums of a few numbers written to full precision: float64 rounding only.
HAND = dict(rtol=1e-12, atol=1e-12)

# Two responses of three tokens; row 1's last position is padding, where the teacher left
# -inf (it never scored it). d = student - teacher on the valid tokens:
#   row 0: [-1 - -1.5, -2 - -1, -0.5 - -0.5] = [0.5, -1, 0];   row 1: [0, 1, .]
STUDENT = [[-1.0, -2.0, -0.5], [-0.3, -1.2, -4.0]]
TEACHER = [[-1.5, -1.0, -0.5], [-0.3, -2.2, -math.inf]]
MASK = [[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]]


def _run(bk, student, teacher, mask, task=None, **kw):
    def fn(s, t, m, *task):
        return distillation_advantages(s, t, m, task_advantages=task[0] if task else None, **kw)

    arrays = [bk.asarray(x) for x in (student, teacher, mask)]
    if task is not None:
        arrays.append(bk.asarray(task))
    adv, metrics = bk.call(fn, *arrays)
    assert bk.is_native(adv)
    return bk.numpy(adv), {k: float(bk.numpy(v)) for k, v in metrics.items()}


def test_no_discount_is_each_tokens_negative_reverse_kl(bk):
    adv, metrics = _run(bk, STUDENT, TEACHER, MASK)
    np.testing.assert_allclose(adv, [[-0.5, 1.0, 0.0], [0.0, -1.0, 0.0]], **HAND)
    # the metric is the token mean of d with its denominator: (0.5 - 1 + 0 + 0 + 1) / 5
    assert metrics["reverse_kl"] == pytest.approx(0.1, abs=1e-12)
    assert metrics["tokens"] == 5.0
    adv2, _ = _run(bk, STUDENT, TEACHER, MASK, kl_coef=2.0)
    np.testing.assert_allclose(adv2, [[-1.0, 2.0, 0.0], [0.0, -2.0, 0.0]], **HAND)


def test_discount_sums_the_later_tokens_kl(bk):
    # discount 0.5, rewards -d: row 0 [-0.5, 1, 0] -> y2 = 0, y1 = 1, y0 = -0.5 + 0.5 * 1 = 0
    #                          row 1 [0, -1, pad] -> y1 = -1, y0 = 0 + 0.5 * -1 = -0.5
    adv, _ = _run(bk, STUDENT, TEACHER, MASK, discount=0.5)
    np.testing.assert_allclose(adv, [[0.0, 1.0, 0.0], [-0.5, -1.0, 0.0]], **HAND)
    # discount 1: the undiscounted sum of the later tokens' -d
    adv1, _ = _run(bk, STUDENT, TEACHER, MASK, discount=1.0)
    np.testing.assert_allclose(adv1, [[0.5, 1.0, 0.0], [-1.0, -1.0, 0.0]], **HAND)


def test_multi_turn_masked_tokens_carry_no_kl_and_no_discount_step(bk):
    # student token, two environment tokens (mask 0; the teacher's NaN there is never read),
    # student token: d = [1, ., ., 2]. With discount 0.5 the first token's advantage is
    # -1 + 0.5 * -2 = -2 (one discount step per student token; per position it would be
    # -1 + 0.5^3 * -2 = -1.25).
    student = [[-1.0, -3.0, -3.0, -2.5]]
    teacher = [[-2.0, math.nan, math.nan, -4.5]]
    mask = [[1.0, 0.0, 0.0, 1.0]]
    adv, metrics = _run(bk, student, teacher, mask, discount=0.5)
    np.testing.assert_allclose(adv, [[-2.0, 0.0, 0.0, -2.0]], **HAND)
    assert metrics["reverse_kl"] == pytest.approx(1.5, abs=1e-12)  # (1 + 2) / 2
    assert metrics["tokens"] == 2.0


def test_baseline_subtracts_the_batch_mean_of_d(bk):
    # d on the valid tokens [0.5, -1, 0], [0, 1]: mean 0.1; the per-token reward is
    # -(d - 0.1), 0 on padding; the metric stays the mean of d itself
    adv, metrics = _run(bk, STUDENT, TEACHER, MASK, baseline=True)
    np.testing.assert_allclose(adv, [[-0.4, 1.1, 0.1], [0.1, -0.9, 0.0]], **HAND)
    assert metrics["reverse_kl"] == pytest.approx(0.1, abs=1e-12)
    # discount 1: row 0's first token sums -0.4 + 1.1 + 0.1
    adv1, _ = _run(bk, STUDENT, TEACHER, MASK, baseline=True, discount=1.0)
    np.testing.assert_allclose(adv1, [[0.8, 1.2, 0.1], [-0.8, -0.9, 0.0]], **HAND)


def test_task_advantage_is_added_on_valid_tokens(bk):
    task = [[0.3, 0.3, 0.3], [-0.3, -0.3, -0.3]]
    adv, _ = _run(bk, STUDENT, TEACHER, MASK, kl_coef=0.5, task=task)
    # 0.5 * [[-0.5, 1, 0], [0, -1, .]] + task, 0 on padding
    np.testing.assert_allclose(adv, [[0.05, 0.8, 0.3], [-0.3, -0.8, 0.0]], **HAND)


def test_empty_mask_gives_zero_and_no_nan(bk):
    adv, metrics = _run(bk, STUDENT, TEACHER, np.zeros((2, 3)), discount=0.9)
    np.testing.assert_array_equal(adv, np.zeros((2, 3)))
    assert metrics == {"reverse_kl": 0.0, "tokens": 0.0}


@pytest.mark.parametrize("baseline", [False, True])
def test_policy_gradient_with_these_advantages_is_the_reverse_kl_gradient(gbk, baseline):
    """On-policy, E_y~p[-A(y) grad log p(y)] = grad KL(p || q): one position, a vocabulary
    of three, the expectation written out as a p-weighted sum over the three tokens (one
    row each) through the PPO loss at ratio 1. Expected gradient by hand:
    d KL / d z_j = p_j (d_j - sum_y p_y d_y), d = log p - log q. The baseline (a constant
    of the batch, here the rows' plain mean of d) leaves it unchanged:
    sum_y p_y b grad log p(y) = b grad sum_y p_y = 0."""
    from polyrl.algos.losses import ppo_policy_loss
    from polyrl.tensor import asarray_like, log_softmax, namespace, stop_gradient

    z = [0.2, -0.4, 1.1]
    tz = [1.0, 0.0, -1.0]
    lse_z = math.log(sum(math.exp(v) for v in z))
    lse_t = math.log(sum(math.exp(v) for v in tz))
    log_p = [v - lse_z for v in z]
    log_q = [v - lse_t for v in tz]
    p = [math.exp(v) for v in log_p]
    d = [a - b for a, b in zip(log_p, log_q)]
    mean_d = sum(pi * di for pi, di in zip(p, d))
    expected = [pi * (di - mean_d) for pi, di in zip(p, d)]

    def loss(logits):
        xp = namespace(logits)
        lp = log_softmax(logits)[:, None]  # [3, 1]: row y holds log p(y)
        ones = xp.ones_like(lp)
        teacher = asarray_like(np.array(log_q)[:, None], lp)
        adv, _ = distillation_advantages(lp, teacher, ones, baseline=baseline)
        weights = stop_gradient(xp.exp(lp))  # p(y): the expectation over the sampled token
        value, _ = ppo_policy_loss(
            lp, stop_gradient(lp), adv, ones, global_tokens=1.0, weights=weights
        )
        return value

    (grad,) = gbk.grad(loss, np.array(z))
    np.testing.assert_allclose(grad, expected, **HAND)
    assert sum(g * g for g in expected) > 1e-3  # not a vacuous zero gradient


def test_bad_arguments_name_the_field(bk):
    a, b = bk.asarray(np.zeros((2, 3))), bk.asarray(np.zeros((2, 4)))
    with pytest.raises(ValueError, match=r"discount=1.5 must lie in \[0, 1\]"):
        distillation_advantages(a, a, a, discount=1.5)
    with pytest.raises(ValueError, match=r"kl_coef=-1.0 must be >= 0"):
        distillation_advantages(a, a, a, kl_coef=-1.0)
    with pytest.raises(
        ValueError,
        match=r"distillation_advantages: shape mismatch: student_log_probs\[2, 3\], "
        r"teacher_log_probs\[2, 4\]",
    ):
        distillation_advantages(a, b, a)
    with pytest.raises(ValueError, match=r"task_advantages\[2, 4\]"):
        distillation_advantages(a, a, a, task_advantages=b)
    v = bk.asarray(np.zeros(3))
    with pytest.raises(ValueError, match=r"must be \[B, T\] per-token log-probs, got shape \(3,\)"):
        distillation_advantages(v, v, v)
