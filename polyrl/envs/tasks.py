"""Built-in multi-turn tasks that the tiny CPU model learns (docs/agents.md).

* ``polyrl/guess`` (task ``guess``): the env holds a secret digit (the row's ground
  truth); each turn the model guesses, and the env answers ``+`` (the secret is larger),
  ``-`` (smaller) or ``try`` (no digit in the turn). A right guess at turn ``k`` (0-based)
  ends the episode with reward ``1 - 0.25 k``; a later wrong guess inside the range the
  hints so far allow earns 0.2 for its turn (a per-turn reward). Binary search always
  wins within four turns; a random policy rarely does.
* ``polyrl/calc`` (task ``calc``): "37*45" -- a product the tiny model cannot compute.
  A turn that is an arithmetic expression calls the ``calculator`` tool (the
  ``arithmetic`` tool-call parser: the tiny alphabet has no room for ``<tool_call>``
  JSON) and gets its result as a ``tool`` message; the episode's first call earns 0.3 x
  the share of the question's characters it copies in place. A turn without a call is
  the answer, scored by the share of its characters that are right (no credit for a
  wrong digit) and ending the episode: guessing digits earns about 0.1, the full answer
  needs the tool.

Only the tiny tokenizer's alphabet is used (docs/rewards.md).
"""

from __future__ import annotations

import random
import re
from collections.abc import Mapping
from typing import Any

from polyrl.data.tasks import register_task
from polyrl.envs.base import Env, StepResult, ToolEnv, Turn, register_env
from polyrl.envs.parsers import ParseResult, register_parser
from polyrl.envs.tools import CALCULATOR, ToolCall

__all__ = ["CalcEnv", "GuessEnv", "arithmetic_calls"]

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


# --- calc -------------------------------------------------------------------------------

_EXPRESSION = re.compile(r"^\s*([0-9][0-9 ]*(?:[-+*][0-9 ]+)+)$")
CALL_CREDIT = 0.3  # x the share of the question's characters the episode's first call copies


@register_parser("arithmetic")
def arithmetic_calls(text: str) -> ParseResult:
    """A turn that is an arithmetic expression ("37*45": digits joined by + - *) is one
    ``calculator`` call; any other turn has none."""
    found = _EXPRESSION.match(text)
    if found is None:
        return ParseResult(text.strip(), [], [])
    return ParseResult("", [ToolCall("calculator", {"expression": found.group(1)}, text)], [])


def _calc_row(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    return f"{a}*{b}", str(a * b)


@register_env("polyrl/calc")
class CalcEnv(ToolEnv):
    """A product, answered with the calculator's help (module docstring)."""

    tools = (CALCULATOR,)
    tool_parser = "arithmetic"

    def reset(self, row: Mapping[str, Any]) -> list[dict[str, Any]]:
        self.truth, self.question = str(row["ground_truth"]), row["prompt"][-1]["content"]
        self.calls = 0
        return super().reset(row)

    def called(self, turn: Turn, results: Any) -> float:
        self.calls += 1  # only the first call earns: calling again is no shortcut
        return CALL_CREDIT * _share_right(turn.text, self.question) if self.calls == 1 else 0.0

    def answer(self, turn: Turn) -> StepResult:
        return StepResult(reward=_share_right(turn.text, self.truth), done=True)


def _share_right(text: str, want: str) -> float:
    """The share of characters in place: ``text`` against ``want`` (the longer counts)."""
    text = text.strip()
    return sum(a == b for a, b in zip(text, want)) / max(len(text), len(want), 1)


register_task("calc", "polyrl/calc", _calc_row, "a 2-digit product via the calculator (tools)")
