"""The reward registry: data_source -> scoring function."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["REWARDS", "RewardFn", "register_reward", "get_reward_fn"]

# (response text, ground truth, extra_info) -> score. The response is the decoded
# completion without the end-of-sequence token.
RewardFn = Callable[[str, str, Mapping[str, Any] | None], float]

REWARDS: dict[str, RewardFn] = {}


def register_reward(data_source: str) -> Callable[[RewardFn], RewardFn]:
    """Decorator: score samples whose ``data_source`` is ``data_source`` with the function."""

    def deco(fn: RewardFn) -> RewardFn:
        if data_source in REWARDS and REWARDS[data_source] is not fn:
            raise ValueError(
                f"reward for data_source {data_source!r} is already registered "
                f"({REWARDS[data_source].__module__}.{REWARDS[data_source].__name__})"
            )
        REWARDS[data_source] = fn
        return fn

    return deco


def get_reward_fn(data_source: str) -> RewardFn:
    try:
        return REWARDS[data_source]
    except KeyError:
        raise ValueError(
            f"no reward function for data_source {data_source!r}; registered sources: "
            f"{sorted(REWARDS)}. Register one with @polyrl.rewards.register_reward({data_source!r})"
        ) from None
