"""The environment interface of multi-turn episodes, and its registry.

An episode is the unit of rollout (docs/agents.md): an :class:`Env` is made for one
episode, reset from its dataset row (it returns the conversation's first messages), then
stepped with each of the model's turns until it says ``done`` or a limit of
:class:`EpisodeConfig` ends the episode. Each step returns the next observation (messages
appended to the conversation: ``user`` or ``tool`` messages), a reward for the turn and
``done``. ``reset`` and ``step`` may be plain or ``async def`` methods.

An Env class is registered under the ``data_source`` of the rows it plays::

    @register_env("my/game")
    class MyGame(Env):
        def reset(self, row): ...
        def step(self, turn): ...

In a run with ``polyrl.RunConfig.episodes`` set, every row's ``data_source`` names the
environment that plays it (as in a single-turn run it names the reward function); a user
module given to ``--import`` registers its own, in the driver and in every env worker.

Nothing here imports a framework: envs run in light Ray actors (``polyrl.envs.workers``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from polyrl.config import did_you_mean
from polyrl.data.schema import ENV_SOURCES
from polyrl.errors import raise_if_problems

__all__ = [
    "ENVS",
    "Env",
    "EpisodeConfig",
    "FINISH_REASONS",
    "StepResult",
    "ToolEnv",
    "Turn",
    "env_problems",
    "get_env",
    "register_env",
]

Message = dict[str, Any]

# Why an episode ended (meta ``finish_reason`` of its row; metrics ``episode/finish/<r>``).
FINISH_REASONS = (
    "done",  # the env said done
    "max_turns",  # EpisodeConfig.max_turns turns without done
    "max_tokens",  # the next turn or observation would pass EpisodeConfig.max_episode_tokens
    "max_tool_calls",  # the env reported more than EpisodeConfig.max_tool_calls tool calls
    "env_error",  # reset or step raised (the message goes to the episode's dump)
    "env_timeout",  # reset or step ran past EpisodeConfig.env_timeout_s
    "env_worker_died",  # the env worker hosting the episode died
    "template_error",  # the chat template cannot append the observation to the episode
    "agent_error",  # an OpenAI-client agent raised, returned no reward or never called
    "agent_timeout",  # an OpenAI-client agent ran past EpisodeConfig.agent_timeout_s
)


@dataclasses.dataclass(frozen=True)
class Turn:
    """One model turn, as the env sees it.

    text: the decoded turn, without special tokens (the end-of-turn token is not in it).
    token_ids: the ids the model sampled (ending with the end-of-turn id unless cut).
    index: 0 for the first turn.
    finish_reason: "stop" (the model ended its turn) or "length" (cut at
      ``SamplingSpec.max_tokens``).
    """

    text: str
    token_ids: tuple[int, ...]
    index: int
    finish_reason: str


@dataclasses.dataclass
class StepResult:
    """What an env returns from ``step``.

    observation: messages to append (``{"role": "user" | "tool", "content": str}``);
      empty when ``done``.
    reward: this turn's reward; it lands on the turn's last sampled token, and an
      episode's score (GRPO, RLOO) is the sum over its turns.
    done: the episode is over.
    info: numbers about the turn, summed per episode into the step's metrics; the names
      ``tool_calls``, ``tool_errors`` and ``tool_seconds`` feed the tool metrics, the
      limit ``EpisodeConfig.max_tool_calls`` and the health warnings.
    """

    observation: list[Message] = dataclasses.field(default_factory=list)
    reward: float = 0.0
    done: bool = False
    info: dict[str, float] = dataclasses.field(default_factory=dict)


class Env:
    """One episode's environment. Subclass it, set ``tools`` / ``tool_parser`` if the
    model may call tools, and implement :meth:`step` (and :meth:`reset` when the first
    messages are not the row's ``prompt``). Either may be ``async def``.

    tools: ``polyrl.envs.tools.Tool`` objects whose schemas go to the chat template
      (``apply_chat_template(tools=...)``) so the model sees them.
    tool_parser: the name of the parser that reads tool calls from a turn's text.
    """

    tools: Sequence[Any] = ()
    tool_parser: str | None = None

    def reset(self, row: Mapping[str, Any]) -> list[Message]:
        """The episode's first messages; ``row`` is the dataset row (``prompt``,
        ``ground_truth``, ``data_source``, ``extra_info``) plus ``sample`` (which of the
        prompt's ``SamplingSpec.n`` episodes this is)."""
        return [dict(m) for m in row["prompt"]]

    def step(self, turn: Turn) -> StepResult:
        raise NotImplementedError(f"{type(self).__name__}.step(turn) -> StepResult")


class ToolEnv(Env):
    """An env whose model may call ``tools``: a turn with calls (read by ``tool_parser``)
    gets each call's result back as a ``tool`` message, a malformed call or a failing
    tool as an error message (counted in ``info["tool_errors"]``, never raised); a turn
    without calls is the model's answer, scored by :meth:`answer`. Subclass it and set
    ``tools``, ``tool_parser`` and :meth:`answer` (and :meth:`reset`; :meth:`parse` for a
    call format no registered parser reads).

    max_concurrency: calls of one turn run at most this many at once
    (``polyrl.envs.tools.run_tool_calls``).
    """

    tool_parser: str | None = "hermes"
    max_concurrency: int = 4

    def step(self, turn: Turn) -> StepResult:
        from polyrl.envs.tools import run_tool_calls
        from polyrl.observe.debug import debugging

        parsed = self.parse(turn)
        if not parsed.calls and not parsed.errors:
            return self.answer(turn)
        tools = {tool.name: tool for tool in self.tools}
        results = run_tool_calls(  # under --debug a tool paused at a breakpoint is not cut
            parsed.calls, tools, max_concurrency=self.max_concurrency, timeouts=not debugging()
        )
        results += parsed.error_results()
        info = {
            "tool_calls": float(len(results)),
            "tool_errors": float(sum(r.error for r in results)),
            "tool_seconds": float(sum(r.seconds for r in results)),
        }
        return StepResult([r.message() for r in results], self.called(turn, results), info=info)

    def parse(self, turn: Turn) -> Any:
        """The turn's calls (a ``polyrl.envs.parsers.ParseResult``): ``tool_parser``'s
        reading of its text. Override it for a call format that needs the episode's state."""
        from polyrl.envs.parsers import parse_tool_calls

        return parse_tool_calls(turn.text, self.tool_parser or "hermes")

    def called(self, turn: Turn, results: Sequence[Any]) -> float:
        """The reward of a turn that called tools (``results``: its ToolResults); 0."""
        return 0.0

    def answer(self, turn: Turn) -> StepResult:
        """The step of a turn without tool calls: usually the final answer, scored."""
        raise NotImplementedError(f"{type(self).__name__}.answer(turn) -> StepResult")


ENVS: dict[str, Callable[[], Env]] = {}


def register_env(data_source: str) -> Callable[[type], type]:
    """Class decorator: rows whose ``data_source`` is ``data_source`` are played by a
    fresh instance of the class (made with no arguments), one per episode."""

    def deco(cls: type) -> type:
        old = ENVS.get(data_source)
        if old is not None and old is not cls:
            raise ValueError(
                f"env for data_source {data_source!r} is already registered "
                f"({old.__module__}.{old.__qualname__})"
            )
        ENVS[data_source] = cls
        ENV_SOURCES.add(data_source)  # its rows pass the dataset checks without a reward
        return cls

    return deco


def get_env(data_source: str) -> Callable[[], Env]:
    try:
        return ENVS[data_source]
    except KeyError:
        raise ValueError(
            f"no environment for data_source {data_source!r}; registered environments: "
            f"{sorted(ENVS)}{did_you_mean(data_source, ENVS)}. Register one with "
            f"@polyrl.envs.register_env({data_source!r}) in a module given to --import"
        ) from None


def env_problems(data_source: str) -> list[str]:
    """What is wrong with the env of ``data_source``: its tools' schemas
    (``polyrl.envs.tools.tool_problems``) and its tool-call parser's name."""
    from polyrl.envs.parsers import PARSERS
    from polyrl.envs.tools import tool_problems

    cls = get_env(data_source)
    who = f"env {data_source!r} ({getattr(cls, '__qualname__', cls)})"
    out = [f"{who}: {p}" for p in tool_problems(list(getattr(cls, "tools", ())))]
    parser = getattr(cls, "tool_parser", None)
    if getattr(cls, "tools", ()) and parser not in PARSERS:
        out.append(
            f"{who}: tool_parser={parser!r} is not a registered parser "
            f"({sorted(PARSERS)}{did_you_mean(parser, PARSERS)}); register one with "
            f"@polyrl.envs.parsers.register_parser"
        )
    return out


@dataclasses.dataclass(frozen=True)
class EpisodeConfig:
    """Multi-turn episodes (``polyrl.RunConfig.episodes = @polyrl.EpisodeConfig()``).

    max_turns: model turns per episode; an episode still going after them ends with
      ``max_turns``.
    max_episode_tokens: prompt + every turn + every observation, in tokens; a turn gets at
      most the tokens left (and ``SamplingSpec.max_tokens``), an observation that would
      pass it is not appended and the episode ends with ``max_tokens``. It is also the
      width of the batch's rows (prompt + response), at most ``RolloutConfig.max_model_len``.
    max_tool_calls: tool calls per episode (as the env reports them in
      ``StepResult.info["tool_calls"]``); more end it with ``max_tool_calls``.
    env_workers: Ray actors hosting the envs (0: in the driver, for tests and notebooks).
    env_timeout_s: each reset and step call; a call past it ends its episode with
      ``env_timeout`` (a synchronous step keeps its thread until it returns).
    check_drift: compare each episode's ids with a fresh application of the chat template
      to its whole conversation (docs/agents.md "Exact tokens"), as metrics and a warning.
    agent_timeout_s: a whole episode of an OpenAI-client agent (``polyrl.envs.agents``);
      one past it ends with ``agent_timeout``.
    """

    max_turns: int = 4
    max_episode_tokens: int = 256
    max_tool_calls: int = 8
    env_workers: int = 2
    env_timeout_s: float = 30.0
    check_drift: bool = True
    agent_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        rules = (
            ("max_turns", 1, ">= 1"),
            ("max_episode_tokens", 1, ">= 1"),
            ("max_tool_calls", 0, ">= 0"),
            ("env_workers", 0, ">= 0 (0: the envs run in the driver)"),
        )
        out = [
            f"EpisodeConfig.{field}={getattr(self, field)} must be {rule}"
            for field, least, rule in rules
            if getattr(self, field) < least
        ]
        out += [
            f"EpisodeConfig.{field}={getattr(self, field)} must be > 0"
            for field in ("env_timeout_s", "agent_timeout_s")
            if getattr(self, field) <= 0
        ]
        raise_if_problems(out)
