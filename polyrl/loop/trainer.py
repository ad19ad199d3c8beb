"""The single-controller RL loop (docs/design.md "Data flow of one GRPO/PPO step").

One step, as in the algorithm box::

    prompts -> generate (rollout pool) -> reward -> reference (and teacher) log-probs
    -> old log-probs -> values (critic) -> advantages (algos, on the controller)
    -> actor updates over mini-batches x epochs (and critic) -> weight sync

Each arrow is a named stage of tens of lines, timed and logged as ``[phase] step N: X s``.
Roles live in their own Ray workers (``polyrl.cluster.workers``): the reference is a separate
frozen engine, never the actor's object (with LoRA: the actor's frozen base, scored with
its adapters off). The run directory holds the operative config,
``metrics.jsonl``, TensorBoard events, checkpoints and ``summary.png``.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from polyrl.batch import Batch
from polyrl.cluster.groups import gather
from polyrl.cluster.residency import turn_roles
from polyrl.config import RunConfig
from polyrl.loop.async_rollout import Rollouts, mismatch_metrics, staleness_bound
from polyrl.loop.base import COMPUTE_PHASES, Loop, Turns
from polyrl.loop.offline import PreferenceTrainer, RewardModelTrainer, SFTTrainer
from polyrl.observe import shadow
from polyrl.observe.health import explained_variance, response_stats
from polyrl.rewards.workers import RewardError, RewardPool
from polyrl.role_table import Role
from polyrl.rollout.engine_start import describe

__all__ = [
    "COMPUTE_PHASES",
    "Loop",
    "RLTrainer",
    "PreferenceTrainer",
    "SFTTrainer",
    "RewardModelTrainer",
    "LOOPS",
]


class RLTrainer(Loop):
    """Runs ``cfg.total_steps`` steps of an ``objective == "rl"`` algorithm."""

    def __init__(self, cfg: RunConfig, spec: Any, components: Any):
        self.critic_loss = spec.make_critic_loss() if spec.needs_critic else None
        super().__init__(cfg, spec, components)
        self.kl_ctrl = spec.make_kl_controller() if spec.kl_in_reward else None
        self.kl_state = self.kl_ctrl.init() if self.kl_ctrl else None
        with self.startup.phase("rollout servers"):  # started with the roles above
            self.pool.ready()
        if (times := self.pool.start_times) is not None:
            self.startup.detail("rollout servers", describe(times))
        self.warmed_up()
        self.rewards = RewardPool(
            cfg.reward_workers, cfg.reward_timeout_s, self.placement.light_options
        )
        self.judge = None  # RunConfig.judge: an LLM judge on the rollout pool or its own
        self.judge_pool = components.judge_pool  # JudgeConfig.model_path: its own servers
        if cfg.judge is not None:
            from polyrl.loop.judge import Judge

            pool, tokenizer = self.pool, self.tokenizer
            if self.judge_pool is not None:
                from transformers import AutoTokenizer

                with self.startup.phase("judge servers"):  # started with the roles above
                    self.judge_pool.ready()
                pool = self.judge_pool
                tokenizer = AutoTokenizer.from_pretrained(cfg.judge.model_path)
            self.judge = Judge(cfg.judge, pool, tokenizer)
        self.episodes = None  # RunConfig.episodes: multi-turn episodes in env workers
        if cfg.episodes is not None:
            from polyrl.envs.workers import EnvPool
            from polyrl.rollout.episodes import EpisodeRunner

            envs = EnvPool(
                cfg.episodes.env_workers, cfg.episodes.env_timeout_s, self.placement.light_options
            )
            self.episodes = EpisodeRunner(self.pool, envs, self.tokenizer, cfg.episodes)
        self.syncer = self.pool.weight_syncer(cfg.weight_transport)
        # With LoRA the base is frozen: after one full push, only what training changes.
        self.pushed_full = False
        # GPU transports retain nothing: a restarted server is re-synced from the actor.
        self.pool.resync_source = self._host_weights
        self.syncer.ensure_group(self.actor.form_weight_group)  # "nccl": the broadcast group
        roles, sleeps = turn_roles(cfg, self.roles, self.placement.shares, self._gpu_memory)
        self.turns = Turns(roles, self.pool, sleeps, self.timer)
        if getattr(components, "session", None) is not None:
            # a warm session's servers hold the weights its last run left: this run's own
            # initial weights, as a fresh run's servers load them (polyrl.cluster.session)
            with self.startup.phase("attach"), self.turns.resident(self.actor):
                self.sync_weights(version=0)
            self.pushed_full = False  # as a fresh run's: its first push is whole (with LoRA)
        if components.val_prompts is not None:
            from polyrl.loop.evaluation import Evaluator

            generate = self.episodes.generate if self.episodes else self.pool.generate
            self.evaluator = Evaluator(
                cfg, components.val_prompts, self.tokenizer, generate, self.reward
            )
        # RunConfig.max_staleness: batches k+1..k+N are generated while the actor trains on k.
        on_span = self.timeline.add if self.timeline is not None else None
        self.rollouts = (
            self._stream(on_span)
            if cfg.streaming
            else Rollouts(
                self.collect,
                cfg.total_steps,
                staleness_bound(cfg),
                cfg.stale_policy,
                on_span,
                self.timer.phase,
            )
        )

    def _stream(self, on_span: Any) -> Any:
        """RunConfig.streaming: groups generated continuously (``polyrl.loop.streaming``)."""
        from polyrl.algos.dapo import dynamic_sampling_mask
        from polyrl.loop.streaming import Stream

        def accept(batch: Batch) -> tuple[Batch, np.ndarray]:
            batch = self.reward(batch)
            return batch, np.asarray(dynamic_sampling_mask(batch["scores"], batch["group_ids"]))

        cfg = self.cfg
        return Stream(
            self.pool,
            lambda index: self.prompts.batch(index, cfg.prompts_per_step),
            self.sampling_for,
            cfg.prompts_per_step,
            cfg.total_steps,
            staleness_bound(cfg),
            cfg.stale_policy,
            cfg.partial_rollout_tokens,
            cfg.sampling.max_tokens,
            accept if self.spec.dynamic_sampling else None,
            cfg.max_gen_batches,
            lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True),
            on_span,
            self.timer.phase,
            self.episodes,
        )

    def _gpu_memory(self, role: str) -> list[dict[str, Any] | None]:
        return self.groups[role].gpu_memory()

    def extra_state(self) -> dict[str, Any]:
        return {"kl_state": dataclasses.asdict(self.kl_state) if self.kl_state else None}

    def save_extra_files(self, path: Path) -> None:
        self.rollouts.save(path)

    def restore_extra(self, state: dict[str, Any], path: Path) -> None:
        self.rollouts.load(path, self.start_step)
        if state.get("kl_state"):
            from polyrl.algos.kl import KLState

            self.kl_state = KLState(**state["kl_state"])
        with self.turns.resident(self.actor):  # the servers still hold the initial weights
            self.sync_weights(version=self.start_step)

    def shutdown(self) -> None:
        self.rollouts.discard()
        self.rewards.shutdown()
        if self.episodes is not None:
            self.episodes.shutdown()
        self.pool.shutdown()
        if self.judge_pool is not None:
            self.judge_pool.shutdown()
        super().shutdown()

    def step(self, step: int) -> dict[str, float]:
        self.timer.start_step(step + 1)
        turns, phase = self.turns, self.timer.phase
        if self.judge is not None:
            self.judge.take_metrics()  # (drops validation's judgements)
        batch, staleness = self.rollouts.take(step)  # (timed as "generate"; DAPO's scoring)
        with phase("reward"):
            batch = self.reward(batch)
        dapo = self.spec.dynamic_sampling and not self.cfg.streaming  # (streaming: in take)
        if dapo:
            with phase("dynamic_sampling"):
                batch, kept = self.filter_groups(batch, step)
        turns.rollout_sleep()
        with contextlib.ExitStack() as actor_turn:  # the actor, once reloaded, stays to sync
            batch = self.score(batch, actor_turn)
            with phase("advantages"):
                batch, metrics = self.advantages(batch)
            metrics |= mismatch_metrics(batch)
            if dapo:
                metrics["dynamic_sampling/kept_fraction"] = kept
            if self.judge is not None:
                metrics |= self.judge.take_metrics()
            # Steps 1, 1 + k * shadow_every: each right after a checkpoint when save_every
            # is a multiple of shadow_every (polyrl diagnose replays it from there).
            if self.shadow is not None and step % self.cfg.shadow_every == 0:
                with phase("shadow"):
                    metrics |= self.shadow_check(step, batch)
            with phase("update_actor"):
                loss_fn, entropy = self.losses()[Role.ACTOR]
                metrics |= self.update(self.actor, loss_fn, batch, "actor", entropy, self.mini_rows)
            if self.ref_scorer is not None and step == self.start_step:
                self.check_reference(batch, {"temperature": self.temperature})
            if self.critic is not None:
                with turns.resident(self.critic), phase("update_critic"):
                    loss_fn, entropy = self.losses()[Role.CRITIC]
                    metrics |= self.update(
                        self.critic, loss_fn, batch, "critic", entropy, self.mini_rows
                    )
            turns.rollout_wake()
            done = step + 1  # validation samples with the servers' weights: push them first
            due = done == self.cfg.total_steps or (self.evaluator and self.evaluator.due(done))
            # N >= 2: a busy generator gets a host copy to push between its batches
            snapshot = (lambda: self.weights_snapshot(done)) if self.rollouts.limit > 1 else None
            metrics |= staleness | self.rollouts.sync(
                lambda: self.sync_weights(version=done), done, bool(due), snapshot
            )
        metrics |= self.timer.metrics(COMPUTE_PHASES)
        return metrics | self.inspect(step, batch, metrics)

    def score(self, batch: Batch, actor_turn: contextlib.ExitStack) -> Batch:
        """Reference log-probs, the teacher's (on-policy distillation: its log-prob of each
        token the student sampled), old log-probs (with entropy) and values. Forwards of roles
        that stay resident (``polyrl.cluster.residency``) run at once, each timed from their common
        start to its own result; roles taking turns run one after another, reloaded around
        their forward (the actor stays on ``actor_turn`` for the update)."""
        calls = {name: (getattr(self, role), args) for name, (role, args) in self.scoring().items()}
        t0, pending = time.perf_counter(), {}
        for name, (group, args) in calls.items():
            if not self.turns.takes_turns(group):
                self.timer.begin(name)  # recorded from t0 when it returns
                pending[name] = group.submit_forward(batch, **args)
        outs, actor_resident = {}, False
        with concurrent.futures.ThreadPoolExecutor(1) as waiter:
            # Their finish times are read as they come, while the turns below run.
            done = waiter.submit(
                lambda: [(name, out, time.perf_counter()) for name, out in gather(pending)]
            )
            for name, (group, args) in calls.items():
                if name not in pending:
                    turn = self.turns.resident(group)
                    if group is self.actor:  # reloaded here, offloaded after the sync
                        if not actor_resident:  # once (with LoRA it scores the reference too)
                            actor_turn.enter_context(turn)
                            actor_resident = True
                        turn = contextlib.nullcontext()
                    with turn, self.timer.phase(name):
                        outs[name] = group.forward(batch, **args)
            for name, out, end in done.result():
                self.timer.record(name, t0, end - t0)
                outs[name] = out
        return batch.with_columns(score_columns(outs))

    def scoring(self) -> dict[str, tuple[Role, dict[str, Any]]]:
        """The forwards of :meth:`score`: phase -> (the role that runs it, its arguments)."""
        kw = {"temperature": self.temperature}
        calls = {}
        if self.ref_scoring is not None:
            role, extra = self.ref_scoring
            calls["reference"] = (role, kw | extra)
        if Role.TEACHER in self.roles:  # scored as the reference, at the same temperature
            calls["teacher_log_probs"] = (Role.TEACHER, kw)
        calls["old_log_probs"] = (Role.ACTOR, kw | {"entropy": True})
        if Role.CRITIC in self.roles:
            calls["values"] = (Role.CRITIC, {})
        return calls

    def losses(self) -> dict[Role, tuple[Any, bool]]:
        """Each trained role's loss and whether its train_step computes entropy."""
        out = {Role.ACTOR: (self.actor_loss, self.spec.needs_entropy)}
        if Role.CRITIC in self.roles:
            out[Role.CRITIC] = (self.critic_loss, False)
        return out

    def first_calls(self) -> dict[Role, list[tuple[str, Batch, tuple, dict[str, Any]]]]:
        """Step 1's engine calls on a placeholder of its batch: the rollout's columns and
        shapes for the step's real prompts (``RolloutPool.placeholder``, every response
        ``max_tokens`` long, as :meth:`collect` pads them), then zeros for the rewards,
        the scores and the advantages, so each call sees the columns and shapes it will
        (a jitted program depends on both); the single-turn stream's batches have them
        at the same width, and each token's weight version. Multi-turn episodes: their
        batch's columns, ``max_episode_tokens`` wide (``polyrl.rollout.episodes.placeholder``)."""
        sampling = self.sampling_for(0)
        prompts = self.prompts.batch(0, self.cfg.prompts_per_step)
        if self.cfg.episodes is not None:
            from polyrl.rollout import episodes

            batch = episodes.placeholder(prompts, sampling, self.cfg.episodes, self.tokenizer)
        else:
            batch = self.pool.placeholder(prompts, sampling, sampling.max_tokens)
        if self.cfg.streaming:  # (polyrl.loop.streaming.Stream._assemble)
            versions = np.full(batch["responses"].shape, -1, np.int32)
            batch = batch.with_columns({"rollout_token_versions": versions})
        if self.spec.needs_greedy_baseline:
            batch = batch.with_columns({"baseline_scores": np.zeros(len(batch), np.float32)})
        calls: dict[Role, list] = {}
        if Role.REWARD_MODEL in self.roles:
            calls[Role.REWARD_MODEL] = [("forward", batch, (), {})]
        batch = reward_columns(batch, np.zeros(len(batch), np.float32))
        for role, args in self.scoring().values():
            calls.setdefault(role, []).append(("forward", batch, (), args))
        zeros = np.zeros(batch["responses"].shape, np.float32)
        outs = {"log_probs": zeros, "entropy": zeros, "values": zeros}
        batch = batch.with_columns(score_columns({name: outs for name in self.scoring()}))
        batch = batch.with_columns({"advantages": zeros, "returns": zeros})
        part = batch.take(np.arange(min(self.mini_rows, len(batch))))
        for role, (loss_fn, entropy) in self.losses().items():
            rows = part.pad_to_multiple(self.roles[role].num_workers)
            kwargs = {"temperature": self.temperature, "entropy": entropy}
            calls.setdefault(role, []).append(("train_step", rows, (loss_fn,), kwargs))
        return calls

    def shadow_check(self, step: int, batch: Batch) -> dict[str, float]:
        """The three-way check (``polyrl.observe.shadow``, ``RunConfig.shadow_every``): the
        shadow engine (the other backend) gets the actor's weights and scores the batch;
        its log-probs, vLLM's and the actor's are compared on the first
        ``shadow_per_prompt`` responses of each prompt. Writes
        ``<run_dir>/shadow/step_<N>.json`` (metrics, verdict, worst tokens) and the batch
        with the three sides' columns (``step_<N>_batch.npz/.json``, for ``polyrl
        diagnose``)."""
        from polyrl.loop.async_rollout import save_batch

        if self.cfg.shadow_per_prompt is not None and "group_ids" in batch:
            per, workers = self.cfg.shadow_per_prompt, self.shadow.num_workers
            batch = batch.take(shadow.scored_rows(batch["group_ids"], per, workers))
        # The servers' last push, when it holds these weights (version = updates so far)
        # in full (with LoRA it holds the adapted projections only)
        whole = self.pool.version == step and self.cfg.lora is None
        pushed = self.pool.retained if whole else None
        with self.turns.resident(self.shadow):
            self.shadow.load_weights_from(self.actor, self.bucket_bytes, pushed)
            out = self.shadow.forward(batch, temperature=self.temperature, entropy=True)
        batch = batch.with_columns(
            {"shadow_log_probs": out["log_probs"], "shadow_entropy": out["entropy"]}
        )
        metrics, worst, verdict = shadow.compare(batch, self.tokenizer, self.cfg.shadow_tolerance)
        where = self.run_dir / "shadow" / f"step_{step + 1}"
        shadow.write_report(
            where.with_suffix(".json"),
            step + 1,
            metrics,
            worst,
            shadow.sides(self.cfg.backend),
            verdict,
            sampling_vocab_size=self.vocab,
        )
        save_batch(batch, where.with_name(where.name + "_batch"))
        return metrics

    def inspect(self, step: int, batch: Batch, metrics: dict[str, float]) -> dict[str, float]:
        """Health checks and the rollout dump of one step (docs/debugging.md)."""
        stats = response_stats(batch, self.tokenizer) | batch.info.get("episode_metrics", {})
        self.dumps.write(step + 1, batch)
        return stats | self.health.check(metrics | stats, batch["scores"])

    @property
    def mini_rows(self) -> int:
        return self.cfg.mini_batch_prompts * self.cfg.sampling.n

    # ------------------------------------------------------------------ stages
    def collect(self, step: int, index: int | None = None) -> Batch:
        """``n`` responses to each prompt of data batch ``index`` (default: the step's own;
        DAPO's refills use others), sampled with noise seeded by that index, plus the
        greedy baseline for ReMax."""
        index = step if index is None else index
        prompts = self.prompts.batch(index, self.cfg.prompts_per_step)
        sampling = self.sampling_for(index)
        # A fixed response width: a jitted backend then compiles once per prompt bucket.
        width = sampling.max_tokens
        if self.episodes is not None:  # each row an episode (width: max_episode_tokens)
            batch = self.episodes.generate(prompts, sampling)
        else:
            batch = self.pool.generate(prompts, sampling, response_len=width)
        if self.spec.needs_greedy_baseline:
            greedy = dataclasses.replace(sampling, n=1, temperature=0.0)
            base = self.reward(self.pool.generate(prompts, greedy, response_len=width))
            scores = base["token_rewards"].sum(-1)
            batch = batch.with_columns({"baseline_scores": scores[batch["group_ids"]]})
        return batch.with_columns(step=step)

    def sampling_for(self, index: int) -> Any:
        """The SamplingSpec of data batch ``index``: fresh, reproducible noise for each."""
        sampling = self.cfg.sampling
        if sampling.seed is None:
            return sampling
        seed = int(np.random.SeedSequence([sampling.seed, index]).generate_state(1)[0] >> 1)
        return dataclasses.replace(sampling, seed=seed)

    def filter_groups(self, batch: Batch, step: int) -> tuple[Batch, float]:
        """DAPO dynamic sampling: drop groups whose rewards are all equal (zero advantage),
        generating up to ``max_gen_batches - 1`` more prompt batches until
        ``prompts_per_step`` informative groups are found (fewer: train on what there is)."""
        from polyrl.algos.dapo import dynamic_sampling_mask

        want, n = self.cfg.prompts_per_step, self.cfg.sampling.n
        seen, kept = len(batch), []
        for extra in range(self.cfg.max_gen_batches):
            if extra:
                with self.rollouts.exclusive():  # not beside a generation ahead
                    more = self.collect(
                        step, self.cfg.total_steps + step * self.cfg.max_gen_batches + extra
                    )
                more = self.reward(more)
                batch, seen = (
                    more.with_columns({"group_ids": more["group_ids"] + 10**6 * extra}),
                    seen + len(more),
                )
            kept.append(
                batch.take(np.asarray(dynamic_sampling_mask(batch["scores"], batch["group_ids"])))
            )
            if sum(len(b) for b in kept) >= want * n:
                break
        out = Batch.concat(kept)
        if len(out) == 0:  # nothing informative: the last batch, whose advantages are all 0
            return batch.with_columns(step=step), 0.0
        return out.take(slice(0, want * n)).with_columns(step=step), len(out) / seen

    def reward(self, batch: Batch) -> Batch:
        """Reward per response — the rule for its data_source, plus ``reward_model_coef`` x
        the reward model's score when there is one, plus ``JudgeConfig.coef`` x the LLM
        judge's score with ``RunConfig.judge`` (its raw replies: the ``judge`` column) —
        placed on its last valid token. Episodes come scored by their envs
        (``token_rewards``: each turn's reward)."""
        if "token_rewards" in batch:
            return batch
        scores = self.rewards.score(
            batch["response_text"], batch["ground_truth"], batch["data_source"], batch["extra_info"]
        )
        if self.reward_model is not None:
            with self.turns.resident(self.reward_model):
                rm_scores = self.reward_model.forward(batch)["scores"].astype(np.float32)
            if rm_scores.shape != scores.shape or not np.isfinite(rm_scores).all():
                raise RewardError(
                    f"reward model {self.cfg.reward_model.model_path} returned scores of shape "
                    f"{rm_scores.shape} ({np.isfinite(rm_scores).sum()} finite) for "
                    f"{len(scores)} responses"
                )
            scores = scores + self.cfg.reward_model_coef * rm_scores
        if self.judge is not None:
            judged, replies = self.judge.score(batch)
            scores = scores + self.cfg.judge.coef * judged
            batch = batch.with_columns(meta={"judge": replies})
        return reward_columns(batch, scores)

    def advantages(self, batch: Batch) -> tuple[Batch, dict[str, float]]:
        from polyrl.algos.kl import apply_kl_penalty

        metrics: dict[str, float] = {}
        rewards = batch["token_rewards"]
        if self.spec.overlong_buffer_len:
            from polyrl.algos.dapo import overlong_penalty

            lengths = batch["response_mask"].sum(-1)
            pen = overlong_penalty(
                lengths,
                self.cfg.sampling.max_tokens,
                min(self.spec.overlong_buffer_len, self.cfg.sampling.max_tokens),
                self.spec.overlong_penalty_factor,
            )
            rewards = rewards.copy()
            last = np.maximum(lengths.astype(np.int64) - 1, 0)
            rewards[np.arange(len(batch)), last] += pen.astype(np.float32)
        if self.kl_ctrl is not None:
            rewards, current_kl = apply_kl_penalty(
                rewards,
                batch["old_log_probs"],
                batch["ref_log_probs"],
                batch["response_mask"],
                self.kl_state.coef,
                self.spec.kl_reward_kind,
            )
            coef, self.kl_state = self.kl_ctrl.update(float(current_kl), len(batch), self.kl_state)
            metrics |= {"kl_in_reward/kl": float(current_kl), "kl_in_reward/coef": coef}
        names = ("response_mask", "group_ids", "values", "baseline_scores")
        names += ("old_log_probs", "teacher_log_probs")  # on-policy distillation's
        columns = {k: batch[k] for k in names if k in batch}
        adv, returns, found = self.spec.compute_advantages(
            {**columns, "token_rewards": rewards.astype(np.float32)}, with_metrics=True
        )
        metrics |= {k: float(v) for k, v in found.items()}
        mask = batch["response_mask"]
        lengths = mask.sum(-1)
        if "values" in batch:  # health checks of the critic (polyrl.observe.health)
            metrics["critic/explained_variance"] = explained_variance(
                batch["values"], returns, mask
            )
            sq = np.asarray(returns, np.float64) ** 2
            metrics["critic/zero_value_loss"] = float(0.5 * (sq * mask).sum() / max(mask.sum(), 1))
        metrics |= {
            "reward/mean": float(batch["scores"].mean()),
            "reward/max": float(batch["scores"].max()),
            "reward/min": float(batch["scores"].min()),
            "response/length_mean": float(lengths.mean()),
            # every row's real tokens (prompt + response, observations included): what a
            # forward over the batch computes on (experiments/bench/grpo_step.py's MFU)
            "batch/tokens": float((batch["prompt_lengths"] + batch["response_lengths"]).sum()),
            "advantages/abs_mean": float(np.abs(adv).sum() / max(mask.sum(), 1)),
            "actor/entropy": float((batch["old_entropy"] * mask).sum() / max(mask.sum(), 1)),
        }
        batch = batch.with_columns(
            {"advantages": np.asarray(adv, np.float32), "returns": np.asarray(returns, np.float32)}
        )
        return batch, metrics

    def _host_weights(self) -> list[Any]:
        with self.turns.resident(self.actor):
            return self.actor.host_buckets(self.bucket_bytes)

    @property
    def bucket_bytes(self) -> int:
        from polyrl.weight_sync import bucket_bytes

        return bucket_bytes(self.cfg.weight_transport, self.cfg.weight_bucket_mb)

    def weights_snapshot(self, version: int) -> Callable[[], dict[str, float]]:
        """A host copy of the actor's weights, now, and a push of it to the rollout
        servers as ``version`` (object store) for the background generator to run
        between two batches (``Rollouts.sync``), while the actor trains on."""
        buckets = self._host_weights()

        def push() -> dict[str, float]:
            stats = self.pool.weight_syncer("object_store", retain=False).push(buckets, version)
            self.pool.commit(stats)
            return {}

        return push

    def sync_weights(self, version: int) -> dict[str, float]:
        self.syncer.ensure_group(self.actor.form_weight_group)  # again after a server restart
        partial = self.pushed_full and self.cfg.lora is not None  # LoraConfig.changes
        stats = self.actor.sync_weights(self.syncer, self.bucket_bytes, version, partial)
        self.pushed_full = True
        self.pool.commit(stats)
        return {"sync/seconds": float(stats.seconds), "sync/gb": stats.bytes / 1e9}


# Algorithm objective -> its loop.
LOOPS = {
    "rl": RLTrainer,
    "preference": PreferenceTrainer,
    "sft": SFTTrainer,
    "reward_model": RewardModelTrainer,
}


def reward_columns(batch: Batch, scores: np.ndarray) -> Batch:
    """``batch`` with each response's score [B] (``scores``) and ``token_rewards`` [B, R]:
    the score on the response's last valid token."""
    mask = batch["response_mask"]
    token_rewards = np.zeros_like(mask, dtype=np.float32)
    last = np.maximum(mask.sum(-1).astype(np.int64) - 1, 0)
    token_rewards[np.arange(len(batch)), last] = scores * (mask.sum(-1) > 0)
    return batch.with_columns({"token_rewards": token_rewards, "scores": scores})


def score_columns(outs: dict[str, dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """The batch columns of :meth:`RLTrainer.score`'s forwards (by phase name)."""
    columns = {}
    if "reference" in outs:
        columns["ref_log_probs"] = outs["reference"]["log_probs"]
    if "teacher_log_probs" in outs:
        columns["teacher_log_probs"] = outs["teacher_log_probs"]["log_probs"]
    columns |= {
        "old_log_probs": outs["old_log_probs"]["log_probs"],
        "old_entropy": outs["old_log_probs"]["entropy"],
    }
    if "values" in outs:
        columns["values"] = outs["values"]["values"]
    return columns
