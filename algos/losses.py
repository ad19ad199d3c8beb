"""Policy, value, KL and preference losses, and the one function that reduces them.

Every function is pure math over ``polyrl.tensor``: arrays in (numpy, torch or jax),
arrays of the same kind out, plain Python numbers for hyper-parameters. The losses are
differentiable with torch autograd and ``jax.grad``; the backend differentiates them.

Shapes: ``[B, T]`` = batch x response tokens (token ``t`` of sample ``b``); ``[B]`` one
value per sequence (DPO and the reward model: per preference pair). ``mask`` is the
response mask [B, T] (1 on real response tokens, 0 on padding); bool, int or float.

Signs: every ``loss`` is *minimised*. ``log_probs`` are the current policy's
log-probabilities of the sampled tokens, ``old_log_probs`` those of the policy that
sampled them (the behaviour policy), ``ref_log_probs`` those of the frozen reference.

Aggregation and global normalisers
----------------------------------
A loss matrix [B, T] becomes a scalar only in :func:`aggregate`, with an explicit
``mode`` (see :data:`AGG_MODES`) and explicit *global* normalisers: ``global_tokens``
(valid tokens in the whole optimizer step: every micro-batch, every data-parallel rank)
and ``global_seqs`` (sequences with at least one valid token, likewise). Given them, a
loss is this micro-batch's *contribution*, and summing the contributions of the
micro-batches of a step gives exactly the full-batch value: results do not depend on
micro-batching or data parallelism. Left as ``None``, they default to the local counts
(then the value is the plain local mean).

METRICS CONVENTION (the backends rely on it)
--------------------------------------------
Every metric a loss returns is a scalar array (gradient stopped) that is a *summable
contribution*: it is normalised by the same global normalisers, so summing a metric over
micro-batches and ranks gives the full-batch value, exactly like the loss. Per-token
metrics (``clipfrac``, ``approx_kl``, ``clipfrac_lower``, ``vf_clipfrac``, ...) are
token means, ``aggregate(indicator, mask, "token-mean", global_tokens)``, whatever the
loss's ``agg`` mode, so that a fraction stays a fraction (the definition verl reports, as
``masked_mean``). Per-pair DPO and reward-model metrics are sums divided by
``global_pairs``.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Callable
from typing import Any

import numpy as np

from polyrl.tensor import (
    entropy_from_logits,
    log_sigmoid,
    masked_sum,
    namespace,
    stop_gradient,
)

__all__ = [
    "AGG_MODES",
    "KL_KINDS",
    "DPO_KINDS",
    "POLICY_LOSSES",
    "PolicyLoss",
    "aggregate",
    "ppo_policy_loss",
    "gspo_policy_loss",
    "cispo_policy_loss",
    "IS_LEVELS",
    "rollout_log_ratio",
    "truncated_is_weight",
    "masked_is_weight",
    "value_loss",
    "kl_penalty",
    "entropy_from_logits",
    "dpo_loss",
    "bradley_terry_loss",
    "pair_accuracy",
    "sft_loss",
]

Array = Any
Metrics = dict[str, Array]

# The ratio is exp(log_probs - old_log_probs); the log-ratio is clamped to this range
# before exp so that one wild token cannot overflow (verl: +-20).
LOG_RATIO_CLAMP = 20.0


# --------------------------------------------------------------------------- checks


def check_same_shape(fn: str, **arrays: Array) -> None:
    """Raise ValueError naming every argument's shape unless all shapes are equal."""
    shapes = {name: tuple(a.shape) for name, a in arrays.items() if a is not None}
    if len(set(shapes.values())) > 1:
        listed = ", ".join(f"{k}{list(v)}" for k, v in shapes.items())
        raise ValueError(
            f"{fn}: shape mismatch: {listed}; {', '.join(shapes)} must all have the same shape"
        )


def _choice_error(fn: str, arg: str, value: Any, valid: Any) -> ValueError:
    return ValueError(f"{fn}: unknown {arg} {value!r}; valid choices: {sorted(valid)}")


def _check_agg(fn: str, agg: str) -> None:
    if agg not in AGG_MODES:
        raise _choice_error(fn, "agg", agg, AGG_MODES)


def _divisor(value: Any) -> Any:
    """A global normaliser as a Python float (numbers, numpy scalars, 0-d numpy) or the
    backend's own 0-d array (e.g. a traced jax value), unchanged."""
    if isinstance(value, numbers.Number | np.generic) or (
        isinstance(value, np.ndarray) and value.ndim == 0
    ):
        return float(value)
    return value


# --------------------------------------------------------------------------- aggregate


def _nonzero_count(xp: Any, count: Array) -> Array:
    return xp.where(count > 0, count, xp.ones_like(count))


def _token_mean(loss_mat, m, xp, global_tokens, global_seqs, norm_len):
    if global_tokens is None:
        global_tokens = _nonzero_count(xp, xp.sum(m))
    return masked_sum(loss_mat, m) / _divisor(global_tokens)


def _seq_reduce(per_seq, m, xp, global_seqs):
    if global_seqs is None:
        global_seqs = _nonzero_count(xp, xp.sum(xp.astype(xp.sum(m, axis=-1) > 0, m.dtype)))
    return xp.sum(per_seq) / _divisor(global_seqs)


def _seq_mean_token_sum(loss_mat, m, xp, global_tokens, global_seqs, norm_len):
    return _seq_reduce(masked_sum(loss_mat, m, axis=-1), m, xp, global_seqs)


def _seq_mean_token_mean(loss_mat, m, xp, global_tokens, global_seqs, norm_len):
    per_seq = masked_sum(loss_mat, m, axis=-1) / _nonzero_count(xp, xp.sum(m, axis=-1))
    return _seq_reduce(per_seq, m, xp, global_seqs)


def _seq_mean_token_sum_norm(loss_mat, m, xp, global_tokens, global_seqs, norm_len):
    if norm_len is None:
        norm_len = loss_mat.shape[-1]
    per_seq = masked_sum(loss_mat, m, axis=-1) / float(norm_len)
    return _seq_reduce(per_seq, m, xp, global_seqs)


# mode -> reducer(loss_mat, mask, xp, global_tokens, global_seqs, norm_len)
AGG_MODES: dict[str, Callable[..., Array]] = {
    "token-mean": _token_mean,
    "seq-mean-token-sum": _seq_mean_token_sum,
    "seq-mean-token-mean": _seq_mean_token_mean,
    "seq-mean-token-sum-norm": _seq_mean_token_sum_norm,
}


def aggregate(
    loss_mat: Array,
    mask: Array,
    mode: str = "token-mean",
    global_tokens: float | Array | None = None,
    global_seqs: float | Array | None = None,
    norm_len: float | None = None,
) -> Array:
    """Reduce a per-token loss ``loss_mat`` [B, T] to a scalar contribution.

    With ``m = mask``, ``N_tok = global_tokens``, ``N_seq = global_seqs``:

    * ``"token-mean"``: ``sum_{b,t} l[b,t] m[b,t] / N_tok`` (every token weighs the same;
      DAPO's token-level loss).
    * ``"seq-mean-token-sum"``: ``sum_b (sum_t l m) / N_seq``.
    * ``"seq-mean-token-mean"``: ``sum_b (sum_t l m / sum_t m) / N_seq`` (original
      GRPO; a fully masked row contributes 0).
    * ``"seq-mean-token-sum-norm"``: ``sum_b (sum_t l m / norm_len) / N_seq`` with the
      constant ``norm_len`` (default ``T = loss_mat.shape[-1]``, the max response
      length), as Dr. GRPO. Pass ``norm_len`` (e.g. the configured max response length)
      when micro-batches may be padded to different ``T``, or the result depends on the
      padding. (Current verl divides by ``norm_len`` only, not by ``N_seq``; Dr. GRPO's
      objective and this function also average over sequences.)

    ``N_tok`` / ``N_seq`` default to the local counts (sequences with at least one valid
    token; at least 1, so an empty mask gives 0). With the global counts given, the sum
    over micro-batches of ``aggregate`` equals the full-batch value (module docstring).
    """
    if mode not in AGG_MODES:
        raise _choice_error("aggregate", "mode", mode, AGG_MODES)
    check_same_shape("aggregate", loss_mat=loss_mat, mask=mask)
    if loss_mat.ndim != 2:
        raise ValueError(f"aggregate: loss_mat must be [B, T], got shape {tuple(loss_mat.shape)}")
    xp = namespace(loss_mat, mask)
    m = xp.astype(mask, loss_mat.dtype)
    return AGG_MODES[mode](loss_mat, m, xp, global_tokens, global_seqs, norm_len)


def _token_metric(x: Array, mask: Array, global_tokens: Any) -> Array:
    """A per-token metric (float [B, T]) as a summable token-mean contribution."""
    return stop_gradient(aggregate(x, mask, "token-mean", global_tokens))


def _as_float(xp: Any, indicator: Array, like: Array) -> Array:
    return xp.astype(indicator, like.dtype)


# --------------------------------------------------------------------------- policy losses


def _log_ratio(xp: Any, log_probs: Array, old_log_probs: Array) -> Array:
    return xp.clip(log_probs - old_log_probs, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def ppo_policy_loss(
    log_probs: Array,
    old_log_probs: Array,
    advantages: Array,
    mask: Array,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = 3.0,
    agg: str = "token-mean",
    global_tokens: float | Array | None = None,
    global_seqs: float | Array | None = None,
    weights: Array | None = None,
) -> tuple[Array, Metrics]:
    """PPO clipped surrogate (Schulman et al. 2017), with decoupled clip ranges (DAPO's
    clip-higher when ``clip_high > clip_low``, Yu et al. 2025) and dual clip (Ye et al.
    2020, arXiv:1912.09729). All inputs [B, T]; returns a scalar loss and metrics.

    ``r = exp(clamp(log_probs - old_log_probs, -20, 20))``, ``A = advantages``::

        l1 = -A r
        l2 = -A clip(r, 1 - clip_low, 1 + clip_high)
        l  = max(l1, l2)                              # PPO
        l  = min(l, -A dual_clip)   where A < 0       # dual clip (dual_clip > 1)
        loss = aggregate(l, mask, agg, global_tokens, global_seqs)

    ``dual_clip=None`` turns the dual clip off. ``weights`` [B, T] (optional, gradient
    stopped) multiply ``l`` per token before the aggregation: the truncated
    importance-sampling correction of :func:`truncated_is_weight` (likewise in every policy
    loss). Metrics (token means, module docstring):
    ``clipfrac`` = share of tokens with ``l2 > l1`` (the clip is active),
    ``clipfrac_lower`` = share with ``A < 0`` and ``max(l1, l2) > -A dual_clip`` (the dual
    clip is active), ``approx_kl`` = mean of ``old_log_probs - log_probs`` (k1 estimate
    of KL(old || new)). Same semantics as verl ``compute_policy_loss_vanilla``.
    """
    _check_agg("ppo_policy_loss", agg)
    check_same_shape(
        "ppo_policy_loss",
        log_probs=log_probs,
        old_log_probs=old_log_probs,
        advantages=advantages,
        mask=mask,
    )
    if dual_clip is not None and not dual_clip > 1.0:
        raise ValueError(
            f"ppo_policy_loss: dual_clip must be > 1.0 or None (off), got {dual_clip!r}"
        )
    xp = namespace(log_probs, old_log_probs, advantages, mask)
    log_ratio = _log_ratio(xp, log_probs, old_log_probs)
    ratio = xp.exp(log_ratio)
    l1 = -advantages * ratio
    l2 = -advantages * xp.clip(ratio, 1.0 - clip_low, 1.0 + clip_high)
    clipped = xp.maximum(l1, l2)
    if dual_clip is None:
        losses = clipped
        lower = xp.zeros_like(l1)
    else:
        l3 = -advantages * dual_clip
        negative = advantages < 0
        losses = xp.where(negative, xp.minimum(clipped, l3), clipped)
        lower = _as_float(xp, negative & (clipped > l3), l1)
    loss = aggregate(_weighted(losses, weights), mask, agg, global_tokens, global_seqs)
    metrics = {
        "clipfrac": _token_metric(_as_float(xp, l2 > l1, l1), mask, global_tokens),
        "clipfrac_lower": _token_metric(lower, mask, global_tokens),
        "approx_kl": _token_metric(-log_ratio, mask, global_tokens),
    }
    return loss, metrics


def gspo_policy_loss(
    log_probs: Array,
    old_log_probs: Array,
    advantages: Array,
    mask: Array,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
    agg: str = "seq-mean-token-mean",
    global_tokens: float | Array | None = None,
    global_seqs: float | Array | None = None,
    weights: Array | None = None,
) -> tuple[Array, Metrics]:
    """GSPO: Group Sequence Policy Optimization (Zheng et al. 2025, arXiv:2507.18071).

    The importance ratio is per *sequence*, the length-normalised likelihood ratio
    ``s_b = exp(sum_t m (log_probs - old_log_probs) / max(sum_t m, 1))``. It enters the
    loss per token as ``s_bt = sg[s_b] * pi(y_t) / sg[pi(y_t)]`` (same value as ``s_b``;
    its gradient is ``s_b grad log pi(y_t)``, which aggregated with
    ``seq-mean-token-mean`` is exactly the GSPO gradient ``s_b / |y| sum_t grad log pi``)::

        log s_bt = min(log_probs - sg[log_probs] + sg[log s_b], 10)
        l = max(-A s_bt, -A clip(s_bt, 1 - clip_low, 1 + clip_high))
        loss = aggregate(l, mask, agg, ...)

    Defaults are the paper's clip range (3e-4, 4e-4) and ``agg="seq-mean-token-mean"``
    (verl forces that mode; here it is the default and may be changed). Metrics:
    ``clipfrac`` (token share where the clip is active), ``approx_kl`` as PPO,
    ``clipfrac_lower`` = 0 (no dual clip). Same semantics as verl ``compute_policy_loss_gspo``.
    """
    _check_agg("gspo_policy_loss", agg)
    check_same_shape(
        "gspo_policy_loss",
        log_probs=log_probs,
        old_log_probs=old_log_probs,
        advantages=advantages,
        mask=mask,
    )
    xp = namespace(log_probs, old_log_probs, advantages, mask)
    m = xp.astype(mask, log_probs.dtype)
    log_ratio = log_probs - old_log_probs
    lengths = xp.sum(m, axis=-1)
    seq_log_ratio = masked_sum(log_ratio, m, axis=-1) / _nonzero_count(xp, lengths)
    log_s = log_probs - stop_gradient(log_probs) + stop_gradient(seq_log_ratio)[:, None]
    s = xp.exp(xp.clip(log_s, None, 10.0))
    l1 = -advantages * s
    l2 = -advantages * xp.clip(s, 1.0 - clip_low, 1.0 + clip_high)
    loss = aggregate(_weighted(xp.maximum(l1, l2), weights), mask, agg, global_tokens, global_seqs)
    metrics = {
        "clipfrac": _token_metric(_as_float(xp, l2 > l1, l1), mask, global_tokens),
        "clipfrac_lower": _token_metric(xp.zeros_like(l1), mask, global_tokens),
        "approx_kl": _token_metric(-log_ratio, mask, global_tokens),
    }
    return loss, metrics


def cispo_policy_loss(
    log_probs: Array,
    old_log_probs: Array,
    advantages: Array,
    mask: Array,
    clip_low: float = 1.0,
    clip_high: float = 0.2,
    agg: str = "token-mean",
    global_tokens: float | Array | None = None,
    global_seqs: float | Array | None = None,
    weights: Array | None = None,
) -> tuple[Array, Metrics]:
    """CISPO: clipped IS-weight policy optimisation (MiniMax-M1, arXiv:2506.13585).

    REINFORCE with a clipped, stop-gradient importance weight, so *every* token keeps a
    gradient (PPO drops clipped tokens)::

        r = exp(clamp(log_probs - old_log_probs, -20, 20))
        l = -sg[clip(r, 1 - clip_low, 1 + clip_high)] * A * log_probs
        loss = aggregate(l, mask, agg, ...)

    The paper bounds the weight from above only: the default ``clip_low=1.0`` puts the
    lower bound at 0, which a ratio never reaches (verl's example uses 10 for the same
    effect). The paper does not state its ``eps_high``; 0.2 is verl's example value.
    Metrics: ``clipfrac`` (token share with the weight clipped, either side),
    ``clipfrac_lower`` (clipped from below), ``approx_kl`` as PPO. Same loss as verl
    ``compute_policy_loss_cispo`` (verl reports ``clipfrac_lower`` as 0).
    """
    _check_agg("cispo_policy_loss", agg)
    check_same_shape(
        "cispo_policy_loss",
        log_probs=log_probs,
        old_log_probs=old_log_probs,
        advantages=advantages,
        mask=mask,
    )
    xp = namespace(log_probs, old_log_probs, advantages, mask)
    log_ratio = _log_ratio(xp, log_probs, old_log_probs)
    ratio = xp.exp(log_ratio)
    weight = stop_gradient(xp.clip(ratio, 1.0 - clip_low, 1.0 + clip_high))
    loss = aggregate(
        _weighted(-weight * advantages * log_probs, weights), mask, agg, global_tokens, global_seqs
    )
    metrics = {
        "clipfrac": _token_metric(_as_float(xp, weight != ratio, ratio), mask, global_tokens),
        "clipfrac_lower": _token_metric(
            _as_float(xp, ratio < 1.0 - clip_low, ratio), mask, global_tokens
        ),
        "approx_kl": _token_metric(-log_ratio, mask, global_tokens),
    }
    return loss, metrics


# --------------------------------------------------------------------------- off-policy corrections

# level -> how the rollout/trainer ratio of a token is formed (see rollout_log_ratio)
IS_LEVELS = ("token", "sequence", "geometric")


def rollout_log_ratio(
    old_log_probs: Array, rollout_log_probs: Array, mask: Array, level: str = "token"
) -> Array:
    """The log of the trainer/rollout ratio ``pi_old / mu`` that each token's correction
    uses, [B, T], clamped to +-20 before any ``exp``:

    * ``"token"``: each token's own ``log pi_old(y_t) - log mu(y_t)``;
    * ``"sequence"``: the sequence's product ratio, ``sum_t m (log pi_old - log mu)``,
      the same for every token of the row (the exact sequence IS weight);
    * ``"geometric"``: its geometric mean, ``sum_t m (log pi_old - log mu) / sum_t m``
      (GSPO's length-normalised ratio; verl's rollout correction "geometric").
    """
    if level not in IS_LEVELS:
        raise _choice_error("rollout_log_ratio", "level", level, IS_LEVELS)
    check_same_shape(
        "rollout_log_ratio",
        old_log_probs=old_log_probs,
        rollout_log_probs=rollout_log_probs,
        mask=mask,
    )
    xp = namespace(old_log_probs, rollout_log_probs, mask)
    diff = old_log_probs - rollout_log_probs
    if level == "token":
        return _log_ratio(xp, old_log_probs, rollout_log_probs)
    m = xp.astype(mask, diff.dtype)
    per_seq = masked_sum(diff, m, axis=-1)
    if level == "geometric":
        per_seq = per_seq / _nonzero_count(xp, xp.sum(m, axis=-1))
    per_seq = xp.clip(per_seq, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return per_seq[:, None] + xp.zeros_like(diff)


def _seq_metric(indicator: Array, mask: Array, global_seqs: Any) -> Array:
    """Share of sequences (with a valid token) where ``indicator`` [B, T] holds on some
    valid token, as a summable contribution (sum / ``global_seqs``)."""
    xp = namespace(indicator, mask)
    m = xp.astype(mask, indicator.dtype)
    hit = xp.astype(masked_sum(indicator, m, axis=-1) > 0, indicator.dtype)
    return stop_gradient(_seq_reduce(hit, m, xp, global_seqs))


def truncated_is_weight(
    old_log_probs: Array,
    rollout_log_probs: Array,
    mask: Array,
    cap: float,
    global_tokens: float | Array | None = None,
    level: str = "token",
    global_seqs: float | Array | None = None,
) -> tuple[Array, Metrics]:
    """Truncated importance sampling (TIS; Yao et al. 2025, "Your efficient RL framework
    secretly brings you off-policy RL training"; verl's ``tis_imp_ratio_cap`` and its
    rollout correction ``rollout_is``).

    The rollout engine samples with its own kernels (and, in the asynchronous mode, with
    weights up to ``max_staleness`` updates older), so its log-probs ``rollout_log_probs``
    differ from those the trainer computes for the same tokens, ``old_log_probs``. The
    policy loss is computed against the trainer's ``old_log_probs``; each token's loss is
    then multiplied by the stop-gradient weight [B, T]::

        w = sg[min(exp(rollout_log_ratio(old_log_probs, rollout_log_probs, mask, level)), cap)]

    (truncated from above only, as verl): per token (``level="token"``), or one weight per
    sequence, the product (``"sequence"``) or geometric mean (``"geometric"``) of its
    tokens' ratios. ``cap`` must be > 0. Metrics: ``tis_weight_mean`` (token mean of
    ``w``), ``tis_ratio_mean`` (token mean of the untruncated ratio), ``tis_clipfrac``
    (share of tokens whose ratio exceeded ``cap``) and ``tis_clip_seqfrac`` (share of
    sequences with such a token).
    """
    if not cap > 0:
        raise ValueError(f"truncated_is_weight: cap must be > 0, got {cap!r}")
    xp = namespace(old_log_probs, rollout_log_probs, mask)
    ratio = xp.exp(rollout_log_ratio(old_log_probs, rollout_log_probs, mask, level))
    weight = stop_gradient(xp.clip(ratio, None, cap))
    clipped = _as_float(xp, ratio > cap, ratio)
    metrics = {
        "tis_weight_mean": _token_metric(weight, mask, global_tokens),
        "tis_ratio_mean": _token_metric(stop_gradient(ratio), mask, global_tokens),
        "tis_clipfrac": _token_metric(clipped, mask, global_tokens),
        "tis_clip_seqfrac": _seq_metric(clipped, mask, global_seqs),
    }
    return weight, metrics


def masked_is_weight(
    old_log_probs: Array,
    rollout_log_probs: Array,
    mask: Array,
    low: float | None,
    high: float | None,
    global_tokens: float | Array | None = None,
    level: str = "token",
    global_seqs: float | Array | None = None,
) -> tuple[Array, Metrics]:
    """Masked importance sampling (IcePop, "Every step evolves", Ling team 2025; verl's
    rollout correction rejection sampling ``rollout_rs``): a token whose trainer/rollout
    ratio ``r = exp(rollout_log_ratio(..., level))`` leaves the band ``[low, high]`` is
    removed from the policy loss; the others keep weight 1. The stop-gradient 0/1 weight
    [B, T]::

        w = sg[1 if low <= r <= high else 0]      (low = None: no lower bound; high likewise)

    ``level="token"`` masks single tokens (IcePop); ``"sequence"`` / ``"geometric"`` mask
    whole sequences whose product / geometric-mean ratio leaves the band. A masked token
    still counts in the loss's normalisers (IcePop's objective averages over all tokens).
    Metrics: ``is_mask_frac`` (share of tokens masked), ``is_mask_seqfrac`` (share of
    sequences with a masked token), ``is_mask_ratio_mean`` (token mean of ``r``).
    """
    if low is None and high is None:
        raise ValueError("masked_is_weight: set low, high or both (the band [low, high])")
    if (low is not None and not 0 <= low < 1) or (high is not None and not high > 1):
        raise ValueError(
            f"masked_is_weight: the band must hold ratio 1 (0 <= low < 1 < high), "
            f"got low={low!r}, high={high!r}"
        )
    xp = namespace(old_log_probs, rollout_log_probs, mask)
    ratio = stop_gradient(xp.exp(rollout_log_ratio(old_log_probs, rollout_log_probs, mask, level)))
    out = xp.zeros_like(ratio) > 1.0
    if low is not None:
        out = out | (ratio < low)
    if high is not None:
        out = out | (ratio > high)
    masked = _as_float(xp, out, ratio)
    metrics = {
        "is_mask_frac": _token_metric(masked, mask, global_tokens),
        "is_mask_seqfrac": _seq_metric(masked, mask, global_seqs),
        "is_mask_ratio_mean": _token_metric(ratio, mask, global_tokens),
    }
    return 1.0 - masked, metrics


def _weighted(losses: Array, weights: Array | None) -> Array:
    """Per-token losses times importance weights [B, T] (None: unchanged)."""
    return losses if weights is None else losses * weights


@dataclasses.dataclass(frozen=True)
class PolicyLoss:
    """A registered policy loss: the function and the hyper-parameters it takes (names of
    ``AlgorithmSpec`` fields, passed by keyword)."""

    fn: Callable[..., tuple[Array, Metrics]]
    hparams: tuple[str, ...]


# name -> policy loss; the one source of valid ``AlgorithmSpec.policy_loss`` names.
POLICY_LOSSES: dict[str, PolicyLoss] = {
    "ppo": PolicyLoss(ppo_policy_loss, ("clip_low", "clip_high", "dual_clip")),
    "gspo": PolicyLoss(gspo_policy_loss, ("clip_low", "clip_high")),
    "cispo": PolicyLoss(cispo_policy_loss, ("clip_low", "clip_high")),
}


# --------------------------------------------------------------------------- value loss


def value_loss(
    values: Array,
    old_values: Array,
    returns: Array,
    mask: Array,
    clip: float | None = 0.5,
    agg: str = "token-mean",
    global_tokens: float | Array | None = None,
    global_seqs: float | Array | None = None,
) -> tuple[Array, Metrics]:
    """Clipped value loss of PPO (as verl ``compute_value_loss`` / TRL). All inputs [B, T]::

        v_clip = clip(values, old_values - clip, old_values + clip)
        l = max((values - returns)^2, (v_clip - returns)^2)
        loss = 0.5 * aggregate(l, mask, agg, ...)

    ``clip=None`` gives the unclipped ``0.5 (values - returns)^2``. Metrics (token means):
    ``vf_clipfrac`` = share of tokens where the clipped term is larger, ``vpred_mean`` =
    mean predicted value.
    """
    _check_agg("value_loss", agg)
    check_same_shape("value_loss", values=values, old_values=old_values, returns=returns, mask=mask)
    xp = namespace(values, old_values, returns, mask)
    l1 = (values - returns) ** 2
    if clip is None:
        losses, frac = l1, xp.zeros_like(l1)
    else:
        v_clip = xp.clip(values, old_values - clip, old_values + clip)
        l2 = (v_clip - returns) ** 2
        losses, frac = xp.maximum(l1, l2), _as_float(xp, l2 > l1, l1)
    loss = 0.5 * aggregate(losses, mask, agg, global_tokens, global_seqs)
    metrics = {
        "vf_clipfrac": _token_metric(frac, mask, global_tokens),
        "vpred_mean": _token_metric(values, mask, global_tokens),
    }
    return loss, metrics


# --------------------------------------------------------------------------- KL estimators


def _k1(log_probs, ref_log_probs, xp):
    return log_probs - ref_log_probs


def _abs(log_probs, ref_log_probs, xp):
    return xp.abs(log_probs - ref_log_probs)


def _k2(log_probs, ref_log_probs, xp):
    return 0.5 * (log_probs - ref_log_probs) ** 2


def _k3(log_probs, ref_log_probs, xp):
    log_r = xp.clip(ref_log_probs - log_probs, -20.0, 20.0)
    return xp.clip(xp.exp(log_r) - log_r - 1.0, -10.0, 10.0)


def _straight_through(forward: Callable) -> Callable:
    """Value of ``forward``, gradient of k2 (verl's ``"k1+"`` / ``"k3+"``): k1 and k3 are
    unbiased for the KL *value* but not for its gradient; k2's gradient is."""

    def estimator(log_probs, ref_log_probs, xp):
        grad_path = _k2(log_probs, ref_log_probs, xp)
        return (
            grad_path
            - stop_gradient(grad_path)
            + stop_gradient(forward(log_probs, ref_log_probs, xp))
        )

    return estimator


# kind -> estimator(log_probs, ref_log_probs, xp) [B, T]; verl's names are aliases.
KL_KINDS: dict[str, Callable[..., Array]] = {
    "k1": _k1,
    "kl": _k1,
    "abs": _abs,
    "k2": _k2,
    "mse": _k2,
    "k3": _k3,
    "low_var_kl": _k3,
    "k1+": _straight_through(_k1),
    "k3+": _straight_through(_k3),
    "low_var_kl+": _straight_through(_k3),
}


def kl_penalty(log_probs: Array, ref_log_probs: Array, kind: str) -> Array:
    """Per-token estimate of KL(pi || pi_ref) from sampled-token log-probs: [B, T] -> [B, T].

    With ``d = log_probs - ref_log_probs`` (Schulman, "Approximating KL divergence", 2020):

    * ``"k1"`` (alias ``"kl"``): ``d`` (unbiased, high variance, can be negative);
    * ``"abs"``: ``|d|``;
    * ``"k2"`` (alias ``"mse"``): ``d^2 / 2``;
    * ``"k3"`` (alias ``"low_var_kl"``): ``exp(-d) + d - 1`` (unbiased, >= 0), computed
      as verl: ``-d`` clamped to [-20, 20] before ``exp`` and the result clamped to
      [-10, 10], so one extreme token cannot blow up the loss;
    * ``"k1+"``, ``"k3+"`` (``"low_var_kl+"``): the value of k1 / k3 with the gradient
      of k2 (straight-through, verl).

    Unmasked: aggregate with :func:`aggregate`.
    """
    if kind not in KL_KINDS:
        raise _choice_error("kl_penalty", "kind", kind, KL_KINDS)
    check_same_shape("kl_penalty", log_probs=log_probs, ref_log_probs=ref_log_probs)
    xp = namespace(log_probs, ref_log_probs)
    return KL_KINDS[kind](log_probs, ref_log_probs, xp)


# --------------------------------------------------------------------------- DPO


def _dpo_sigmoid(logits, beta, label_smoothing, xp):
    return (
        -log_sigmoid(beta * logits) * (1.0 - label_smoothing)
        - log_sigmoid(-beta * logits) * label_smoothing
    )


def _dpo_ipo(logits, beta, label_smoothing, xp):
    return (logits - 1.0 / (2.0 * beta)) ** 2


def _dpo_hinge(logits, beta, label_smoothing, xp):
    margin = 1.0 - beta * logits
    return xp.where(margin > 0, margin, xp.zeros_like(margin))


# kind -> per-pair loss(logits, beta, label_smoothing, xp) [B]
DPO_KINDS: dict[str, Callable[..., Array]] = {
    "sigmoid": _dpo_sigmoid,
    "ipo": _dpo_ipo,
    "hinge": _dpo_hinge,
}


def dpo_loss(
    policy_chosen: Array,
    policy_rejected: Array,
    ref_chosen: Array,
    ref_rejected: Array,
    beta: float = 0.1,
    kind: str = "sigmoid",
    label_smoothing: float = 0.0,
    global_pairs: float | Array | None = None,
) -> tuple[Array, Metrics]:
    """Direct preference optimisation losses, one per preference pair: [B] -> [B].

    Inputs are per-sequence *summed* response log-probs [B] (chosen / rejected response of
    pair ``b``, under the policy and the frozen reference). With
    ``h = (policy_chosen - policy_rejected) - (ref_chosen - ref_rejected)``:

    * ``"sigmoid"`` (DPO, Rafailov et al. 2023; conservative DPO with label smoothing
      ``eps``): ``-(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h)``;
    * ``"ipo"`` (Azar et al. 2023): ``(h - 1 / (2 beta))^2`` (the paper uses length-
      averaged log-probs; pass those if you want that variant);
    * ``"hinge"`` (SLiC, Zhao et al. 2023): ``max(0, 1 - beta h)``.

    ``label_smoothing`` is only defined for ``"sigmoid"`` (ValueError otherwise).
    Returns the unreduced losses [B] and metrics (gradient stopped), each a summable
    contribution ``sum_b x_b / global_pairs`` (default ``B``): ``rewards/chosen``
    (``beta (policy_chosen - ref_chosen)``), ``rewards/rejected``, ``rewards/margins``
    (chosen - rejected) and ``rewards/accuracies`` (share of pairs with chosen reward >
    rejected reward). Same formulas as TRL's ``DPOTrainer``.
    """
    if kind not in DPO_KINDS:
        raise _choice_error("dpo_loss", "kind", kind, DPO_KINDS)
    if label_smoothing != 0.0 and kind != "sigmoid":
        raise ValueError(
            f"dpo_loss: label_smoothing={label_smoothing!r} is only defined for kind='sigmoid' "
            f"(got kind={kind!r}); set label_smoothing=0.0"
        )
    check_same_shape(
        "dpo_loss",
        policy_chosen=policy_chosen,
        policy_rejected=policy_rejected,
        ref_chosen=ref_chosen,
        ref_rejected=ref_rejected,
    )
    if policy_chosen.ndim != 1:
        raise ValueError(
            f"dpo_loss: inputs must be [B] per-sequence log-probs, got shape "
            f"{tuple(policy_chosen.shape)}; sum token log-probs over the response first"
        )
    xp = namespace(policy_chosen, policy_rejected, ref_chosen, ref_rejected)
    logits = (policy_chosen - policy_rejected) - (ref_chosen - ref_rejected)
    losses = DPO_KINDS[kind](logits, beta, label_smoothing, xp)
    chosen = beta * (policy_chosen - ref_chosen)
    rejected = beta * (policy_rejected - ref_rejected)
    return losses, _pair_metrics(chosen, rejected, None, global_pairs)


def _pair_metrics(
    chosen: Array, rejected: Array, pair_mask: Array | None, global_pairs: Any
) -> Metrics:
    """The per-pair reward metrics of DPO and the reward model (gradient stopped), each a
    summable contribution ``sum_b p_b x_b / global_pairs`` (default: the pairs counted by
    ``pair_mask``, or ``B``): ``rewards/chosen``, ``rewards/rejected``, ``rewards/margins``
    and ``rewards/accuracies`` (share of pairs with chosen > rejected; ties are wrong)."""
    xp = namespace(chosen, rejected)
    chosen, rejected = stop_gradient(chosen), stop_gradient(rejected)
    p = xp.ones_like(chosen) if pair_mask is None else xp.astype(pair_mask, chosen.dtype)
    correct, pairs = pair_accuracy(chosen, rejected, p)
    n = _divisor(global_pairs) if global_pairs is not None else _nonzero_count(xp, pairs)
    return {
        "rewards/chosen": xp.sum(chosen * p) / n,
        "rewards/rejected": xp.sum(rejected * p) / n,
        "rewards/margins": xp.sum((chosen - rejected) * p) / n,
        "rewards/accuracies": correct / n,
    }


# --------------------------------------------------------------------------- reward model


def _check_pairs(fn: str, **arrays: Array) -> None:
    check_same_shape(fn, **arrays)
    first = next(iter(arrays.values()))
    if first.ndim != 1:
        raise ValueError(
            f"{fn}: inputs must be [B] (one scalar reward per response of a pair), got shape "
            f"{tuple(first.shape)}; take the reward head's value at each sequence's last token"
        )


def pair_accuracy(
    chosen_rewards: Array, rejected_rewards: Array, pair_mask: Array | None = None
) -> tuple[Array, Array]:
    """Pair accuracy of a reward model as ``(correct, pairs)``, both 0-d: [B] -> (), ().

    ``correct = sum_b p_b 1[r^c_b > r^r_b]`` and ``pairs = sum_b p_b`` with ``p =
    pair_mask`` (1 on real pairs, 0 on padding; default all 1). The held-out accuracy is
    ``sum(correct) / sum(pairs)`` over every evaluation batch (numerator and denominator,
    so batches of different sizes combine exactly). A tie counts as wrong, so a reward
    model that scores everything alike has accuracy 0 (TRL's ``compute_accuracy`` drops
    tied pairs from both counts instead: such a model's accuracy is then undefined, and a
    model is not charged for the pairs it cannot tell apart).
    """
    arrays = {"chosen_rewards": chosen_rewards, "rejected_rewards": rejected_rewards}
    _check_pairs("pair_accuracy", **arrays, pair_mask=pair_mask)
    xp = namespace(chosen_rewards, rejected_rewards)
    dtype = chosen_rewards.dtype
    p = xp.ones_like(chosen_rewards) if pair_mask is None else xp.astype(pair_mask, dtype)
    hit = xp.astype(stop_gradient(chosen_rewards) > stop_gradient(rejected_rewards), dtype)
    return xp.sum(hit * p), xp.sum(p)


def bradley_terry_loss(
    chosen_rewards: Array,
    rejected_rewards: Array,
    margin: float | Array = 0.0,
    center_coef: float = 0.0,
    pair_mask: Array | None = None,
    global_pairs: float | Array | None = None,
) -> tuple[Array, Metrics]:
    """Bradley-Terry reward-model loss (Bradley & Terry 1952; InstructGPT, Ouyang et al.
    2022, eq. 1), one pair per entry: [B] -> scalar.

    ``chosen_rewards`` / ``rejected_rewards`` [B] are the reward model's scalar scores of
    the preferred and the rejected response of pair ``b`` (the pair layout of
    :func:`dpo_loss`). With ``h_b = r^c_b - r^r_b`` and ``p = pair_mask``::

        l_b  = -log sigmoid(h_b - margin_b) + center_coef (r^c_b + r^r_b)^2
        loss = sum_b p_b l_b / global_pairs

    ``margin`` (a number or [B]; Llama 2, Touvron et al. 2023, sec. 3.2.2: larger for
    clearer preferences) asks for a gap of at least ``margin``; ``center_coef`` (TRL's
    ``center_rewards_coefficient``; Eisenstein et al. 2023, arXiv:2312.09244) pulls the
    rewards towards mean 0, since the loss sees only differences. ``pair_mask`` [B] is 1
    on real pairs and 0 on pairs a backend adds to fill a shape (those add nothing and
    are not counted). ``global_pairs`` is the number of real pairs in the whole optimizer
    step (default: this call's, ``sum(pair_mask)``), so the loss and metrics are
    summable contributions (module docstring). Metrics: ``rewards/chosen``,
    ``rewards/rejected``, ``rewards/margins`` (mean ``h``), ``rewards/accuracies``
    (:func:`pair_accuracy`'s share), the same names as :func:`dpo_loss`'s.
    """
    _check_pairs(
        "bradley_terry_loss",
        chosen_rewards=chosen_rewards,
        rejected_rewards=rejected_rewards,
        margin=None if isinstance(margin, numbers.Number | np.generic) else margin,
        pair_mask=pair_mask,
    )
    if not center_coef >= 0.0:
        raise ValueError(
            f"bradley_terry_loss: center_coef={center_coef!r} must be >= 0 (0 turns the "
            "centring term off)"
        )
    xp = namespace(chosen_rewards, rejected_rewards)
    dtype = chosen_rewards.dtype
    p = xp.ones_like(chosen_rewards) if pair_mask is None else xp.astype(pair_mask, dtype)
    losses = -log_sigmoid(chosen_rewards - rejected_rewards - margin)
    if center_coef:
        losses = losses + center_coef * (chosen_rewards + rejected_rewards) ** 2
    n = _divisor(global_pairs) if global_pairs is not None else _nonzero_count(xp, xp.sum(p))
    loss = masked_sum(losses, p) / n
    return loss, _pair_metrics(chosen_rewards, rejected_rewards, p, global_pairs)


def sft_loss(
    log_probs: Array, mask: Array, global_tokens: float | Array | None = None
) -> tuple[Array, Metrics]:
    """Supervised fine-tuning: token cross-entropy on the target tokens.

    ``log_probs`` [B, T] are the policy's log-probabilities of the data's tokens and
    ``mask`` [B, T] is 1 on the tokens to learn (the assistant turns of a chat; 0 on the
    user/system turns in between and on padding). ``loss = -sum(log_probs * mask) /
    global_tokens``: every target token of the optimizer step weighs the same, whichever
    micro-batch or rank holds it (``aggregate``'s "token-mean"). Metric: ``nll``, the
    loss with its gradient stopped (a summable contribution like the loss; ``exp`` of the
    step's summed value is the perplexity of the target tokens).
    """
    check_same_shape("sft_loss", log_probs=log_probs, mask=mask)
    loss = aggregate(-log_probs, mask, "token-mean", global_tokens)
    return loss, {"nll": stop_gradient(loss)}
