"""AlgorithmSpec: what an algorithm is, as data, and how it plugs into a backend.

An algorithm (PPO, GRPO, DPO, ...) is a frozen :class:`AlgorithmSpec`: which advantage
estimator and which policy loss it uses (names resolved in
``advantages.ADVANTAGE_ESTIMATORS`` and ``losses.POLICY_LOSSES``) and its default
hyper-parameters. The roles it needs (critic, reference, reward, greedy baseline) are
*derived* from those choices, so they cannot disagree with them. The specs themselves are
registered by name in ``polyrl.algos.registry`` (``get_algorithm(name)``).

A trainer uses a spec in three places:

* ``spec.compute_advantages(columns)`` on the controller -> ``(advantages, returns)``;
* ``spec.make_actor_loss(**overrides)`` / ``spec.make_critic_loss(**overrides)`` -> a
  loss function for the backends' ``train_step`` (contract below);
* ``spec.make_kl_controller()`` when ``kl_in_reward`` (``polyrl.algos.kl``).

Backend loss contract (``polyrl.backends.base``): ``loss_fn(outputs, batch, ctx) ->
(loss, metrics)``. ``outputs["log_probs"]`` [B, T] (and ``"entropy"``, ``"values"``
when present); ``batch`` holds the micro-batch's columns (``"old_log_probs"``,
``"advantages"``, ``"response_mask"``, ``"ref_log_probs"``, ``"returns"``, ``"values"``
= old values); ``ctx`` has ``global_tokens``, ``global_seqs`` (floats) and
``temperature``. ``loss`` is the micro-batch's contribution, already divided by the
global counts; every metric too (see ``polyrl.algos.losses``). The loss functions built
here are frozen dataclasses holding plain numbers and strings only: picklable, hashable,
safe to close over in ``jax.jit``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from polyrl.algos.advantages import ADVANTAGE_ESTIMATORS
from polyrl.algos.kl import KL_CONTROLLERS, KLController, make_kl_controller
from polyrl.algos.losses import (
    AGG_MODES,
    DPO_KINDS,
    IS_LEVELS,
    KL_KINDS,
    POLICY_LOSSES,
    aggregate,
    bradley_terry_loss,
    dpo_loss,
    kl_penalty,
    masked_is_weight,
    sft_loss,
    truncated_is_weight,
    value_loss,
)
from polyrl.tensor import masked_sum, namespace, stop_gradient

__all__ = [
    "AlgorithmSpec",
    "RLActorLoss",
    "DPOActorLoss",
    "SFTActorLoss",
    "CriticLoss",
    "RewardModelLoss",
    "OBJECTIVES",
]

Array = Any
Metrics = dict[str, Array]


# --------------------------------------------------------------------------- loss functions


@dataclasses.dataclass(frozen=True)
class RLActorLoss:
    """Actor loss of a policy-gradient algorithm (backend contract in the module doc)::

        loss = pg_loss + kl_coef * aggregate(kl_penalty(log_probs, ref_log_probs, kl_kind))
                       - entropy_coef * aggregate(entropy)

    ``pg_loss`` is ``POLICY_LOSSES[policy_loss]`` with ``loss_kwargs``; all terms use
    ``agg`` and the step's global counts. The KL term is present iff ``use_kl_loss``
    (needs ``batch["ref_log_probs"]``); the entropy term iff ``entropy_coef != 0`` (needs
    ``outputs["entropy"]``). Metrics: the policy loss's (``clipfrac``, ``approx_kl``,
    ``clipfrac_lower``), ``pg_loss``, ``kl_loss`` (when used) and ``entropy`` (token mean,
    whenever ``outputs`` has it).

    ``tis_cap`` (None = off): truncated importance sampling of the rollout/trainer
    mismatch (``losses.truncated_is_weight``): every token's policy loss is weighted by
    ``min(exp(old_log_probs - rollout_log_probs), tis_cap)`` (needs
    ``batch["rollout_log_probs"]``, the rollout's sampled log-probs); ``tis_level``
    ("token" | "sequence" | "geometric") forms the ratio per token or per sequence; adds
    the ``tis_*`` metrics of ``losses.truncated_is_weight``.

    ``is_mask_low`` / ``is_mask_high`` (both None = off): masked importance sampling
    (``losses.masked_is_weight``, IcePop): tokens (``is_mask_level="token"``) or whole
    sequences (``"sequence"``, ``"geometric"``) whose ratio leaves the band are removed
    from the policy loss; adds the ``is_mask_*`` metrics. Both corrections multiply.
    """

    policy_loss: str
    loss_kwargs: tuple[tuple[str, Any], ...]
    agg: str
    use_kl_loss: bool
    kl_kind: str
    kl_coef: float
    entropy_coef: float
    tis_cap: float | None = None
    tis_level: str = "token"
    is_mask_low: float | None = None
    is_mask_high: float | None = None
    is_mask_level: str = "token"

    def _correction(self, batch: Mapping[str, Array], ctx: Any) -> tuple[Array | None, Metrics]:
        """The off-policy correction's per-token weights (None: none) and metrics."""
        masking = self.is_mask_low is not None or self.is_mask_high is not None
        if self.tis_cap is None and not masking:
            return None, {}
        if "rollout_log_probs" not in batch:
            knob = f"tis_cap={self.tis_cap}" if self.tis_cap is not None else "is_mask_low/high"
            raise ValueError(
                f"AlgorithmSpec.{knob} needs the rollout's sampled log-probs (batch column "
                "'rollout_log_probs', filled by RolloutPool.generate); turn the off-policy "
                "correction off (tis_cap=None, is_mask_low=is_mask_high=None) for batches "
                "without them"
            )
        args = (batch["old_log_probs"], batch["rollout_log_probs"], batch["response_mask"])
        weights, metrics = None, {}
        if self.tis_cap is not None:
            weights, metrics = truncated_is_weight(
                *args, self.tis_cap, ctx.global_tokens, self.tis_level, ctx.global_seqs
            )
        if masking:
            keep, mask_metrics = masked_is_weight(
                *args,
                self.is_mask_low,
                self.is_mask_high,
                ctx.global_tokens,
                self.is_mask_level,
                ctx.global_seqs,
            )
            weights, metrics = (keep if weights is None else weights * keep), metrics | mask_metrics
        return weights, metrics

    def __call__(self, outputs: Mapping[str, Array], batch: Mapping[str, Array], ctx: Any):
        log_probs, mask = outputs["log_probs"], batch["response_mask"]
        norms = {"global_tokens": ctx.global_tokens, "global_seqs": ctx.global_seqs}
        weights, tis_metrics = self._correction(batch, ctx)
        pg_loss, pg_metrics = POLICY_LOSSES[self.policy_loss].fn(
            log_probs,
            batch["old_log_probs"],
            batch["advantages"],
            mask,
            agg=self.agg,
            weights=weights,
            **dict(self.loss_kwargs),
            **norms,
        )
        loss = pg_loss
        metrics = {**pg_metrics, **tis_metrics, "pg_loss": stop_gradient(pg_loss)}
        if self.use_kl_loss:
            kl = kl_penalty(log_probs, batch["ref_log_probs"], self.kl_kind)
            kl_loss = aggregate(kl, mask, self.agg, **norms)
            loss = loss + self.kl_coef * kl_loss
            metrics["kl_loss"] = stop_gradient(kl_loss)
        if self.entropy_coef != 0.0 and "entropy" not in outputs:
            raise ValueError(
                f"entropy_coef={self.entropy_coef} needs outputs['entropy']; run the "
                "backend's train_step with entropy=True (or set entropy_coef=0)"
            )
        if "entropy" in outputs:
            entropy = outputs["entropy"]
            if self.entropy_coef != 0.0:
                loss = loss - self.entropy_coef * aggregate(entropy, mask, self.agg, **norms)
            metrics["entropy"] = stop_gradient(
                aggregate(entropy, mask, "token-mean", ctx.global_tokens)
            )
        return loss, metrics


@dataclasses.dataclass(frozen=True)
class DPOActorLoss:
    """DPO on a micro-batch of *interleaved* pairs (backend contract in the module doc).

    Row ``2i`` is the chosen and row ``2i + 1`` the rejected response of pair ``i`` (so a
    split into micro-batches of even size keeps pairs whole). Sequence log-probs are the
    masked sums of ``outputs["log_probs"]`` and ``batch["ref_log_probs"]`` [B, T]. The
    number of pairs in the step is ``ctx.global_seqs / 2``; ``loss = sum(dpo_loss) /
    pairs`` over pairs with response tokens (padding pairs add nothing) and the metrics of
    ``losses.dpo_loss`` with the same normaliser.
    """

    beta: float
    kind: str
    label_smoothing: float

    def __call__(self, outputs: Mapping[str, Array], batch: Mapping[str, Array], ctx: Any):
        mask = batch["response_mask"]
        if mask.shape[0] % 2:
            raise ValueError(
                f"DPO needs interleaved (chosen, rejected) rows; got a micro-batch "
                f"of {mask.shape[0]} rows (odd): use an even micro_batch_size"
            )
        policy = masked_sum(outputs["log_probs"], mask, axis=-1)
        ref = masked_sum(batch["ref_log_probs"], mask, axis=-1)
        pairs = ctx.global_seqs / 2
        losses, metrics = dpo_loss(
            policy[0::2],
            policy[1::2],
            ref[0::2],
            ref[1::2],
            beta=self.beta,
            kind=self.kind,
            label_smoothing=self.label_smoothing,
            global_pairs=pairs,
        )
        xp = namespace(losses)
        # Rows a backend adds to fill a shape bucket have no response tokens: such a pair
        # has margin 0, which would still cost log 2 (sigmoid), so it is masked out. (Its
        # metrics contribute 0 already, and global_seqs does not count it.)
        real = xp.astype(xp.sum(mask, axis=-1)[0::2] > 0, losses.dtype)
        return xp.sum(losses * real) / pairs, metrics


@dataclasses.dataclass(frozen=True)
class SFTActorLoss:
    """Supervised fine-tuning on a micro-batch of data rows (backend contract in the
    module doc): ``losses.sft_loss(outputs["log_probs"], batch["response_mask"],
    ctx.global_tokens)``. The response mask is 1 on the tokens to learn only (each
    assistant turn of a chat, ``polyrl.data.chat``), so the loss is the token-mean
    cross-entropy over every assistant token of the optimizer step."""

    def __call__(self, outputs: Mapping[str, Array], batch: Mapping[str, Array], ctx: Any):
        return sft_loss(outputs["log_probs"], batch["response_mask"], ctx.global_tokens)


@dataclasses.dataclass(frozen=True)
class CriticLoss:
    """Critic loss: ``losses.value_loss(outputs["values"], batch["values"],
    batch["returns"], batch["response_mask"], clip, agg, global counts)``."""

    clip: float | None
    agg: str

    def __call__(self, outputs: Mapping[str, Array], batch: Mapping[str, Array], ctx: Any):
        return value_loss(
            outputs["values"],
            batch["values"],
            batch["returns"],
            batch["response_mask"],
            clip=self.clip,
            agg=self.agg,
            global_tokens=ctx.global_tokens,
            global_seqs=ctx.global_seqs,
        )


@dataclasses.dataclass(frozen=True)
class RewardModelLoss:
    """Bradley-Terry reward-model training on a micro-batch of *interleaved* pairs (DPO's
    layout: row ``2i`` chosen, ``2i + 1`` rejected): ``losses.bradley_terry_loss`` of
    ``outputs["scores"]`` [B] (the value head at each sequence's last real token), with
    ``margin`` and ``center_coef``, over ``ctx.global_seqs / 2`` pairs. Pairs a backend
    adds to fill a shape (no response tokens) add nothing. Metrics: DPO's names
    (``rewards/chosen``, ``rewards/rejected``, ``rewards/margins``, ``rewards/accuracies``).
    """

    margin: float
    center_coef: float

    def __call__(self, outputs: Mapping[str, Array], batch: Mapping[str, Array], ctx: Any):
        mask, scores = batch["response_mask"], outputs["scores"]
        if mask.shape[0] % 2:
            raise ValueError(
                f"a reward model trains on interleaved (chosen, rejected) rows; got a "
                f"micro-batch of {mask.shape[0]} rows (odd): use an even micro_batch_size"
            )
        xp = namespace(scores)
        real = xp.astype(xp.sum(mask, axis=-1)[0::2] > 0, scores.dtype)
        return bradley_terry_loss(
            scores[0::2],
            scores[1::2],
            margin=self.margin,
            center_coef=self.center_coef,
            pair_mask=real,
            global_pairs=ctx.global_seqs / 2,
        )


def _rl_actor_loss(spec: AlgorithmSpec) -> RLActorLoss:
    entry = POLICY_LOSSES[spec.policy_loss]
    return RLActorLoss(
        policy_loss=spec.policy_loss,
        loss_kwargs=tuple((name, getattr(spec, name)) for name in entry.hparams),
        agg=spec.agg,
        use_kl_loss=spec.use_kl_loss,
        kl_kind=spec.kl_loss_kind,
        kl_coef=spec.kl_loss_coef,
        entropy_coef=spec.entropy_coef,
        tis_cap=spec.tis_cap,
        tis_level=spec.tis_level,
        is_mask_low=spec.is_mask_low,
        is_mask_high=spec.is_mask_high,
        is_mask_level=spec.is_mask_level,
    )


def _dpo_actor_loss(spec: AlgorithmSpec) -> DPOActorLoss:
    return DPOActorLoss(beta=spec.beta, kind=spec.dpo_kind, label_smoothing=spec.label_smoothing)


def _sft_actor_loss(spec: AlgorithmSpec) -> SFTActorLoss:
    return SFTActorLoss()


# objective -> actor-loss builder: "rl" trains on scored rollouts, "preference" on pairs,
# "sft" on the assistant tokens of chat data; "reward_model" trains no actor, only the
# critic role's value head on pairs (RewardModelLoss, make_critic_loss).
OBJECTIVES = {
    "rl": _rl_actor_loss,
    "preference": _dpo_actor_loss,
    "sft": _sft_actor_loss,
    "reward_model": None,
}


# --------------------------------------------------------------------------- the spec


def _check_choice(field: str, value: Any, valid: Any) -> None:
    if value not in valid:
        raise ValueError(
            f"AlgorithmSpec.{field}: unknown value {value!r}; valid choices: {sorted(valid)}"
        )


@dataclasses.dataclass(frozen=True)
class AlgorithmSpec:
    """One algorithm, as data. Field groups (defaults are per algorithm, see the registry):

    identity: ``name``, ``paper``; ``objective`` ("rl" | "preference" | "sft" |
    "reward_model"); ``advantage`` (``ADVANTAGE_ESTIMATORS`` name, None for the others);
    ``policy_loss`` (``POLICY_LOSSES`` name; unused but for rl).

    policy loss: ``clip_low``, ``clip_high`` (``clip_high > clip_low`` = clip-higher),
    ``dual_clip`` (None = off; only the "ppo" loss), ``agg`` (``AGG_MODES``),
    ``entropy_coef``. Off-policy corrections of the rollout/trainer mismatch (``RLActorLoss``):
    ``tis_cap`` / ``tis_level`` (truncated IS), ``is_mask_low`` / ``is_mask_high`` /
    ``is_mask_level`` (masked IS); ``IS_LEVELS`` names the levels.

    KL as a loss term: ``use_kl_loss``, ``kl_loss_kind`` (``KL_KINDS``), ``kl_loss_coef``.
    KL in the reward: ``kl_in_reward``, ``kl_reward_kind``, ``kl_ctrl`` ("fixed" |
    "adaptive"), ``kl_coef`` (initial beta), ``kl_target``, ``kl_horizon``.

    advantages: ``gamma``, ``lam`` (GAE / REINFORCE++), ``scale_by_std`` (GRPO; False =
    Dr. GRPO). critic: ``value_clip``, ``critic_agg``. DAPO: ``dynamic_sampling``,
    ``overlong_buffer_len`` (None = off), ``overlong_penalty_factor``. DPO: ``beta``,
    ``dpo_kind`` (``DPO_KINDS``), ``label_smoothing``. Reward model (Bradley-Terry):
    ``rm_margin``, ``rm_center_coef`` (``losses.bradley_terry_loss``'s margin, center_coef).
    ``dpo_kind`` (``DPO_KINDS``), ``label_smoothing``. On-policy distillation
    (``advantages.on_policy_distillation``): ``distill_coef`` (the reverse KL's weight),
    ``distill_discount`` (0: each token's own KL), ``task_reward_coef`` (the GRPO task
    advantage's weight; 0 = off), ``distill_baseline`` (subtract the batch's mean KL).
    """

    name: str
    paper: str = ""
    objective: str = "rl"
    advantage: str | None = "grpo"
    policy_loss: str = "ppo"
    # policy loss
    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: float | None = 3.0
    agg: str = "token-mean"
    entropy_coef: float = 0.0
    tis_cap: float | None = None
    tis_level: str = "token"
    is_mask_low: float | None = None
    is_mask_high: float | None = None
    is_mask_level: str = "token"
    # KL as a loss term
    use_kl_loss: bool = False
    kl_loss_kind: str = "k3"
    kl_loss_coef: float = 0.001
    # KL in the reward
    kl_in_reward: bool = False
    kl_reward_kind: str = "k1"
    kl_ctrl: str = "fixed"
    kl_coef: float = 0.001
    kl_target: float = 0.1
    kl_horizon: float = 10000.0
    # advantages
    gamma: float = 1.0
    lam: float = 1.0
    scale_by_std: bool = True
    # critic
    value_clip: float | None = 0.5
    critic_agg: str = "token-mean"
    # DAPO
    dynamic_sampling: bool = False
    overlong_buffer_len: int | None = None
    overlong_penalty_factor: float = 1.0
    # DPO
    beta: float = 0.1
    dpo_kind: str = "sigmoid"
    label_smoothing: float = 0.0
    # reward model
    rm_margin: float = 0.0
    rm_center_coef: float = 0.0
    # on-policy distillation
    distill_coef: float = 1.0
    distill_discount: float = 0.0
    task_reward_coef: float = 0.0
    distill_baseline: bool = False

    def __post_init__(self) -> None:
        _check_choice("objective", self.objective, OBJECTIVES)
        if self.objective == "rl":
            _check_choice("advantage", self.advantage, ADVANTAGE_ESTIMATORS)
            _check_choice("policy_loss", self.policy_loss, POLICY_LOSSES)
        _check_choice("agg", self.agg, AGG_MODES)
        _check_choice("critic_agg", self.critic_agg, AGG_MODES)
        _check_choice("kl_loss_kind", self.kl_loss_kind, KL_KINDS)
        _check_choice("kl_reward_kind", self.kl_reward_kind, KL_KINDS)
        _check_choice("kl_ctrl", self.kl_ctrl, KL_CONTROLLERS)
        _check_choice("dpo_kind", self.dpo_kind, DPO_KINDS)
        _check_choice("tis_level", self.tis_level, IS_LEVELS)
        _check_choice("is_mask_level", self.is_mask_level, IS_LEVELS)
        if (self.is_mask_low is not None and not 0 <= self.is_mask_low < 1) or (
            self.is_mask_high is not None and not self.is_mask_high > 1
        ):
            raise ValueError(
                f"AlgorithmSpec.is_mask_low / is_mask_high: the band must hold ratio 1 "
                f"(0 <= is_mask_low < 1 < is_mask_high, None = unbounded), got "
                f"{self.is_mask_low!r} / {self.is_mask_high!r}; e.g. 0.5 / 2.0 (IcePop)"
            )
        if self.clip_low < 0 or self.clip_high < 0:
            raise ValueError(
                f"AlgorithmSpec.clip_low / clip_high must be >= 0, got "
                f"{self.clip_low!r} / {self.clip_high!r}"
            )
        if self.dual_clip is not None and not self.dual_clip > 1.0:
            raise ValueError(
                f"AlgorithmSpec.dual_clip must be > 1.0 or None, got {self.dual_clip!r}"
            )
        if self.tis_cap is not None and not self.tis_cap > 0:
            raise ValueError(
                f"AlgorithmSpec.tis_cap must be > 0 (e.g. 2.0) or None (off), got {self.tis_cap!r}"
            )
        if not (self.distill_coef >= 0 and 0 <= self.distill_discount <= 1):
            raise ValueError(
                f"AlgorithmSpec.distill_coef={self.distill_coef!r} must be >= 0 and "
                f"distill_discount={self.distill_discount!r} in [0, 1] (0: each token's own KL)"
            )
        if not self.task_reward_coef >= 0:
            raise ValueError(
                f"AlgorithmSpec.task_reward_coef={self.task_reward_coef!r} must be >= 0 "
                "(0: no task reward in the distillation advantage)"
            )
        if self.overlong_buffer_len is not None and not self.overlong_buffer_len > 0:
            raise ValueError(
                f"AlgorithmSpec.overlong_buffer_len must be > 0 or None, got "
                f"{self.overlong_buffer_len!r}"
            )

    # ---- roles, derived from the choices above

    @property
    def _columns(self) -> tuple[str, ...]:
        return ADVANTAGE_ESTIMATORS[self.advantage].columns if self.objective == "rl" else ()

    @property
    def needs_actor(self) -> bool:
        """A policy is trained (every objective but "reward_model")."""
        return self.objective != "reward_model"

    @property
    def needs_critic(self) -> bool:
        """A value model is trained: the advantage estimator reads ``values``, or the
        critic role *is* the reward model being trained ("reward_model")."""
        return "values" in self._columns or self.objective == "reward_model"

    @property
    def evaluates(self) -> bool:
        """Held-out data is scored during training (``RunConfig.eval_every``): rl generates
        and rewards responses, reward_model scores held-out pairs."""
        return self.objective in ("rl", "reward_model")

    @property
    def data_kind(self) -> str:
        """The kind of row the algorithm trains on (``polyrl.data.schema.KINDS``): a
        reward model reads DPO's preference pairs."""
        return "preference" if self.objective == "reward_model" else self.objective

    @property
    def needs_reference(self) -> bool:
        """A frozen reference model computes ``ref_log_probs`` (KL loss, KL reward, DPO)."""
        return self.use_kl_loss or self.kl_in_reward or self.objective == "preference"

    @property
    def needs_reward(self) -> bool:
        """Rollouts are scored by the reward workers (every "rl" objective)."""
        return self.objective == "rl"

    @property
    def needs_teacher(self) -> bool:
        """A frozen teacher computes ``teacher_log_probs`` (on-policy distillation)."""
        return "teacher_log_probs" in self._columns

    @property
    def needs_groups(self) -> bool:
        """Several samples per prompt, grouped by ``group_ids`` (GRPO-like baselines; the
        distillation's task-reward mix)."""
        mixed = self.needs_teacher and self.task_reward_coef > 0
        return "group_ids" in self._columns or self.dynamic_sampling or mixed

    @property
    def needs_greedy_baseline(self) -> bool:
        """A greedy decode of each prompt is scored as the baseline (ReMax)."""
        return "baseline_scores" in self._columns

    @property
    def needs_entropy(self) -> bool:
        """The actor's ``train_step`` must return per-token entropy."""
        return self.entropy_coef != 0.0

    # ---- building blocks for a trainer

    def replace(self, **overrides: Any) -> AlgorithmSpec:
        """A copy with ``overrides`` (field names) applied and validated."""
        valid = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(overrides) - valid)
        if unknown:
            raise ValueError(
                f"AlgorithmSpec {self.name!r}: unknown hyper-parameter(s) {unknown}; "
                f"valid: {sorted(valid)}"
            )
        return dataclasses.replace(self, **overrides)

    def compute_advantages(
        self, columns: Mapping[str, Array], with_metrics: bool = False, **overrides: Any
    ):
        """``(advantages, returns)`` [B, T] from the named ``columns`` (see
        ``advantages.ADVANTAGE_ESTIMATORS`` for the names each estimator reads); with
        ``with_metrics``, ``(advantages, returns, metrics)`` (the estimator's, e.g.
        ``distill/reverse_kl``; ``{}`` for most)."""
        spec = self.replace(**overrides)
        if spec.objective != "rl":
            raise ValueError(f"algorithm {spec.name!r} ({spec.objective}) has no advantages")
        estimator = ADVANTAGE_ESTIMATORS[spec.advantage]
        hparams = {h: getattr(spec, h) for h in estimator.hparams}
        return estimator(dict(columns), with_metrics, **hparams)

    def make_actor_loss(self, **overrides: Any) -> RLActorLoss | DPOActorLoss | SFTActorLoss:
        """The actor's ``loss_fn(outputs, batch, ctx)`` with this spec's hyper-parameters
        (``overrides`` replace spec fields)."""
        spec = self.replace(**overrides)
        if not spec.needs_actor:
            raise ValueError(f"algorithm {spec.name!r} ({spec.objective}) trains no actor")
        return OBJECTIVES[spec.objective](spec)

    def make_critic_loss(self, **overrides: Any) -> CriticLoss | RewardModelLoss:
        """The critic's ``loss_fn(outputs, batch, ctx)`` (a reward model's: Bradley-Terry);
        ValueError if there is no critic."""
        spec = self.replace(**overrides)
        if spec.objective == "reward_model":
            return RewardModelLoss(margin=spec.rm_margin, center_coef=spec.rm_center_coef)
        if not spec.needs_critic:
            raise ValueError(
                f"algorithm {spec.name!r} has no critic (advantage "
                f"{spec.advantage!r} reads no values)"
            )
        return CriticLoss(clip=spec.value_clip, agg=spec.critic_agg)

    def make_kl_controller(self, **overrides: Any) -> KLController:
        """The in-reward KL coefficient controller (``kl_ctrl``, ``kl_coef``, ...)."""
        spec = self.replace(**overrides)
        return make_kl_controller(
            spec.kl_ctrl, kl_coef=spec.kl_coef, target_kl=spec.kl_target, horizon=spec.kl_horizon
        )
