"""An agent written against the ``openai`` client, trained by ``polyrl train --import
guess_agent`` (docs/agents.md "Agents written against the OpenAI client").

The agent plays the guessing game (task "guess_agent": the prompt is ``secret``, the
answer a digit) through ``client.chat.completions.create``, as it would against any
OpenAI-compatible server: it reads the first digit of each reply, answers ``+`` or
``-`` as a user message, and returns 1 for a right guess at the first call, 0.5 at the
second, else 0. polyrl runs it once per episode with a client pointed at the rollout
servers, records the token ids of every call and trains on them.

    cd experiments/own_agent
    polyrl train --import guess_agent --gin_file gin/experiments/tiny_multiturn.gin \
        --gin_param 'polyrl.RunConfig.task = "guess_agent"'
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

from polyrl.data.tasks import register_task
from polyrl.envs import register_agent

CALLS = 2  # model calls per episode at most
# What the agent saw of each call and the rewards it returned, in order (read by the tests)
REPLIES: list[dict[str, Any]] = []
REWARDS: list[float] = []


def make_secret(rng: random.Random) -> tuple[str, str]:
    return "secret", str(rng.randint(0, 9))


register_task("guess_agent", "my/guess_agent", make_secret, "guess a digit, as an OpenAI agent")


@register_agent("my/guess_agent")
async def guess_agent(row: Mapping[str, Any], client: Any) -> float:
    """One episode: at most two guesses, each answered with a +/- hint."""
    reward = await play(row, client)
    REWARDS.append(reward)
    return reward


async def play(row: Mapping[str, Any], client: Any) -> float:
    secret = int(row["ground_truth"])
    messages: list[Any] = list(row["prompt"])
    for k in range(CALLS):
        reply = await client.chat.completions.create(
            model="policy", messages=messages, max_tokens=3, logprobs=True
        )
        choice = reply.choices[0]
        REPLIES.append(
            {
                "content": choice.message.content,
                "tokens": reply.usage.completion_tokens,
                "logprobs": [t.logprob for t in choice.logprobs.content],
            }
        )
        digits = [c for c in choice.message.content or "" if c.isdigit()]
        if digits and int(digits[0]) == secret:
            return 1.0 / (k + 1)
        hint = "+" if digits and secret > int(digits[0]) else "-"
        messages += [choice.message, {"role": "user", "content": hint}]
    return 0.0
