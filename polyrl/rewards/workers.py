"""Reward workers: the rule rewards of a batch, scored in parallel in Ray actors.

:class:`RewardPool` starts ``RunConfig.reward_workers`` :class:`RewardWorker` actors, each
holding the reward registry (``polyrl.rewards.REWARDS``) as the driver had it when the
pool started: the functions travel by pickle, so a reward registered by a user module
(``--import``), by a test or by a notebook cell scores the same in the workers. A batch is
split into one contiguous shard per worker; the results come back in order.

Every call is checked (:func:`check_reward`): a reward must be a finite int or float (a
bool, NaN, inf, a string, None or a list is an error), and each call must return within
``timeout_s``. A failure raises :class:`RewardError` naming the data_source, the sample's
index and response text, and the returned value — a reward function that mis-parses the
response stops the run at the first bad sample instead of training on garbage.
"""

from __future__ import annotations

import math
import numbers
import signal
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from polyrl.cluster.groups import Collect, Dispatch, WorkerGroup, register
from polyrl.cluster.placement import Placement
from polyrl.observe.debug import place, setup_worker
from polyrl.observe.timeline import Traced
from polyrl.rewards.registry import REWARDS, RewardFn

__all__ = ["RewardError", "RewardPool", "RewardWorker", "check_reward", "score_items"]

# One sample to score: (index in the batch, response text, ground truth, data_source, extra_info)
Item = tuple[int, str, str, str, Any]


class RewardError(ValueError):
    """A reward function returned something other than one finite number, raised, or
    ran past the timeout; the message names the data_source, the sample and the value."""


def _where(item: Item) -> str:
    index, text, _, source, _ = item
    shown = text if len(text) <= 200 else text[:200] + "..."
    return f"data_source {source!r}, sample {index} (response {shown!r})"


def _fn_name(source: str) -> str:
    fn = REWARDS.get(source)
    return f"{fn.__module__}.{fn.__qualname__}" if fn else "the reward function"


def check_reward(value: Any, item: Item) -> float:
    """``value`` as a float if it is one finite real number, else :class:`RewardError`."""
    ok = isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))
    if not ok or not math.isfinite(float(value)):
        why = "is not finite" if ok else f"is a {type(value).__name__}, not a float"
        raise RewardError(
            f"reward for {_where(item)} returned {value!r}, which {why}; "
            f"{_fn_name(item[3])} must return one finite float per response (0.0 for a "
            f"response it cannot parse)"
        )
    return float(value)


class _Timeout(Exception):
    pass


def _call(fn: RewardFn, item: Item, timeout_s: float | None) -> Any:
    """``fn(text, ground_truth, extra_info)``, interrupted after ``timeout_s`` when this
    is the main thread (Ray runs a synchronous actor's methods there)."""
    _, text, truth, _, extra = item
    if not timeout_s or threading.current_thread() is not threading.main_thread():
        return fn(text, truth, extra)

    def alarm(signum: int, frame: Any) -> None:
        raise _Timeout

    old = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, timeout_s)
    try:
        return fn(text, truth, extra)
    except _Timeout:
        raise RewardError(
            f"reward for {_where(item)} did not return within {timeout_s:g} s "
            f"(RunConfig.reward_timeout_s)"
        ) from None
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def score_items(
    fns: Mapping[str, RewardFn], items: Sequence[Item], timeout_s: float | None = None
) -> list[float]:
    """Score ``items`` with the function of each one's data_source, checked."""
    out = []
    for item in items:
        fn = fns.get(item[3])
        if fn is None:
            raise RewardError(
                f"no reward function for {_where(item)}; registered sources: {sorted(fns)}. "
                f"Register one with @polyrl.rewards.register_reward({item[3]!r}) in a module "
                f"passed to --import"
            )
        try:
            value = _call(fn, item, timeout_s)
        except RewardError:
            raise
        except Exception as e:
            raise RewardError(
                f"reward for {_where(item)} raised {type(e).__name__}: {e}; fix "
                f"{_fn_name(item[3])}: it must return a float for any response (0.0 for one "
                f"it cannot parse)"
            ) from e
        out.append(check_reward(value, item))
    return out


class RewardWorker(Traced):
    """One Ray actor scoring shards of a batch with a copy of the driver's registry."""

    def __init__(self, fns: Mapping[str, RewardFn], timeout_s: float | None, rank: int = 0):
        setup_worker("reward", rank)
        self.fns, self.timeout_s = dict(fns), timeout_s

    @register(Dispatch.SPLIT, Collect.CONCAT)
    @place("score")
    def score(self, items: Sequence[Item]) -> list[float]:
        return score_items(self.fns, items, self.timeout_s)


class RewardPool:
    """``num_workers`` reward actors (a ``polyrl.cluster.groups.WorkerGroup``; ``ray`` must be
    initialised). ``num_workers=0`` scores in the driver (no Ray), e.g. for a notebook or
    a unit test.

    options: Ray actor options of each worker (default ``Placement.light_options``: no
    CPU reserved — rule rewards are light, and the logical CPUs belong to the roles and
    to user tasks).
    """

    def __init__(
        self,
        num_workers: int = 2,
        timeout_s: float | None = 60.0,
        options: Callable[[int], dict[str, Any]] = Placement.light_options,
        env: Mapping[str, str] | None = None,
    ):
        self.timeout_s = timeout_s
        self.fns = dict(REWARDS)
        self.group = WorkerGroup(
            "reward_workers",
            RewardWorker,
            (self.fns, timeout_s),
            num_workers=num_workers,
            options=options,
            env=env,
        )

    @property
    def workers(self) -> list[Any]:
        return self.group.workers

    def score(
        self,
        texts: Sequence[str],
        truths: Sequence[str],
        sources: Sequence[str],
        extras: Sequence[Any],
    ) -> np.ndarray:
        """float32 rewards, one per response, in order; :class:`RewardError` on a bad one."""
        items: list[Item] = [
            (i, t, g, s, e) for i, (t, g, s, e) in enumerate(zip(texts, truths, sources, extras))
        ]
        if not items:
            return np.zeros(0, np.float32)
        try:
            scores = self.group.call("score", items)
        except Exception as e:  # a worker's RewardError arrives wrapped by Ray
            cause = getattr(e, "cause", None)
            if isinstance(cause, RewardError):
                raise RewardError(str(cause)) from None
            raise
        return np.asarray(scores, np.float32)

    def shutdown(self) -> None:
        self.group.shutdown()
