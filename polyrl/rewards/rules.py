"""Rule-based rewards for the built-in tasks (``polyrl.data.tasks``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from polyrl.rewards.registry import register_reward


@register_reward("polyrl/addition")
def exact_match(
    response: str, ground_truth: str, extra_info: Mapping[str, Any] | None = None
) -> float:
    """1.0 if the response, stripped of surrounding whitespace, equals the ground truth."""
    return 1.0 if response.strip() == ground_truth.strip() else 0.0


# Credit for a wrong digit in a position: enough signal for a random policy to learn
# "answer with digits" first, then which digits.
WRONG_DIGIT_CREDIT = 0.25


@register_reward("polyrl/copy")
def positional_match(
    response: str, ground_truth: str, extra_info: Mapping[str, Any] | None = None
) -> float:
    """Per-position credit: 1 for the right character, 0.25 for a wrong digit, else 0.

    The sum is divided by ``max(len(ground_truth), len(response))``, so missing and extra
    characters count as misses and 1.0 needs the exact string and nothing after it.
    Whitespace around the response is ignored.
    """
    r, g = response.strip(), ground_truth.strip()
    if not g and not r:
        return 1.0
    credit = sum(1.0 if a == b else WRONG_DIGIT_CREDIT * a.isdigit() for a, b in zip(r, g))
    return credit / max(len(g), len(r))
