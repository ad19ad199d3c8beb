"""Validation during training: held-out prompts, generated and scored like training.

Every ``RunConfig.eval_every`` steps (and once before the first step and once after the
last), :class:`Evaluator` sends every validation prompt to the rollout servers with the
validation SamplingSpec (greedy, one sample, unless ``RunConfig.val_sampling`` says
otherwise), scores the responses with the trainer's own reward entry point (the same
rule rewards and reward model as training) and returns ``val/...`` metrics:

    val/reward/mean                      mean reward over every validation sample
    val/response/length_mean             mean response length (tokens)
    val/<data_source>/reward/mean@<n>    mean reward of that source's samples
    val/<data_source>/pass@<k>           unbiased pass@k (polyrl.algos.evaluation) for
                                         k = 1, 2, 4, ... < n and n; a sample is correct
                                         when its reward is >= 1 (full credit)

Evaluation is a pure side computation: it samples with its own seeds, draws nothing
from the training data order, and changes no weights, so the training metrics of a run
with validation equal those of the same run without it (tests/trainer checks this).
The metrics of step ``s`` are those of the weights step ``s`` samples with; the final
weights' are logged as one more line, ``step = total_steps``. The first
``DUMPED_SAMPLES`` decoded samples of each evaluation go to
``<run_dir>/val_samples/step_<s>.jsonl``.

A reward model in training (objective "reward_model") is validated by
:class:`PairEvaluator` instead, on the same schedule: the model scores every held-out
preference pair, and

    val/pair_accuracy                    share of pairs whose chosen response scores
                                         above the rejected one (a tie is wrong;
                                         polyrl.algos.losses.pair_accuracy)
    val/rewards/margins                  mean score of chosen minus rejected
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from polyrl.algos.evaluation import mean_pass_at_k, pass_at_k_values
from polyrl.algos.losses import pair_accuracy
from polyrl.batch import Batch

__all__ = [
    "Evaluator",
    "PairEvaluator",
    "validation_sampling",
    "validation_prompts",
    "check_validation",
]

DUMPED_SAMPLES = 8
# A sample counts as correct for pass@k at full credit.
CORRECT_REWARD = 1.0


def validation_sampling(cfg: Any) -> Any:
    """``RunConfig.val_sampling``, or greedy decoding of one sample at the training
    response length."""
    if cfg.val_sampling is not None:
        return cfg.val_sampling
    return dataclasses.replace(cfg.sampling, n=1, temperature=0.0)


def check_validation(cfg: Any, spec: Any) -> list[str]:
    """Problems with the validation bindings for algorithm ``spec`` (validate-config
    lists them)."""
    out = []
    if cfg.eval_every > 0 and not spec.evaluates:
        out.append(
            f"RunConfig.eval_every={cfg.eval_every}: validation generates and scores "
            f"responses (or a reward model's held-out pairs), which {spec.name} (objective "
            f"{spec.objective!r}) does not; set RunConfig.eval_every = 0"
        )
    if cfg.eval_every < 0:
        out.append(f"RunConfig.eval_every={cfg.eval_every} must be >= 0 (0: no validation)")
    has_data = bool(cfg.val_files) or (cfg.n_val_prompts > 0 and not cfg.train_files)
    if cfg.eval_every > 0 and not has_data:
        out.append(
            f"RunConfig.eval_every={cfg.eval_every} but there is no validation data: set "
            f"RunConfig.val_files (or, with the built-in task, RunConfig.n_val_prompts > 0)"
        )
    if cfg.n_val_prompts < 0:
        out.append(f"RunConfig.n_val_prompts={cfg.n_val_prompts} must be >= 0")
    spec = validation_sampling(cfg)
    if spec.n > 1 and spec.temperature == 0:
        out.append(
            f"val/SamplingSpec.n={spec.n} with temperature 0: greedy samples are identical; "
            f"set val/polyrl.SamplingSpec.temperature > 0 for pass@k, or n = 1"
        )
    return out


def validation_prompts(cfg: Any, tokenizer: Any, source: Any, **kw: Any) -> Any:
    """The validation data as a ``source`` (``polyrl.data.loader``: PromptSource, or a
    reward model's PairSource), from ``val_files`` or the task's test split; None when
    validation is off."""
    if cfg.eval_every <= 0:
        return None
    if cfg.val_files:
        return source.from_files(cfg.val_files, tokenizer, **kw)
    return source.from_task(cfg.task, cfg.n_val_prompts, tokenizer, split="test", **kw)


class Evaluator:
    """Generates on and scores the validation prompts; see the module docstring.

    generate(prompts, spec) -> Batch: the rollout pool's ``generate``.
    reward(batch) -> Batch: the trainer's reward stage (adds the ``scores`` column).
    """

    def __init__(
        self,
        cfg: Any,
        prompts: Any,
        tokenizer: Any,
        generate: Callable[[Batch, Any], Batch],
        reward: Callable[[Batch], Batch],
    ):
        self.every, self.prompts, self.tokenizer = cfg.eval_every, prompts, tokenizer
        self.spec = validation_sampling(cfg)
        self.generate, self.reward = generate, reward
        self.out_dir = Path(cfg.run_dir) / "val_samples"

    def due(self, step: int) -> bool:
        return step % self.every == 0

    def evaluate(self, step: int) -> dict[str, float]:
        """Validation metrics of the current weights, logged as step ``step``."""
        t0 = time.perf_counter()
        prompts = self.prompts.take(np.arange(len(self.prompts)))
        batch = self.reward(self.generate(prompts, self.spec))
        metrics = self.metrics(batch)
        self.dump(step, batch)
        metrics["time/validate"] = time.perf_counter() - t0
        print(_line(step, metrics, len(prompts), self.spec.n), flush=True)
        return metrics

    def metrics(self, batch: Batch) -> dict[str, float]:
        scores = np.asarray(batch["scores"], dtype=np.float64)
        sources = np.asarray(batch["data_source"])
        groups = np.asarray(batch["group_ids"])
        n = self.spec.n
        out = {
            "val/reward/mean": float(scores.mean()),
            "val/response/length_mean": float(batch["response_mask"].sum(-1).mean()),
        }
        for source in sorted(set(sources.tolist())):
            rows = np.flatnonzero(sources == source)
            out[f"val/{source}/reward/mean@{n}"] = float(scores[rows].mean())
            # rows of one prompt are consecutive (RolloutPool.generate); a dropped
            # (over-long) prompt has no rows at all
            _, first = np.unique(groups[rows], return_index=True)
            correct = (scores[rows] >= CORRECT_REWARD).reshape(len(first), n)
            for k in pass_at_k_values(n):
                out[f"val/{source}/pass@{k}"] = mean_pass_at_k(correct, k)
        return out

    def dump(self, step: int, batch: Batch) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        lines = []
        for i in range(min(DUMPED_SAMPLES, len(batch))):
            prompt = self.tokenizer.decode(batch["prompt_ids"][i])
            lines.append(
                json.dumps(
                    {
                        "data_source": batch["data_source"][i],
                        "prompt": prompt,
                        "response": batch["response_text"][i],
                        "ground_truth": batch["ground_truth"][i],
                        "reward": float(batch["scores"][i]),
                    }
                )
            )
        (self.out_dir / f"step_{step}.jsonl").write_text("\n".join(lines) + "\n")


class PairEvaluator:
    """A reward model's held-out pair accuracy (module docstring): ``pairs`` is a
    ``polyrl.data.loader.PairSource``, ``model`` the engine group being trained (its
    ``forward`` returns ``scores``, one per row)."""

    def __init__(self, every: int, pairs: Any, model: Any):
        self.every, self.pairs, self.model = every, pairs, model

    def due(self, step: int) -> bool:
        return step % self.every == 0

    def evaluate(self, step: int) -> dict[str, float]:
        t0 = time.perf_counter()
        batch = self.pairs.take(np.arange(len(self.pairs)))
        rows = len(batch)
        scores = self.model.forward(batch.pad_to_multiple(self.model.num_workers))["scores"]
        scores = np.asarray(scores[:rows], np.float64)
        correct, pairs = pair_accuracy(scores[0::2], scores[1::2])
        metrics = {
            "val/pair_accuracy": float(correct / pairs),
            "val/rewards/margins": float(np.mean(scores[0::2] - scores[1::2])),
            "time/validate": time.perf_counter() - t0,
        }
        print(
            f"[validate] step {step}: pair accuracy {metrics['val/pair_accuracy']:.3g}  "
            f"margin {metrics['val/rewards/margins']:.3g}  ({rows // 2} held-out pairs, "
            f"{metrics['time/validate']:.2f} s)",
            flush=True,
        )
        return metrics


def _line(step: int, m: dict[str, float], prompts: int, n: int) -> str:
    pass1 = [v for k, v in m.items() if k.endswith("/pass@1")]
    return (
        f"[validate] step {step}: reward {m['val/reward/mean']:.3g}  "
        f"pass@1 {np.mean(pass1):.3g}  ({prompts} prompts x {n}, {m['time/validate']:.2f} s)"
    )
