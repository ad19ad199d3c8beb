"""Rewards: rule-based scorers selected by a sample's ``data_source``.

``get_reward_fn(data_source)`` is looked up when a dataset is loaded (see
``polyrl.data.schema``), so an unknown source fails before any rollout, not mid-run.
"""

from polyrl.rewards import math_answers as _math  # noqa: F401  (GSM8K / MATH sources)
from polyrl.rewards import rules as _rules  # noqa: F401  (registers the built-in rules)
from polyrl.rewards.registry import REWARDS, RewardFn, get_reward_fn, register_reward

__all__ = ["REWARDS", "RewardFn", "get_reward_fn", "register_reward"]
