"""KL control: the KL-in-reward penalty and the coefficient controllers.

Two ways to keep the policy near the reference (an ``AlgorithmSpec`` picks one, both or
neither):

* KL in the reward (Ziegler et al. 2019; InstructGPT): before advantages are computed,
  ``token_rewards = token_scores - beta * kl_t`` (:func:`apply_kl_penalty`), with
  ``beta`` from a controller below;
* KL as a loss term (GRPO): ``kl_coef * aggregate(kl_penalty(...))`` inside the actor
  loss (``polyrl.algos.spec``).

Controllers are pure ``(init, update)`` pairs (as optax's transformations): ``init() -> state`` and
``update(current_kl, n_steps, state) -> (coef, new_state)``, where ``state`` is a small
frozen dataclass of Python numbers that a trainer checkpoints (``dataclasses.asdict``)
and restores (``KLState(**d)``). They run on the host between steps.

Shapes: ``[B, T]`` = batch x response tokens.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

from polyrl.algos.losses import check_same_shape, kl_penalty
from polyrl.tensor import masked_mean, namespace, stop_gradient

__all__ = [
    "KLState",
    "KLController",
    "KL_CONTROLLERS",
    "fixed_kl_controller",
    "adaptive_kl_controller",
    "make_kl_controller",
    "apply_kl_penalty",
]

Array = Any


@dataclasses.dataclass(frozen=True)
class KLState:
    """State of a KL controller: the current coefficient ``beta`` and the number of
    samples seen so far."""

    coef: float
    steps: int = 0


@dataclasses.dataclass(frozen=True)
class KLController:
    """A pure controller: ``init() -> KLState``; ``update(current_kl, n_steps, state) ->
    (coef, new_state)`` returns the coefficient to use next."""

    init: Callable[[], KLState]
    update: Callable[[float, int, KLState], tuple[float, KLState]]


def fixed_kl_controller(
    kl_coef: float, target_kl: float | None = None, horizon: float | None = None
) -> KLController:
    """A constant coefficient ``beta = kl_coef`` (verl ``FixedKLController``).

    ``target_kl`` and ``horizon`` are accepted and ignored, so that every registered
    controller takes the same keywords.
    """

    def init() -> KLState:
        return KLState(coef=float(kl_coef))

    def update(current_kl: float, n_steps: int, state: KLState) -> tuple[float, KLState]:
        new = KLState(coef=state.coef, steps=state.steps + int(n_steps))
        return new.coef, new

    return KLController(init, update)


def adaptive_kl_controller(kl_coef: float, target_kl: float, horizon: float) -> KLController:
    """Adaptive coefficient (Ziegler et al. 2019, arXiv:1909.08593, sec. 2.2; verl
    ``AdaptiveKLController``)::

        e      = clip(current_kl / target_kl - 1, -0.2, 0.2)
        beta  <- beta * (1 + e * n_steps / horizon)

    ``current_kl`` is the measured KL of the last batch (e.g. from
    :func:`apply_kl_penalty`) and ``n_steps`` the number of samples in it.
    """
    if not horizon > 0:
        raise ValueError(f"adaptive_kl_controller: horizon must be > 0, got {horizon!r}")
    if not target_kl > 0:
        raise ValueError(f"adaptive_kl_controller: target_kl must be > 0, got {target_kl!r}")

    def init() -> KLState:
        return KLState(coef=float(kl_coef))

    def update(current_kl: float, n_steps: int, state: KLState) -> tuple[float, KLState]:
        error = float(np.clip(float(current_kl) / target_kl - 1.0, -0.2, 0.2))
        coef = state.coef * (1.0 + error * n_steps / horizon)
        new = KLState(coef=coef, steps=state.steps + int(n_steps))
        return coef, new

    return KLController(init, update)


# kind -> factory; the one source of valid ``AlgorithmSpec.kl_ctrl`` names.
KL_CONTROLLERS: dict[str, Callable[..., KLController]] = {
    "fixed": fixed_kl_controller,
    "adaptive": adaptive_kl_controller,
}


def make_kl_controller(kind: str, **kwargs: Any) -> KLController:
    """The controller registered as ``kind`` built with ``kwargs`` (``kl_coef``; and
    ``target_kl``, ``horizon`` for ``"adaptive"``)."""
    if kind not in KL_CONTROLLERS:
        raise ValueError(
            f"make_kl_controller: unknown kind {kind!r}; valid choices: {sorted(KL_CONTROLLERS)}"
        )
    return KL_CONTROLLERS[kind](**kwargs)


def apply_kl_penalty(
    token_scores: Array,
    log_probs: Array,
    ref_log_probs: Array,
    mask: Array,
    kl_coef: float,
    kind: str = "k1",
) -> tuple[Array, Array]:
    """KL in the reward (verl ``apply_kl_penalty``): all inputs [B, T].

    ``kl_t = kl_penalty(log_probs, ref_log_probs, kind) * mask`` (``log_probs``: the
    behaviour policy's, i.e. ``old_log_probs``) and ``token_rewards = token_scores -
    kl_coef * kl_t``. Returns ``(token_rewards [B, T], current_kl)`` where ``current_kl``
    is a 0-d array: the per-sequence token mean of ``kl_t``, averaged over the batch
    (what the adaptive controller's ``update`` takes).
    """
    check_same_shape(
        "apply_kl_penalty",
        token_scores=token_scores,
        log_probs=log_probs,
        ref_log_probs=ref_log_probs,
        mask=mask,
    )
    xp = namespace(token_scores, log_probs, ref_log_probs, mask)
    m = xp.astype(mask, token_scores.dtype)
    kl = kl_penalty(stop_gradient(log_probs), stop_gradient(ref_log_probs), kind) * m
    rewards = token_scores - kl_coef * kl
    current_kl = xp.mean(masked_mean(kl, m, axis=-1))
    return rewards, current_kl
