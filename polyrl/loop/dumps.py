"""Rollout dumps: decoded samples of a step, to read what the model saw and wrote.

At step 1 and every ``RunConfig.dump_every`` steps (steps count from 1, as in the
progress line), ``RunConfig.dump_samples`` samples spread over the batch go to
``<run_dir>/rollouts.jsonl``, one JSON object per line::

    step, index, prompt_index (the data row), data_source, prompt (after the chat
    template, special tokens kept), response, ground_truth, reward, advantage (mean over
    the response tokens), prompt_length, response_length, finish_reason ("stop" | "length"),
    and with an LLM judge (``RunConfig.judge``) judge: its raw replies, one per attempt

A multi-turn episode (``polyrl.rollout.episodes``) also has ``turns`` (each turn's text,
tokens, finish_reason, reward, and the observation messages that followed, with their
token count) and ``drift``; its ``response`` is the turns on one line
(``[0] '5' (r 0) -> user '+' | [1] '7' (r 0.75)``) and ``finish_reason`` the episode's.

A resumed run first drops the dumps of steps after its checkpoint (as ``metrics.jsonl``
does), so the file holds each step's samples once.

The first dump is also printed in full, one line per sample, so a run that scores
nothing shows why at its first step; later dumps print their first two samples in one
short line each (``  [sample] step 10: 'copy 814' -> '3266' (want '814', reward 0.19)``).
The printed text of a dump stays in ``RolloutDumps.text`` for TensorBoard.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from polyrl.loop.metrics import drop_steps_after

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
                "prompt_index": int(batch["prompt_index"][i]) if "prompt_index" in batch else None,
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
        if "judge" in batch:  # RunConfig.judge: the judge's raw replies, one per attempt
            out[-1]["judge"] = list(batch["judge"][i])
        if "turns" in batch:  # a multi-turn episode (polyrl.rollout.episodes): each turn
            out[-1]["turns"] = list(batch["turns"][i])
            out[-1]["drift"] = batch["drift"][i] if "drift" in batch else None
            out[-1]["response"] = show_turns(out[-1]["turns"])
    return out


def _shown(row: dict[str, Any]) -> str:
    return row["response"] if "turns" in row else repr(row["response"])


def show_turns(turns: list[dict[str, Any]]) -> str:
    """An episode's turns on one line: ``[0] '5' (r 0) -> user '+' | [1] '7' ...``."""
    parts = []
    for i, t in enumerate(turns):
        part = f"[{i}] {t['text']!r}"
        if "reward" in t:
            part += f" (r {t['reward']:.3g})"
        if "error" in t:
            part += f" (error: {t['error']})"
        obs = t.get("observation") or []
        part += "".join(f" -> {m['role']} {m['content']!r}" for m in obs)
        parts.append(part)
    return " | ".join(parts)


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
        self.text = ""  # the last dump's printed lines, until the trainer logs them

    def resume(self, step: int) -> None:
        """Drop the dumps of steps after ``step`` (a resumed run takes them again)."""
        drop_steps_after(self.path, step)

    def write(self, step: int, batch: Any) -> None:
        due = self.every and (step == 1 or step % self.every == 0)
        if not due or "response_text" not in batch:
            return
        rows = dump_rows(batch, self.tokenizer, self.samples, step)
        with self.path.open("a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        if not self.shown:
            self.shown = True
            lines = [f"[rollouts] step {step}: {len(rows)} samples (all in {self.path})"]
            for r in rows:
                adv = "" if r["advantage"] is None else f" adv {r['advantage']:+.2f}"
                lines.append(
                    f"  reward {r['reward']:.3g}{adv} len {r['response_length']} "
                    f"({r['finish_reason']}) | {r['prompt']!r} -> {_shown(r)} "
                    f"(truth {r['ground_truth']!r})"
                )
        else:
            lines = [
                f"  [sample] step {step}: {r['prompt']!r} -> {_shown(r)} "
                f"(want {r['ground_truth']!r}, reward {r['reward']:.2f})"
                for r in rows[:2]
            ]
        for line in lines:
            self.echo(line)
        self.text = "\n".join(lines)
