"""The Tinker API's loss functions (``TrainingClient.forward_backward(data, loss_fn)``,
served by ``polyrl.service``) as this package's losses.

Tinker's losses are sums over a request's tokens (no normalisation: a datum with twice
the tokens weighs twice), so each is one of :mod:`polyrl.algos.losses` with ``agg
"token-mean"`` over a normaliser of 1. Per-token inputs are the batch columns the service
builds from each datum's ``loss_fn_inputs`` ([B, T], zero past a datum's length):
``weights`` (cross_entropy), ``sampling_logprobs`` (Tinker's ``logprobs``: the sampler's
log-probs of the target tokens) and ``advantages``. With ``r = exp(log_probs -
sampling_logprobs)`` (clamped at +-20 nats as every policy loss here):

* ``cross_entropy``: ``-sum(log_probs * weights)`` (:func:`losses.sft_loss`).
* ``importance_sampling``: ``-sum(r * A)``: PPO's surrogate with no clip.
* ``ppo``: ``-sum(min(r A, clip(r, low, high) A))`` (:func:`losses.ppo_policy_loss`
  with ``clip_low = 1 - low``, ``clip_high = high - 1``, no dual clip).
* ``cispo``: ``-sum(sg[clip(r, low, high)] A log_probs)`` (:func:`losses.cispo_policy_loss`).

``low`` / ``high`` are ``loss_fn_config``'s ``clip_low_threshold`` / ``clip_high_threshold``
(defaults 0.8 and 1.2). Metrics are sums too (``clipfrac`` counts clipped tokens).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from polyrl.algos.losses import cispo_policy_loss, ppo_policy_loss, sft_loss

__all__ = ["TINKER_LOSSES", "TinkerLoss", "tinker_loss"]

# loss name -> (the datum's loss_fn_inputs it needs, the loss_fn_config keys it takes)
TINKER_LOSSES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "cross_entropy": (("weights",), ()),
    "importance_sampling": (("logprobs", "advantages"), ()),
    "ppo": (("logprobs", "advantages"), ("clip_low_threshold", "clip_high_threshold")),
    "cispo": (("logprobs", "advantages"), ("clip_low_threshold", "clip_high_threshold")),
}


@dataclasses.dataclass(frozen=True)
class TinkerLoss:
    """A loss with the backends' contract ``(outputs, batch, ctx) -> (loss, metrics)``:
    picklable, so it travels to the engine workers; also runs on numpy (a forward-only
    request's loss is computed on the host from the engine's log-probs)."""

    name: str
    clip_low_threshold: float = 0.8
    clip_high_threshold: float = 1.2

    def __call__(self, outputs: Mapping[str, Any], batch: Mapping[str, Any], ctx: Any = None):
        log_probs = outputs["log_probs"]
        if self.name == "cross_entropy":
            loss, _ = sft_loss(log_probs, batch["weights"], global_tokens=1.0)
            return loss, {}
        if self.name == "cispo":
            fn: Any = cispo_policy_loss
            clips: dict[str, Any] = {}
        else:
            fn, clips = ppo_policy_loss, {"dual_clip": None}
        if self.name == "importance_sampling":
            low, high = -math.inf, math.inf
        else:
            low, high = self.clip_low_threshold, self.clip_high_threshold
        loss, metrics = fn(
            log_probs,
            batch["sampling_logprobs"],
            batch["advantages"],
            batch["response_mask"],
            clip_low=1.0 - low,
            clip_high=high - 1.0,
            agg="token-mean",
            global_tokens=1.0,
            **clips,
        )
        return loss, metrics


def tinker_loss(name: str, config: Mapping[str, Any] | None = None) -> TinkerLoss:
    """The loss Tinker calls ``name`` with ``loss_fn_config`` ``config``; a ValueError
    naming the field for a loss or key it does not have."""
    if name not in TINKER_LOSSES:
        raise ValueError(
            f"loss_fn={name!r} is not served here; choose one of {sorted(TINKER_LOSSES)}"
        )
    allowed = TINKER_LOSSES[name][1]
    config = dict(config or {})
    unknown = sorted(set(config) - set(allowed))
    if unknown:
        raise ValueError(
            f"loss_fn_config has {unknown} which loss_fn={name!r} does not take "
            f"(it takes {list(allowed) or 'no keys'})"
        )
    values = {}
    for key, value in config.items():
        if isinstance(value, str) or not math.isfinite(float(value)) or float(value) <= 0:
            raise ValueError(f"loss_fn_config[{key!r}]={value!r} must be a number > 0")
        values[key] = float(value)
    loss = TinkerLoss(name, **values)
    if loss.clip_low_threshold > 1.0 or loss.clip_high_threshold < 1.0:
        raise ValueError(
            f"loss_fn_config clip thresholds ({loss.clip_low_threshold}, "
            f"{loss.clip_high_threshold}) must bracket 1 (e.g. 0.8 and 1.2)"
        )
    return loss
