"""Built-in multi-turn tasks that the tiny CPU model learns (docs/agents.md).

* ``polyrl/guess`` (task ``guess``): the env holds a secret digit (the row's ground
  truth); each turn the model guesses, and the env answers ``+`` (the secret is larger),
  ``-`` (smaller) or ``try`` (no digit in the turn). A right guess at turn ``k`` (0-based)
  ends the episode with reward ``1 - 0.25 k``; a later wrong guess inside the range the
  hints so far allow earns 0.2 for its turn (a per-turn reward). Binary search always
  wins within four turns; a random policy rarely does.
* ``polyrl/calc`` (task ``calc``): "37*8-291" -- a product minus a number, whose value
  is one digit ("5"): the tiny model cannot compute it, a guess is right one time in ten.
  A turn that starts with ``=`` calls the ``calculator`` tool on the question (a pocket
  calculator's key: the tiny alphabet has no room for ``<tool_call>`` JSON, and a
  one-character call is one a random policy stumbles on); a turn that is an arithmetic
  expression calls it on that expression (the ``arithmetic`` parser). The result comes
  back as a ``tool`` message. A turn without a call is the answer and ends the episode:
  it scores the share of its characters that are right (no credit for a wrong digit),
  plus 0.2 when a call before it returned the answer (a call earns nothing by itself,
  so calling every turn earns nothing). Guessing digits earns about 0.1; the full
  answer needs the tool's result copied.

* ``openai/gsm8k`` (verl's GSM8K files, in a run with ``RunConfig.episodes``): the
  problem with the ``python`` tool (:class:`MathPythonEnv`), for a real chat model
  (gin/experiments/gsm8k_tool.gin); without episodes the rows are scored single-turn by
  the reward of that name as before.

The tiny tasks use only the tiny tokenizer's alphabet (docs/rewards.md).
"""

from __future__ import annotations

import random
import re
from collections.abc import Mapping
from typing import Any

from polyrl.data.tasks import register_task
from polyrl.envs.base import Env, StepResult, ToolEnv, Turn, register_env
from polyrl.envs.parsers import ParseResult, register_parser
from polyrl.envs.tools import CALCULATOR, PYTHON, ToolCall
from polyrl.rewards.math_answers import GSM8K_SOURCES

__all__ = ["CalcEnv", "GuessEnv", "MathPythonEnv", "arithmetic_calls"]

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
CALL_CREDIT = 0.2  # on the answer, when a call before it returned the answer


@register_parser("arithmetic")
def arithmetic_calls(text: str) -> ParseResult:
    """A turn that is an arithmetic expression ("37*8": digits joined by + - *) is one
    ``calculator`` call; any other turn has none."""
    found = _EXPRESSION.match(text)
    if found is None:
        return ParseResult(text.strip(), [], [])
    return ParseResult("", [ToolCall("calculator", {"expression": found.group(1)}, text)], [])


def _calc_row(rng: random.Random) -> tuple[str, str]:
    """``a*b-c`` whose value is one digit: "37*8-291" -> "5" (the tool's result is the
    answer itself, one token to copy)."""
    a, b, answer = rng.randint(10, 99), rng.randint(2, 9), rng.randint(0, 9)
    return f"{a}*{b}-{a * b - answer}", str(answer)


@register_env("polyrl/calc")
class CalcEnv(ToolEnv):
    """A product, answered with the calculator's help (module docstring)."""

    tools = (CALCULATOR,)
    tool_parser = "arithmetic"

    def reset(self, row: Mapping[str, Any]) -> list[dict[str, Any]]:
        self.truth, self.question = str(row["ground_truth"]), row["prompt"][-1]["content"]
        self.looked_up = False  # a call returned the answer
        return super().reset(row)

    def parse(self, turn: Turn) -> ParseResult:
        """A turn that starts with ``=`` calls the calculator on the question (the key
        of a pocket calculator); one that is an expression calls it on that expression."""
        if turn.text.lstrip().startswith("="):
            call = ToolCall("calculator", {"expression": self.question}, turn.text)
            return ParseResult("", [call], [])
        return super().parse(turn)

    def called(self, turn: Turn, results: Any) -> float:
        self.looked_up |= any(r.content == self.truth for r in results)
        return 0.0  # a call earns only through the answer: calling forever earns nothing

    def answer(self, turn: Turn) -> StepResult:
        credit = CALL_CREDIT if self.looked_up else 0.0
        return StepResult(reward=credit + _share_right(turn.text, self.truth), done=True)


def _share_right(text: str, want: str) -> float:
    """The share of characters in place: ``text`` against ``want`` (the longer counts)."""
    text = text.strip()
    return sum(a == b for a, b in zip(text, want)) / max(len(text), len(want), 1)


register_task("calc", "polyrl/calc", _calc_row, "a*b-c (one digit) via the calculator (tools)")


# --- GSM8K with the Python tool -----------------------------------------------------------

PYTHON_HINT = (
    "You may run Python to compute: call the python tool with a complete program that "
    "prints what you need, then give the final answer after ####."
)


class MathPythonEnv(ToolEnv):
    """GSM8K rows (verl's ``openai/gsm8k``) played with the ``python`` tool: a turn with
    ``<tool_call>`` calls (the ``hermes`` format of Qwen2.5's template) runs each program
    in the sandbox (``polyrl.envs.sandbox``) and returns its output as a ``tool``
    message; a turn without calls is the answer, scored by the ``openai/gsm8k`` reward
    (the number after ``####``, checked by math-verify) and ending the episode. A system
    message saying the tool is there goes first unless the row has its own.
    gin/experiments/gsm8k_tool.gin, docs/agents.md "GSM8K with the Python tool"."""

    tools = (PYTHON,)
    tool_parser = "hermes"

    def reset(self, row: Mapping[str, Any]) -> list[dict[str, Any]]:
        self.truth, self.extra = str(row["ground_truth"]), row.get("extra_info")
        messages = super().reset(row)
        if messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": PYTHON_HINT})
        return messages

    def answer(self, turn: Turn) -> StepResult:
        from polyrl.rewards.math_answers import gsm8k_reward

        return StepResult(reward=gsm8k_reward(turn.text, self.truth, self.extra), done=True)


for _source in GSM8K_SOURCES:
    register_env(_source)(MathPythonEnv)
