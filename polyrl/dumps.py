"""Rollout dumps: decoded samples of a step, to read what the model saw and wrote.

Every ``RunConfig.dump_every`` steps, ``RunConfig.dump_samples`` samples spread over the
batch go to ``<run_dir>/rollouts.jsonl``, one JSON object per line::

    step, index, data_source, prompt (after the chat template, special tokens kept),
    response, ground_truth, reward, advantage (mean over the response tokens),
    prompt_length, response_length, finish_reason ("stop" | "length")

The first dump is also printed, one line per sample, so a run that scores nothing shows
why at its first step.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["RolloutDumps", "dump_rows"]


def dump_rows(batch: Any, tokenizer: Any, samples: int, step: int) -> list[dict[str, Any]]:
    """``samples`` rows of ``batch`` (spread evenly over it) as plain dicts."""
    rows = np.unique(np.linspace(0, len(batch) - 1, min(samples, len(batch))).round().astype(int))
    mask = batch["response_mask"]
    adv = batch.tensors.get("advantages")
    out = []
    for i in rows:
        n_resp = int(mask[i].sum())
        out.append(
            {
                "step": step,
                "index": int(i),
                "data_source": str(batch["data_source"][i]),
                "prompt": tokenizer.decode(batch["prompt_ids"][i], skip_special_tokens=False),
                "response": str(batch["response_text"][i]),
                "ground_truth": str(batch["ground_truth"][i]),
                "reward": float(batch["scores"][i]),
                "advantage": float((adv[i] * mask[i]).sum() / max(n_resp, 1))
                if adv is not None
                else None,
                "prompt_length": int(batch["prompt_lengths"][i]),
                "response_length": int(batch["response_lengths"][i]),
                "finish_reason": str(batch["finish_reason"][i]),
            }
        )
    return out


class RolloutDumps:
    """Appends dumps to ``<run_dir>/rollouts.jsonl``; ``every=0`` turns them off."""

    def __init__(
        self,
        run_dir: str | Path,
        tokenizer: Any,
        every: int,
        samples: int,
        echo: Callable[[str], Any] = print,
    ):
        self.path = Path(run_dir) / "rollouts.jsonl"
        self.tokenizer, self.every, self.samples, self.echo = tokenizer, every, samples, echo
        self.shown = False

    def write(self, step: int, batch: Any) -> None:
        if not self.every or step % self.every or "response_text" not in batch:
            return
        rows = dump_rows(batch, self.tokenizer, self.samples, step)
        with self.path.open("a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        if not self.shown:
            self.shown = True
            self.echo(f"[rollouts] step {step}: {len(rows)} samples (all in {self.path})")
            for r in rows:
                adv = "" if r["advantage"] is None else f" adv {r['advantage']:+.2f}"
                self.echo(
                    f"  reward {r['reward']:.3g}{adv} len {r['response_length']} "
                    f"({r['finish_reason']}) | {r['prompt']!r} -> {r['response']!r} "
                    f"(truth {r['ground_truth']!r})"
                )
