"""An own task and its reward, loaded with ``--import min_digit`` (docs/rewards.md).

Task "min": the prompt is ``min 374`` and the answer is the smallest digit, ``3``. Every
character is in the tiny tokenizer's alphabet (digits, ``m``, ``i``, ``n``, space).

    cd experiments/own_task
    polyrl train --import min_digit --gin_file gin/experiments/tiny_grpo.gin \
        --gin_param 'polyrl.RunConfig.task = "min"'
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

from polyrl.data.tasks import register_task
from polyrl.rewards import register_reward


def make_min(rng: random.Random) -> tuple[str, str]:
    """(user text, ground truth): three random digits and the smallest of them."""
    digits = "".join(rng.choice("0123456789") for _ in range(3))
    return f"min {digits}", min(digits)


register_task("min", "my/min_digit", make_min, "smallest of three digits")


@register_reward("my/min_digit")
def min_digit_reward(
    response: str, ground_truth: str, extra_info: Mapping[str, Any] | None = None
) -> float:
    """1 for exactly the right digit; 0.2 for any other answer that starts with a digit
    (a first signal for a random policy); else 0."""
    answer = response.strip()
    if answer == ground_truth:
        return 1.0
    return 0.2 if answer[:1].isdigit() else 0.0
