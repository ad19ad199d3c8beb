"""Multi-turn environments, tool calling and the Python sandbox (docs/agents.md).

- ``polyrl.envs.base``: the :class:`Env` interface, its registry and :class:`EpisodeConfig`.
- ``polyrl.envs.workers``: the Ray env workers that run envs, many episodes each.
- ``polyrl.envs.agents``: agents written against the ``openai`` client, registered by name.
- ``polyrl.envs.tasks``: the built-in multi-turn tasks.
- ``polyrl.envs.tools``: tools as JSON schemas, the registry, running a turn's calls with
  limits; the built-in ``calculator`` and ``python`` tools.
- ``polyrl.envs.parsers``: tool calls parsed out of a model turn, a parser per format.
- ``polyrl.envs.sandbox``: running code in a limited subprocess.

Importing this package imports no framework and no Ray.
"""

from polyrl.envs import tasks as _tasks  # noqa: F401  (registers the built-in envs)
from polyrl.envs.agents import AGENTS, register_agent
from polyrl.envs.base import (
    ENVS,
    FINISH_REASONS,
    Env,
    EpisodeConfig,
    StepResult,
    ToolEnv,
    Turn,
    env_problems,
    get_env,
    register_env,
)

__all__ = [
    "AGENTS",
    "ENVS",
    "FINISH_REASONS",
    "Env",
    "EpisodeConfig",
    "StepResult",
    "ToolEnv",
    "Turn",
    "env_problems",
    "get_env",
    "register_agent",
    "register_env",
]
