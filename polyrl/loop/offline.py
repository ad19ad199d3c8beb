"""The offline loops: preference optimisation (DPO and its relatives) on fixed pairs,
supervised fine-tuning on chat data, and reward-model training on pairs. No rollout
servers."""

from __future__ import annotations

from typing import Any

from polyrl.loop.base import COMPUTE_PHASES, Loop
from polyrl.loop.evaluation import PairEvaluator

__all__ = ["PreferenceTrainer", "SFTTrainer", "RewardModelTrainer"]


def _step_batch(loop: Loop, step: int) -> Any:
    """Step ``step``'s ``prompts_per_step`` rows (pairs or conversations), timed as "data"."""
    loop.timer.start_step(step + 1)
    with loop.timer.phase("data"):
        return loop.prompts.batch(step, loop.cfg.prompts_per_step).with_columns(step=step)


def _length_mean(batch: Any) -> dict[str, float]:
    return {"response/length_mean": float(batch["response_mask"].sum(-1).mean())}


class PreferenceTrainer(Loop):
    """Offline DPO (and IPO/hinge): ``prompts_per_step`` pairs a step, the reference's
    log-probs of both responses, then ``epochs`` passes of mini-batches of
    ``mini_batch_prompts`` pairs. No rollout servers."""

    def step(self, step: int) -> dict[str, float]:
        batch = _step_batch(self, step)
        with self.timer.phase("reference"):
            group, extra = self.ref_scorer
            batch = batch.with_columns(
                {"ref_log_probs": group.forward(batch, **extra)["log_probs"]}
            )
        with self.timer.phase("update_actor"):
            metrics = self.update(
                self.actor,
                self.actor_loss,
                batch,
                "actor",
                False,
                mini=2 * self.cfg.mini_batch_prompts,
                unit=2,
            )
        if step == self.start_step:
            self.check_reference(batch, {})
        return metrics | _length_mean(batch) | self.timer.metrics(COMPUTE_PHASES)


class SFTTrainer(Loop):
    """Supervised fine-tuning on chat data: ``prompts_per_step`` conversations a step,
    ``epochs`` passes of mini-batches of ``mini_batch_prompts`` conversations, the loss on
    the assistant tokens (``polyrl.algos.spec.SFTActorLoss``). No rollout servers, no
    reference, no reward."""

    def step(self, step: int) -> dict[str, float]:
        batch = _step_batch(self, step)
        with self.timer.phase("update_actor"):
            metrics = self.update(
                self.actor, self.actor_loss, batch, "actor", False, self.cfg.mini_batch_prompts
            )
        metrics["sft/target_tokens"] = float(batch["response_mask"].sum())
        return metrics | self.timer.metrics(COMPUTE_PHASES)


class RewardModelTrainer(Loop):
    """A Bradley-Terry reward model (objective "reward_model"): ``prompts_per_step`` pairs
    a step, ``epochs`` passes of mini-batches of ``mini_batch_prompts`` pairs, the critic
    role (the policy's backbone + a scalar head read at each sequence's last token)
    trained with ``polyrl.algos.spec.RewardModelLoss``. With held-out pairs
    (``RunConfig.eval_every``) their pair accuracy is logged (:class:`PairEvaluator`).
    The export (``export_final`` / ``export_every``, ``polyrl export``) is a sequence
    classifier: the reward_model role of an RL run loads it
    (``reward_model/polyrl.RoleConfig.model_path``). No rollout servers, no actor."""

    def __init__(self, cfg: Any, spec: Any, components: Any):
        super().__init__(cfg, spec, components)
        self.critic_loss = spec.make_critic_loss()
        if components.val_prompts is not None:
            self.evaluator = PairEvaluator(cfg.eval_every, components.val_prompts, self.critic)

    def step(self, step: int) -> dict[str, float]:
        batch = _step_batch(self, step)
        with self.timer.phase("update_critic"):
            metrics = self.update(
                self.critic,
                self.critic_loss,
                batch,
                "critic",
                False,
                mini=2 * self.cfg.mini_batch_prompts,
                unit=2,
            )
        return metrics | _length_mean(batch) | self.timer.metrics(COMPUTE_PHASES)
