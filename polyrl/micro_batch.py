"""Micro-batch planning shared by the training backends (numpy only, no framework).

A backend cuts its shard of a mini-batch into micro-batches, runs forward/backward on
each and accumulates gradients; the loss contract (``backends/base.py``) divides by the
global token/sequence counts, so how the rows are grouped changes speed and memory,
never the update. Two ways to group (``ParallelConfig``):

* ``micro_batch_size`` rows each, in order (the default);
* a token budget, ``max_tokens_per_micro_batch``: rows sorted by length (longest first)
  are added to a micro-batch while the tokens one forward computes on it stay within the
  budget. A row longer than the budget gets a micro-batch of its own. Short rows
  therefore travel in large micro-batches and long ones in small ones, and users stop
  tuning ``micro_batch_size`` per model and sequence length. What a forward computes is
  the backend's ``cost``: :func:`padded_tokens` (``rows x (longest prompt + longest
  response)``, the default), :func:`real_tokens` (a packed micro-batch), or a backend's own
  rule (JAX rounds rows and lengths up to powers of two).

:func:`trim` then drops the columns of a micro-batch that are padding in every row, so a
micro-batch of short rows costs short-row compute even when the mini-batch was padded
to its longest row. Layout (``polyrl.batch``): ``input_ids``/``attention_mask``/
``position_ids`` are [B, P + R] (prompt left-padded to P, response right-padded to R),
``prompts`` is [B, P], every other [B, R] column is response-aligned.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from polyrl.batch import Batch

__all__ = [
    "lengths",
    "plan",
    "padded_tokens",
    "real_tokens",
    "split_to",
    "trim",
    "scatter",
    "SEQUENCE_COLUMNS",
]

SEQUENCE_COLUMNS = ("input_ids", "attention_mask", "position_ids")


def lengths(batch: Batch) -> tuple[np.ndarray, np.ndarray]:
    """Real (unpadded) prompt and response lengths [B] from ``attention_mask``."""
    r = batch["responses"].shape[1]
    mask = batch["attention_mask"] != 0
    return mask[:, :-r].sum(1), mask[:, -r:].sum(1)


def padded_tokens(prompt: np.ndarray, response: np.ndarray) -> int:
    """Tokens a forward computes on rows of these real lengths, trimmed to the longest
    prompt and response (:func:`trim`): ``rows x (longest prompt + longest response)``."""
    return len(prompt) * int(prompt.max() + response.max())


def real_tokens(prompt: np.ndarray, response: np.ndarray) -> int:
    """Tokens a forward computes on these rows packed without padding."""
    return int(prompt.sum() + response.sum())


Cost = Callable[[np.ndarray, np.ndarray], int]


def plan(
    batch: Batch,
    micro_batch_size: int,
    max_tokens: int | None = None,
    cost: Cost = padded_tokens,
) -> list[np.ndarray]:
    """Row indices of each micro-batch (see the module docstring). ``max_tokens`` None:
    ``micro_batch_size`` rows each, in order; else the token budget (rows reordered), with
    ``cost(prompt_lengths, response_lengths)`` the tokens a forward computes on a
    micro-batch of rows of those real lengths, in the micro-batch's order."""
    n = len(batch)
    if max_tokens is None:
        return [np.arange(i, min(i + micro_batch_size, n)) for i in range(0, n, micro_batch_size)]
    prompt, response = lengths(batch)
    order = np.argsort(-(prompt + response), kind="stable")
    groups: list[list[int]] = []
    for i in map(int, order):
        grown = groups[-1] + [i] if groups else None
        if grown and cost(prompt[grown], response[grown]) <= max_tokens:
            groups[-1].append(i)
        else:
            groups.append([i])
    return [np.asarray(g) for g in groups]


def split_to(groups: list[np.ndarray], count: int) -> list[np.ndarray]:
    """Split the largest groups in two until there are ``count`` (data-parallel ranks
    must run the same number of micro-batches: each is a collective)."""
    groups = list(groups)
    while len(groups) < count:
        big = max(range(len(groups)), key=lambda i: len(groups[i]))
        if len(groups[big]) < 2:
            raise ValueError(
                f"cannot make {count} micro-batches from {sum(map(len, groups))} rows; give "
                "every rank at least as many rows as the rank with the most micro-batches"
            )
        half = len(groups[big]) // 2
        groups[big : big + 1] = [groups[big][:half], groups[big][half:]]
    return groups


def trim(batch: Batch) -> Batch:
    """``batch`` without the prompt columns that are left padding in every row and the
    response columns that are right padding in every row (at least one of each kept).
    Outputs on the trimmed batch are [B, R'] with R' <= R: zero-pad them back to R."""
    r = batch["responses"].shape[1]
    p = batch["input_ids"].shape[1] - r
    prompt, response = lengths(batch)
    keep_p, keep_r = max(1, int(prompt.max(initial=0))), max(1, int(response.max(initial=0)))
    if (keep_p, keep_r) == (p, r):
        return batch
    columns = {}
    for name, x in batch.tensors.items():
        if name in SEQUENCE_COLUMNS:
            columns[name] = x[:, p - keep_p : p + keep_r]
        elif name == "prompts":
            columns[name] = x[:, p - keep_p :]
        elif x.ndim >= 2 and x.shape[1] == r:
            columns[name] = x[:, :keep_r]
    return batch.with_columns(columns)


def scatter(
    parts: list[tuple[np.ndarray, dict[str, np.ndarray]]], batch_size: int, response_len: int
) -> dict[str, np.ndarray]:
    """Each micro-batch's outputs, ``(row indices, {name: [rows, R'] or [rows]})``, put
    back at their rows of zero-filled [B, R] / [B] arrays. Rows past ``len(indices)``
    and columns past R are padding (dropped); columns a trimmed micro-batch lacks stay 0."""
    out: dict[str, np.ndarray] = {}
    for idx, values in parts:
        for name, value in values.items():
            value = np.asarray(value, np.float32)[: len(idx)]
            full = out.setdefault(
                name, np.zeros((batch_size, response_len)[: value.ndim], np.float32)
            )
            if value.ndim == 2:
                value = value[:, :response_len]
                full[idx, : value.shape[1]] = value
            else:
                full[idx] = value
    return out
