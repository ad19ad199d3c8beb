"""Agents written against the ``openai`` client, registered by name like environments.

An agent is an ``async def agent(row, client) -> float``: it plays one episode of a
dataset row with ``client``, an ``openai.AsyncOpenAI`` pointed at polyrl's endpoint on
the rollout servers (``polyrl.rollout.openai_endpoint``), and returns the episode's
reward. Its model calls are recorded with their exact token ids and trained like an
environment's episode (docs/agents.md "Agents written against the OpenAI client")::

    @register_agent("my/agent")
    async def my_agent(row, client):
        reply = await client.chat.completions.create(model="policy", messages=row["prompt"])
        return float(reply.choices[0].message.content == row["ground_truth"])

Rows whose ``data_source`` names an agent are played by it in a run with
``polyrl.RunConfig.episodes``; a module given to ``--import`` registers its own. Agents
run in the driver's event loop (the endpoint's), not in env workers.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from polyrl.config import did_you_mean
from polyrl.data.schema import ENV_SOURCES

__all__ = ["AGENTS", "Agent", "get_agent", "register_agent"]

Agent = Callable[[Mapping[str, Any], Any], Awaitable[float]]
AGENTS: dict[str, Agent] = {}


def register_agent(data_source: str) -> Callable[[Agent], Agent]:
    """Decorator: rows whose ``data_source`` is ``data_source`` are played by the
    ``async def agent(row, client) -> reward`` function."""

    def deco(fn: Agent) -> Agent:
        if not inspect.iscoroutinefunction(fn):
            raise TypeError(
                f"agent {getattr(fn, '__qualname__', fn)!r} for data_source {data_source!r} "
                f"must be an `async def agent(row, client) -> reward` (it gets an "
                f"openai.AsyncOpenAI client)"
            )
        from polyrl.envs.base import ENVS

        old = AGENTS.get(data_source)
        if (old is not None and old is not fn) or data_source in ENVS:
            other = old if old is not None else ENVS[data_source]
            raise ValueError(
                f"data_source {data_source!r} already has an "
                f"{'agent' if old is not None else 'environment'} "
                f"({other.__module__}.{other.__qualname__})"
            )
        AGENTS[data_source] = fn
        ENV_SOURCES.add(data_source)  # its rows pass the dataset checks without a reward
        return fn

    return deco


def get_agent(data_source: str) -> Agent:
    try:
        return AGENTS[data_source]
    except KeyError:
        raise ValueError(
            f"no agent for data_source {data_source!r}; registered agents: {sorted(AGENTS)}"
            f"{did_you_mean(data_source, AGENTS)}. Register one with "
            f"@polyrl.envs.register_agent({data_source!r}) in a module given to --import"
        ) from None
