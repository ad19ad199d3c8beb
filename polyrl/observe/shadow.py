"""The three-way log-prob check (docs/diagnosis.md): which side of a run is wrong.

Three independent stacks score the same sampled tokens with the same weights: vLLM
(``rollout``: the log-probs it sampled with), the training backend (``train``: the old
log-probs) and the other backend (``shadow``: a frozen engine given the actor's weights,
``RunConfig.shadow_every``). Where one side disagrees with the two others, that side is
wrong. :func:`gap_metrics` measures the three pairwise gaps, :func:`odd_side` names the
side that disagrees, :func:`worst_tokens` lists the tokens with the largest gaps as text.
Framework-free: numpy arrays in, floats and dicts out; the online check (trainer) and
``polyrl diagnose`` share it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "SIDES",
    "PAIRS",
    "sides",
    "gap_metrics",
    "odd_side",
    "worst_tokens",
    "write_report",
    "compare",
    "SIDE_CODES",
    "POSITION_BUCKETS",
    "scored_rows",
]

SIDES = ("rollout", "train", "shadow")
PAIRS = (("rollout", "train"), ("rollout", "shadow"), ("train", "shadow"))


def sides(backend: str) -> dict[str, str]:
    """Which stack each side of the three-way check is, for a run on ``backend``."""
    from polyrl.backends.base import other_backend

    return {"rollout": "vLLM", "train": backend, "shadow": other_backend(backend)}


# Response positions [lo, hi): early tokens see short contexts, late ones long ones (a
# position-dependent fault, e.g. in RoPE or the attention mask, grows with position).
POSITION_BUCKETS = ((0, 4), (4, 16), (16, 64), (64, 256), (256, None))
# A side is named only when the two other sides agree this much better than it does with
# either of them (kernel noise alone gives three gaps of the same order).
SEPARATION = 4.0


def scored_rows(group_ids: np.ndarray, per_prompt: int, multiple: int = 1) -> np.ndarray:
    """Indices of the rows the check scores (``RunConfig.shadow_per_prompt``): the first
    ``per_prompt`` rows of each prompt's group (``group_ids``), topped up with the next
    unchosen rows to a multiple of ``multiple`` (the shadow's workers split them evenly).
    Sorted."""
    rank = np.zeros(len(group_ids), np.int64)  # each row's place within its group
    seen: dict[int, int] = {}
    for i, g in enumerate(np.asarray(group_ids).tolist()):
        rank[i], seen[g] = seen.get(g, 0), seen.get(g, 0) + 1
    chosen = rank < per_prompt
    short = -int(chosen.sum()) % multiple
    chosen[np.flatnonzero(~chosen)[:short]] = True
    return np.flatnonzero(chosen)


def _pair(a: str, b: str) -> str:
    return f"{a}_{b}"


def _frequency_buckets(responses: np.ndarray, mask: np.ndarray) -> dict[str, np.ndarray]:
    """Tokens by how often their id occurs among the batch's response tokens, cut at the
    1/3 and 2/3 quantiles of those frequencies (``freq_low`` <= the first < ``freq_mid``
    <= the second < ``freq_high``; ties fall low, so a bucket may be empty)."""
    ids = responses[mask]
    counts = dict(zip(*np.unique(ids, return_counts=True)))
    freq = np.vectorize(lambda t: counts.get(t, 0), otypes=[np.int64])(responses) * mask
    lo, hi = np.quantile(freq[mask], [1 / 3, 2 / 3]) if mask.any() else (0, 0)
    return {
        "freq_low": mask & (freq <= lo),
        "freq_mid": mask & (freq > lo) & (freq <= hi),
        "freq_high": mask & (freq > hi),
    }


def gap_metrics(
    log_probs: dict[str, np.ndarray],
    mask: np.ndarray,
    responses: np.ndarray,
    entropy: dict[str, np.ndarray] | None = None,
) -> dict[str, float]:
    """``shadow/gap_mean/<a>_<b>`` and ``shadow/gap_max/<a>_<b>`` (mean and max of
    ``|log p_a - log p_b|`` over response tokens) for each pair of :data:`SIDES`, the mean
    by response-position bucket (``.../pos_<lo>_<hi>``) and by token-frequency bucket
    (``.../freq_low|mid|high``), ``shadow/entropy_gap_mean/train_shadow`` when both
    entropies are given, and ``shadow/tokens``."""
    m = np.asarray(mask) > 0
    responses = np.asarray(responses)
    pos = np.broadcast_to(np.arange(m.shape[1]), m.shape)
    buckets = {
        f"pos_{lo}_{hi or 'up'}": m & (pos >= lo) & (pos < (hi or m.shape[1]))
        for lo, hi in POSITION_BUCKETS
    }
    buckets |= _frequency_buckets(responses, m)
    out = {"shadow/tokens": float(m.sum())}
    for a, b in PAIRS:
        gap = np.abs(np.asarray(log_probs[a], np.float64) - np.asarray(log_probs[b], np.float64))
        name = _pair(a, b)
        out[f"shadow/gap_mean/{name}"] = float(gap[m].mean()) if m.any() else 0.0
        out[f"shadow/gap_max/{name}"] = float(gap[m].max()) if m.any() else 0.0
        for bucket, sel in buckets.items():
            if sel.any():
                out[f"shadow/gap_mean/{name}/{bucket}"] = float(gap[sel].mean())
    if entropy is not None and {"train", "shadow"} <= set(entropy):
        gap = np.abs(np.asarray(entropy["train"], np.float64) - entropy["shadow"])
        out["shadow/entropy_gap_mean/train_shadow"] = float(gap[m].mean()) if m.any() else 0.0
    return out


def odd_side(metrics: dict[str, float], tolerance: float) -> str | None:
    """The side that disagrees with the two others, from :func:`gap_metrics`'s means:
    ``"rollout"``, ``"train"`` or ``"shadow"``; ``"all"`` when the three disagree with
    each other; None when every gap is within ``tolerance``. A side is named when both of
    its gaps exceed ``tolerance`` and the two others agree :data:`SEPARATION` x better."""
    gaps = {pair: metrics[f"shadow/gap_mean/{_pair(*pair)}"] for pair in PAIRS}
    if max(gaps.values()) <= tolerance:
        return None
    closest = min(gaps, key=gaps.get)
    odd = next(s for s in SIDES if s not in closest)
    others = [g for pair, g in gaps.items() if odd in pair]
    if min(others) > tolerance and min(others) > SEPARATION * gaps[closest]:
        return odd
    return "all"


def worst_tokens(
    log_probs: dict[str, np.ndarray],
    mask: np.ndarray,
    responses: np.ndarray,
    tokenizer: Any,
    count: int = 20,
) -> list[dict[str, Any]]:
    """The ``count`` response tokens with the largest gap between any two sides: row,
    position, token id and text, the three log-probs and the response up to it."""
    m = np.asarray(mask) > 0
    stack = np.stack([np.asarray(log_probs[s], np.float64) for s in SIDES])
    spread = np.where(m, stack.max(0) - stack.min(0), -1.0)
    flat = np.argsort(spread, axis=None)[::-1][: min(count, int(m.sum()))]
    rows = []
    for row, pos in zip(*np.unravel_index(flat, m.shape)):
        token = int(responses[row, pos])
        rows.append(
            {
                "row": int(row),
                "position": int(pos),
                "token_id": token,
                "token": tokenizer.decode([token]),
                "context": tokenizer.decode(list(map(int, responses[row, : pos + 1]))),
                "spread": float(spread[row, pos]),
                **{s: float(stack[i, row, pos]) for i, s in enumerate(SIDES)},
            }
        )
    return rows


# ``shadow/odd_side`` in metrics.jsonl: which side odd_side named.
SIDE_CODES = {None: 0.0, "rollout": 1.0, "train": 2.0, "shadow": 3.0, "all": 4.0}


def compare(batch: Any, tokenizer: Any, tolerance: float, worst: int = 20):
    """``(metrics, worst tokens, verdict)`` of a batch holding the three sides' columns:
    ``rollout_log_probs``, ``old_log_probs`` (+ ``old_entropy``) and ``shadow_log_probs``
    (+ ``shadow_entropy``). ``metrics`` holds :func:`gap_metrics` and ``shadow/odd_side``
    (:data:`SIDE_CODES`)."""
    lp = {
        "rollout": batch["rollout_log_probs"],
        "train": batch["old_log_probs"],
        "shadow": batch["shadow_log_probs"],
    }
    ent = {"train": batch["old_entropy"], "shadow": batch["shadow_entropy"]}
    mask, responses = batch["response_mask"], batch["responses"]
    metrics = gap_metrics(lp, mask, responses, ent)
    verdict = odd_side(metrics, tolerance)
    metrics["shadow/odd_side"] = SIDE_CODES[verdict]
    return metrics, worst_tokens(lp, mask, responses, tokenizer, worst), verdict


def write_report(
    path: Path,
    step: int,
    metrics: dict[str, float],
    worst: list[dict[str, Any]],
    sides: dict[str, str],
    verdict: str | None,
    **extra: Any,
) -> None:
    """``path`` (JSON): the step's three-way metrics, the verdict, which stack each side
    is, the worst tokens and ``extra`` (what ``polyrl diagnose`` needs to score again)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"step": step, "sides": sides, "odd_side": verdict, "metrics": metrics, "worst": worst}
    doc |= extra
    path.write_text(json.dumps(doc, indent=1))
