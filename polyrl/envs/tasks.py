"""Built-in multi-turn tasks that the tiny CPU model learns (docs/agents.md).

* ``polyrl/guess`` (task ``guess``): the env holds a secret digit (the row's ground
  truth); each turn the model guesses, and the env answers ``+`` (the secret is larger),
  ``-`` (smaller) or ``try`` (no digit in the turn). A right guess at turn ``k`` (0-based)
  ends the episode with reward ``1 - 0.25 k``; a later wrong guess inside the range the
  hints so far allow earns 0.2 for its turn (a per-turn reward). Binary search always
  wins within four turns; a random policy rarely does.
  Only the tiny tokenizer's alphabet is used (docs/rewards.md).
"""

from __future__ import annotations

import random
import re
from collections.abc import Mapping
from typing import Any

from polyrl.data.tasks import register_task
from polyrl.envs.base import Env, StepResult, Turn, register_env

__all__ = ["GuessEnv"]

_DIGIT = re.compile(r"[0-9]")
FOLLOWED_HINTS = 0.2  # a later wrong guess inside the range the hints allow


def _guess_row(rng: random.Random) -> tuple[str, str]:
    return "secret", str(rng.randint(0, 9))


@register_env("polyrl/guess")
class GuessEnv(Env):
    """Guess the secret digit with higher/lower feedback (module docstring)."""

    def reset(self, row: Mapping[str, Any]) -> list[dict[str, Any]]:
        self.secret = int(row["ground_truth"])
        self.low, self.high = 0, 9  # what the hints so far allow
        return super().reset(row)

    def step(self, turn: Turn) -> StepResult:
        found = _DIGIT.search(turn.text)
        if found is None:
            return StepResult([{"role": "user", "content": "try"}])
        guess = int(found.group())
        if guess == self.secret:
            return StepResult(reward=max(0.0, 1.0 - 0.25 * turn.index), done=True)
        # A wrong guess that the hints so far allow earns a little: a per-turn reward.
        reward = FOLLOWED_HINTS if self.low <= guess <= self.high and turn.index else 0.0
        if self.secret > guess:
            self.low = max(self.low, guess + 1)
        else:
            self.high = min(self.high, guess - 1)
        hint = "+" if self.secret > guess else "-"
        return StepResult([{"role": "user", "content": hint}], reward=reward)


register_task("guess", "polyrl/guess", _guess_row, "guess a digit with +/- feedback (multi-turn)")
