"""The offline loops: preference optimisation (DPO and its relatives) on fixed pairs, and
supervised fine-tuning on chat data. No rollout servers."""

from __future__ import annotations

from polyrl.loop.base import COMPUTE_PHASES, Loop

__all__ = ["PreferenceTrainer", "SFTTrainer"]


class PreferenceTrainer(Loop):
    """Offline DPO (and IPO/hinge): ``prompts_per_step`` pairs a step, the reference's
    log-probs of both responses, then ``epochs`` passes of mini-batches of
    ``mini_batch_prompts`` pairs. No rollout servers."""

    def step(self, step: int) -> dict[str, float]:
        self.timer.start_step(step + 1)
        with self.timer.phase("data"):
            batch = self.prompts.batch(step, self.cfg.prompts_per_step).with_columns(step=step)
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
        lengths = batch["response_mask"].sum(-1)
        metrics |= {"response/length_mean": float(lengths.mean())}
        return metrics | self.timer.metrics(COMPUTE_PHASES)


class SFTTrainer(Loop):
    """Supervised fine-tuning on chat data: ``prompts_per_step`` conversations a step,
    ``epochs`` passes of mini-batches of ``mini_batch_prompts`` conversations, the loss on
    the assistant tokens (``polyrl.algos.spec.SFTActorLoss``). No rollout servers, no
    reference, no reward."""

    def step(self, step: int) -> dict[str, float]:
        self.timer.start_step(step + 1)
        with self.timer.phase("data"):
            batch = self.prompts.batch(step, self.cfg.prompts_per_step).with_columns(step=step)
        with self.timer.phase("update_actor"):
            metrics = self.update(
                self.actor, self.actor_loss, batch, "actor", False, self.cfg.mini_batch_prompts
            )
        metrics["sft/target_tokens"] = float(batch["response_mask"].sum())
        return metrics | self.timer.metrics(COMPUTE_PHASES)
