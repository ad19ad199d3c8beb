"""Advantage estimators (host side, any array namespace; no gradients flow through them).

Shapes: ``[B, T]`` = batch x response tokens; ``[B]`` one value per sample.

* ``token_rewards`` [B, T]: the reward of each response token. Outcome rewards sit on the
  last valid token and are 0 elsewhere; a sample's *score* is ``sum_t token_rewards``
  (summed over all positions, masked or not, as verl: rewards at masked positions are
  expected to be 0).
* ``mask`` [B, T]: the response mask (1 on real response tokens, 0 on padding).
* ``group_ids`` [B]: samples with equal id answer the same prompt (GRPO's group). Ints
  (numpy / torch / jax) or a numpy array of strings. Grouping is done on the host with
  numpy (ids are not differentiable); the arithmetic stays in the inputs' namespace.

Conventions follow verl ``trainer/ppo/core_algos.py`` where published implementations
differ, with the differences from verl stated per function. Everywhere here, outputs are
0 at masked positions (verl leaves whitened values there for GAE; losses never read them).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

from polyrl.algos.distillation import distillation_advantages
from polyrl.tensor import (
    asarray_like,
    masked_whiten,
    namespace,
    reverse_linear_scan,
    shift_left,
    stop_gradient,
    to_numpy,
)

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AdvantageEstimator",
    "gae",
    "grpo",
    "rloo",
    "reinforce_plus_plus",
    "reinforce_plus_plus_baseline",
    "remax",
    "on_policy_distillation",
    "group_index",
]

Array = Any


def _check(fn: str, **arrays: Array) -> None:
    shapes = {k: tuple(v.shape) for k, v in arrays.items()}
    first = next(iter(shapes.values()))
    if len(first) != 2 or any(s != first for s in shapes.values()):
        listed = ", ".join(f"{k}{list(v)}" for k, v in shapes.items())
        raise ValueError(
            f"{fn}: {listed}; {', '.join(shapes)} must all be [B, T] with the same shape"
        )


def _check_per_sample(fn: str, name: str, x: Any, batch: int) -> None:
    shape = tuple(np.shape(x)) if not hasattr(x, "shape") else tuple(x.shape)
    if shape != (batch,):
        raise ValueError(
            f"{fn}: {name} has shape {list(shape)}; it must be [B] = [{batch}] "
            "(one entry per sample)"
        )


def group_index(group_ids: Any) -> tuple[np.ndarray, np.ndarray]:
    """Host-side grouping: ``(inverse [B] int, counts [K] int)`` with ``K`` distinct ids;
    sample ``b`` belongs to group ``inverse[b]`` of size ``counts[inverse[b]]``."""
    ids = to_numpy(group_ids)
    _, inverse, counts = np.unique(ids, return_inverse=True, return_counts=True)
    return inverse.reshape(-1), counts


def _group_stats(scores: Array, group_ids: Any, fn: str) -> tuple[Array, Array, Array]:
    """Per-sample ``(group mean, unbiased group std, group size)`` [B] each, in xp.

    Uses a one-hot membership matrix [B, K] (numpy, host) and two matmuls in xp.
    Singleton groups get std 0 here; the callers apply verl's singleton rules.
    """
    _check_per_sample(fn, "group_ids", group_ids, scores.shape[0])
    xp = namespace(scores)
    inverse, counts = group_index(group_ids)
    onehot = asarray_like((inverse[:, None] == np.arange(counts.size)[None, :]), scores)
    size = asarray_like(counts[inverse], scores)

    def group_sum(x):  # [B] -> [B]: sum of x over the sample's group
        return xp.matmul(onehot, xp.matmul(xp.matrix_transpose(onehot), x))

    mean = group_sum(scores) / size
    var = group_sum((scores - mean) ** 2) / xp.where(size > 1, size - 1, xp.ones_like(size))
    return mean, xp.sqrt(var), size


def _outcome_scores(token_rewards: Array) -> Array:
    xp = namespace(token_rewards)
    return xp.sum(stop_gradient(token_rewards), axis=-1)


def _broadcast(per_sample: Array, mask: Array) -> Array:
    xp = namespace(per_sample, mask)
    return per_sample[:, None] * xp.astype(mask, per_sample.dtype)


# --------------------------------------------------------------------------- estimators


def gae(
    token_rewards: Array,
    values: Array,
    mask: Array,
    gamma: float = 1.0,
    lam: float = 1.0,
    whiten: bool = True,
) -> tuple[Array, Array]:
    """Generalized Advantage Estimation (Schulman et al. 2016, arXiv:1506.02438).

    For valid tokens, with ``V'_t`` the value of the next *valid* token (0 past the end)::

        delta_t = r_t + gamma V'_t - V_t
        A_t     = delta_t + gamma lam A'_t        (A'_t: advantage of the next valid token)
        R_t     = A_t + V_t                       (returns, the critic's target)

    Masked positions are *skipped* (verl: values and TD-errors of observation tokens in
    the middle of a response do not break the recursion): a masked position passes the
    next valid token's value and advantage through. Implemented as two reverse linear
    scans. ``whiten=True`` (verl always whitens) then normalises the advantages over all
    valid tokens of the batch (:func:`polyrl.tensor.masked_whiten`); returns are computed
    from the unwhitened advantages. Inputs [B, T]; returns ``(advantages, returns)``
    [B, T], both 0 at masked positions.
    """
    _check("gae", token_rewards=token_rewards, values=values, mask=mask)
    xp = namespace(token_rewards, values, mask)
    r, v = stop_gradient(token_rewards), stop_gradient(values)
    m = xp.astype(mask, r.dtype)
    # next_value[t] = V of the first valid token after t (0 if none): nv_t = m_t V_t +
    # (1 - m_t) nv_{t+1}, shifted left by one.
    next_value = shift_left(reverse_linear_scan(m * v, 1.0 - m))
    delta = r + gamma * next_value - v
    # A_t = m_t delta_t + (m_t gamma lam + 1 - m_t) A_{t+1}: skip masked positions.
    adv = reverse_linear_scan(m * delta, m * (gamma * lam) + (1.0 - m))
    returns = (adv + v) * m
    if whiten:
        adv = masked_whiten(adv, m)
    return adv * m, returns


def grpo(
    token_rewards: Array,
    mask: Array,
    group_ids: Any,
    eps: float = 1e-6,
    scale_by_std: bool = True,
) -> Array:
    """GRPO outcome advantage (Shao et al. 2024, DeepSeekMath, arXiv:2402.03300).

    Per sample ``b`` of group ``g`` with score ``s_b = sum_t r_bt``::

        A_b = (s_b - mean_g) / (std_g + eps)      scale_by_std=True   (GRPO)
        A_b =  s_b - mean_g                       scale_by_std=False  (Dr. GRPO,
                                                    Liu et al. 2025, arXiv:2503.20783)

    broadcast over the valid tokens: ``A_bt = A_b m_bt`` [B, T]. verl conventions:
    ``std_g`` is the *unbiased* (n - 1) standard deviation; ``eps`` is added to the std,
    not the variance; a *singleton* group has mean 0 and std 1, so its advantage is
    ``s_b / (1 + eps)`` (its raw score), not 0. A group whose scores are all equal gets
    advantage 0.
    """
    _check("grpo", token_rewards=token_rewards, mask=mask)
    xp = namespace(token_rewards, mask)
    scores = _outcome_scores(token_rewards)
    mean, std, size = _group_stats(scores, group_ids, "grpo")
    single = size < 2
    mean = xp.where(single, xp.zeros_like(mean), mean)
    adv = scores - mean
    if scale_by_std:
        adv = adv / (xp.where(single, xp.ones_like(std), std) + eps)
    return _broadcast(adv, mask)


def rloo(token_rewards: Array, mask: Array, group_ids: Any) -> Array:
    """REINFORCE leave-one-out (Kool et al. 2019; Ahmadian et al. 2024, arXiv:2402.14740).

    Each sample's baseline is the mean score of the *other* samples of its group::

        A_b = s_b - (sum_{j in g, j != b} s_j) / (n_g - 1) = n_g / (n_g - 1) (s_b - mean_g)

    broadcast over valid tokens [B, T]. verl convention: a singleton group (no other
    sample) keeps its raw score ``s_b`` as advantage.
    """
    _check("rloo", token_rewards=token_rewards, mask=mask)
    xp = namespace(token_rewards, mask)
    scores = _outcome_scores(token_rewards)
    mean, _, size = _group_stats(scores, group_ids, "rloo")
    single = size < 2
    factor = size / xp.where(single, xp.ones_like(size), size - 1)
    adv = xp.where(single, scores, (scores - mean) * factor)
    return _broadcast(adv, mask)


def reinforce_plus_plus(
    token_rewards: Array, mask: Array, gamma: float = 1.0
) -> tuple[Array, Array]:
    """REINFORCE++ (Hu 2025, arXiv:2501.03262): discounted returns, whitened over the batch.

    ``R_t = r_t + gamma R'_t`` over valid tokens, ``R'_t`` the return of the next valid
    token (0 past the end), then ``A = masked_whiten(R, mask) * mask`` over all valid
    tokens of the batch. Masked positions are skipped as in :func:`gae`: an observation
    token inside a multi-turn episode passes the return through instead of cutting it
    (verl resets the running return at every masked token, which for right padding
    gives the same returns on valid tokens). Inputs [B, T]; returns
    ``(advantages, returns)`` [B, T] (returns masked).
    """
    _check("reinforce_plus_plus", token_rewards=token_rewards, mask=mask)
    xp = namespace(token_rewards, mask)
    r = stop_gradient(token_rewards)
    m = xp.astype(mask, r.dtype)
    returns = reverse_linear_scan(m * r, m * gamma + (1.0 - m))
    adv = masked_whiten(returns, m) * m
    return adv, returns * m


def reinforce_plus_plus_baseline(
    token_rewards: Array, mask: Array, group_ids: Any, eps: float = 1e-6
) -> Array:
    """REINFORCE++-baseline (Hu 2025, arXiv:2501.03262).

    Subtract the group mean score (``s_b - mean_g``; a singleton group has mean 0, as
    verl), broadcast over valid tokens, then whiten over all valid tokens of the batch:
    ``A = (x - mean) / sqrt(var + eps) * mask`` (unbiased batch variance). verl uses the
    same formula with ``eps = 1e-8`` fixed; pass ``eps=1e-8`` to match it to the last bit.
    """
    _check("reinforce_plus_plus_baseline", token_rewards=token_rewards, mask=mask)
    xp = namespace(token_rewards, mask)
    scores = _outcome_scores(token_rewards)
    mean, _, size = _group_stats(scores, group_ids, "reinforce_plus_plus_baseline")
    centred = scores - xp.where(size < 2, xp.zeros_like(mean), mean)
    per_token = _broadcast(centred, mask)
    return masked_whiten(per_token, mask, eps=eps) * xp.astype(mask, per_token.dtype)


def remax(token_rewards: Array, mask: Array, baseline_scores: Array) -> tuple[Array, Array]:
    """ReMax (Li et al. 2023, arXiv:2310.10505): REINFORCE with the greedy response's
    score as baseline.

    ``R_t = sum_{t' >= t} r_t' m_t'`` (undiscounted reward-to-go) and
    ``A_t = (R_t - b) m_t`` with ``b = baseline_scores`` [B] (the score of the greedy
    decode of the same prompt). Returns ``(advantages, returns)`` [B, T] as verl.
    """
    _check("remax", token_rewards=token_rewards, mask=mask)
    _check_per_sample("remax", "baseline_scores", baseline_scores, token_rewards.shape[0])
    xp = namespace(token_rewards, mask, baseline_scores)
    m = xp.astype(mask, token_rewards.dtype)
    returns = reverse_linear_scan(stop_gradient(token_rewards) * m, 1.0)
    adv = returns * m - stop_gradient(baseline_scores)[:, None] * m
    return adv, returns * m


def on_policy_distillation(
    token_rewards: Array,
    mask: Array,
    old_log_probs: Array,
    teacher_log_probs: Array,
    group_ids: Any = None,
    distill_coef: float = 1.0,
    distill_discount: float = 0.0,
    task_reward_coef: float = 0.0,
    scale_by_std: bool = True,
    distill_baseline: bool = False,
) -> tuple[Array, dict[str, Array]]:
    """On-policy distillation's advantage: ``distillation.distillation_advantages`` of the
    student's sampled log-probs (``old_log_probs``) and the teacher's of the same tokens,
    weighted by ``distill_coef``, discounted by ``distill_discount``, centred on the batch's
    mean when ``distill_baseline``, plus, when
    ``task_reward_coef > 0``, that weight times the GRPO advantage of the task reward
    (:func:`grpo` on ``token_rewards`` and ``group_ids``, ``scale_by_std``).

    Returns ``(advantages [B, T], metrics)``: ``distill/reverse_kl`` (the token mean of
    ``old_log_probs - teacher_log_probs``) and ``distill/tokens`` (its denominator).
    """
    task = None
    if task_reward_coef:
        if group_ids is None:
            raise ValueError(
                f"on_policy_distillation: task_reward_coef={task_reward_coef!r} mixes in GRPO's "
                "group advantage, which needs the 'group_ids' column; set task_reward_coef=0"
            )
        task = task_reward_coef * grpo(token_rewards, mask, group_ids, scale_by_std=scale_by_std)
    adv, metrics = distillation_advantages(
        old_log_probs,
        teacher_log_probs,
        mask,
        distill_coef,
        distill_discount,
        task,
        distill_baseline,
    )
    return adv, {f"distill/{k}": v for k, v in metrics.items()}


# --------------------------------------------------------------------------- registry


@dataclasses.dataclass(frozen=True)
class AdvantageEstimator:
    """A registered estimator: which batch columns it reads (passed positionally, in this
    order), which it reads when present (``optional``, by keyword), which ``AlgorithmSpec``
    fields it takes (by keyword), whether it returns ``(advantages, returns)`` (else
    advantages only, and returns = advantages, as verl) and whether it also returns a dict
    of metrics (``metrics``: ``fn`` returns ``(that, metrics)``)."""

    fn: Callable[..., Any]
    columns: tuple[str, ...]
    hparams: tuple[str, ...] = ()
    returns_pair: bool = False
    optional: tuple[str, ...] = ()
    metrics: bool = False

    def __call__(self, columns: dict[str, Array], with_metrics: bool = False, **hparams: Any):
        """``(advantages, returns)`` [B, T] from the named ``columns``; with
        ``with_metrics``, ``(advantages, returns, metrics)`` (``{}`` when it has none)."""
        missing = [c for c in self.columns if c not in columns]
        if missing:
            raise ValueError(
                f"advantage estimator {self.fn.__name__!r} needs columns "
                f"{list(self.columns)}; missing {missing}"
            )
        present = {c: columns[c] for c in self.optional if c in columns}
        out = self.fn(*(columns[c] for c in self.columns), **present, **hparams)
        out, metrics = out if self.metrics else (out, {})
        pair = out if self.returns_pair else (out, out)
        return (*pair, metrics) if with_metrics else pair


# name -> estimator; the one source of valid ``AlgorithmSpec.advantage`` names. Column
# names: "token_rewards" [B, T], "response_mask" [B, T], "values" [B, T] (critic),
# "group_ids" [B], "baseline_scores" [B] (ReMax greedy scores), "old_log_probs" [B, T]
# (the sampling policy's), "teacher_log_probs" [B, T] (the distillation teacher's).
ADVANTAGE_ESTIMATORS: dict[str, AdvantageEstimator] = {
    "gae": AdvantageEstimator(
        gae, ("token_rewards", "values", "response_mask"), ("gamma", "lam"), returns_pair=True
    ),
    "grpo": AdvantageEstimator(
        grpo, ("token_rewards", "response_mask", "group_ids"), ("scale_by_std",)
    ),
    "rloo": AdvantageEstimator(rloo, ("token_rewards", "response_mask", "group_ids")),
    "reinforce_plus_plus": AdvantageEstimator(
        reinforce_plus_plus, ("token_rewards", "response_mask"), ("gamma",), returns_pair=True
    ),
    "reinforce_plus_plus_baseline": AdvantageEstimator(
        reinforce_plus_plus_baseline, ("token_rewards", "response_mask", "group_ids")
    ),
    "remax": AdvantageEstimator(
        remax, ("token_rewards", "response_mask", "baseline_scores"), returns_pair=True
    ),
    "distillation": AdvantageEstimator(
        on_policy_distillation,
        ("token_rewards", "response_mask", "old_log_probs", "teacher_log_probs"),
        (
            "distill_coef",
            "distill_discount",
            "task_reward_coef",
            "scale_by_std",
            "distill_baseline",
        ),
        optional=("group_ids",),
        metrics=True,
    ),
}
