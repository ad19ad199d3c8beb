"""The GSM8K env with every turn run as a Python program (experiments/bench/gsm8k_tool.py):
a random-weight model never writes a ``<tool_call>``, so this env times the multi-turn
path's full cost (a sandbox run, an observation and a continued prefix every turn).
Imported by the benchmark's run (``RunConfig.imports``) in the driver and every worker."""

from __future__ import annotations

from polyrl.envs import register_env
from polyrl.envs.parsers import ParseResult
from polyrl.envs.tasks import MathPythonEnv
from polyrl.envs.tools import ToolCall

EVERY_TURN = "bench/gsm8k_every_turn"


@register_env(EVERY_TURN)
class EveryTurnPython(MathPythonEnv):
    """The GSM8K env, with every turn a ``python`` call of the turn's text."""

    def parse(self, turn):
        return ParseResult("", [ToolCall("python", {"code": turn.text}, turn.text)], [])
