"""Evaluation statistics over ``n`` samples per prompt: mean@n and unbiased pass@k.

pass@k (Chen et al. 2021, "Evaluating Large Language Models Trained on Code", eq. 1):
the probability that at least one of ``k`` samples drawn without replacement from the
``n`` generated is correct, given ``c`` of the ``n`` are::

    pass@k = 1 - C(n - c, k) / C(n, k)          (1 when n - c < k)

computed as the product ``1 - prod_{i = n-c+1}^{n} (1 - k / i)`` (no huge binomials).
Shapes: ``correct`` is ``[P, n]`` (P prompts, n samples each).
"""

from __future__ import annotations

import numpy as np

__all__ = ["pass_at_k", "mean_pass_at_k", "pass_at_k_values"]


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one prompt with ``c`` correct samples out of ``n``."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def mean_pass_at_k(correct: np.ndarray, k: int) -> float:
    """pass@k averaged over prompts; ``correct`` is a ``[P, n]`` boolean array."""
    correct = np.asarray(correct, dtype=bool)
    n = correct.shape[1]
    return float(np.mean([pass_at_k(n, int(c), k) for c in correct.sum(axis=1)]))


def pass_at_k_values(n: int) -> list[int]:
    """The k reported for n samples: powers of two below n, and n itself."""
    return sorted({2**i for i in range(n.bit_length()) if 2**i < n} | {n})
