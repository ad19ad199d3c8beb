"""DAPO's data-side pieces (Yu et al. 2025, arXiv:2503.14476): dynamic sampling and
overlong reward shaping. The loss-side pieces (clip-higher, token-level loss) are
``ppo_policy_loss(clip_high > clip_low)`` and ``aggregate(mode="token-mean")``.

Shapes: ``[B]`` one value per sample. Host side; inputs may be numpy, torch or jax and
outputs are of the same kind.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from polyrl.algos.advantages import group_index
from polyrl.tensor import asarray_like, namespace, to_numpy

__all__ = ["dynamic_sampling_mask", "overlong_penalty"]

Array = Any


def dynamic_sampling_mask(scores: Array, group_ids: Any, keep_singletons: bool = True) -> Array:
    """Keep-mask [B] (bool, same kind as ``scores``) of DAPO's dynamic sampling.

    A group (samples with equal ``group_ids``) is dropped when all its ``scores`` [B] are
    equal (e.g. accuracy all 0 or all 1): its GRPO advantages are all 0, so it only dilutes
    the batch. Equality is exact (verl's recipe keeps a group iff ``std > 0``). Singleton
    groups are kept by default, as verl's recipe does (``std > 0 or len == 1``); pass
    ``keep_singletons=False`` to drop them. Indices: ``np.flatnonzero(to_numpy(mask))``.
    The trainer refills the batch with more generations until it holds enough groups.
    """
    s = to_numpy(scores)
    if s.ndim != 1:
        raise ValueError(f"dynamic_sampling_mask: scores must be [B], got shape {list(s.shape)}")
    ids = to_numpy(group_ids)
    if ids.shape != s.shape:
        raise ValueError(
            f"dynamic_sampling_mask: group_ids has shape {list(ids.shape)} but "
            f"scores has {list(s.shape)}; both must be [B]"
        )
    inverse, counts = group_index(ids)
    k = counts.size
    group_max = np.full(k, -np.inf)
    group_min = np.full(k, np.inf)
    np.maximum.at(group_max, inverse, s)
    np.minimum.at(group_min, inverse, s)
    varied = group_max > group_min
    if keep_singletons:
        varied |= counts == 1
    keep = varied[inverse]
    xp = namespace(scores) if hasattr(scores, "shape") else None
    return keep if xp is None else asarray_like(keep, scores, dtype=xp.bool)


def overlong_penalty(
    lengths: Array, max_len: int, buffer_len: int, penalty_factor: float = 1.0
) -> Array:
    """DAPO soft overlong punishment: a reward term [B] (<= 0) from response lengths [B].

    With ``L = lengths``, ``L_max = max_len``, ``L_c = buffer_len``, ``f = penalty_factor``::

        0                                  L <= L_max - L_c
        f * ((L_max - L_c) - L) / L_c      L_max - L_c < L <= L_max
        -f                                 L > L_max

    i.e. the penalty grows linearly from 0 to ``-f`` over the last ``L_c`` tokens. Equal
    to verl's reward manager (``min(-(L - (L_max - L_c)) / L_c * f, 0)``) for every
    ``L <= L_max``; verl does not cap beyond ``L_max`` (generation stops there), the paper
    does (``-1``), and so does this. Returned in ``lengths``' namespace; integer lengths
    become the framework's default float (numpy: float64, torch / jax: float32 unless
    64-bit is enabled).
    """
    if not 0 < buffer_len <= max_len:
        raise ValueError(
            f"overlong_penalty: need 0 < buffer_len <= max_len, got buffer_len="
            f"{buffer_len!r}, max_len={max_len!r}"
        )
    xp = namespace(lengths)
    length = lengths * 1.0  # int -> the framework's default float; floats keep their dtype
    expected = float(max_len - buffer_len)
    penalty = (expected - length) / float(buffer_len) * penalty_factor
    return xp.clip(penalty, -float(penalty_factor), 0.0)
