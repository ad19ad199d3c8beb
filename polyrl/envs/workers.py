"""Env workers: the environments of many episodes at once, in light Ray actors.

:class:`EnvPool` starts ``EpisodeConfig.env_workers`` :class:`EnvWorker` actors
(a ``polyrl.cluster.groups.WorkerGroup``), each holding the env registry (``polyrl.envs.ENVS``) as the
driver had it (the classes travel by pickle, so an env registered by an ``--import``
module or a test plays the same in the workers; each is unpickled when an episode first
needs it, so one a worker cannot import fails only its episodes). Episode ``key`` lives on worker
``key % workers`` from its reset to its end; a worker runs the calls of all its
episodes concurrently (asyncio: ``async def`` methods are awaited, plain ones run in
threads).

Nothing an env does stops the run: each call is checked and bounded by
``EpisodeConfig.env_timeout_s``, and a call that raises, returns something malformed or
runs too long ends its episode with ``env_error`` / ``env_timeout`` and the reason in
``detail``. A worker that dies ends the episodes it hosted (``env_worker_died``); Ray
restarts it for the next step's episodes.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import numbers
import pickle
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from polyrl.cluster.groups import Collect, Dispatch, WorkerGroup, register
from polyrl.cluster.placement import Placement
from polyrl.envs.base import ENVS, Env, StepResult, Turn
from polyrl.observe.debug import setup_worker

__all__ = ["EnvPool", "EnvWorker"]

# Seconds a worker's whole call may take beyond the per-env timeout before the driver
# gives up on it (its event loop is stuck, e.g. an env that holds the GIL).
GRACE_S = 30.0


def _failure(reason: str, detail: str) -> dict[str, Any]:
    return {"error": reason, "detail": detail}


def _worker_failure(worker: int, error: Exception) -> dict[str, Any]:
    """The result of every call of env worker ``worker`` that timed out or died."""
    if isinstance(error, TimeoutError):  # (Ray's GetTimeoutError is one too)
        return _failure("env_timeout", f"env worker {worker} did not answer")
    why = f"{type(error).__name__}: {str(error).splitlines()[0]}"
    return _failure("env_worker_died", f"env worker {worker} died: {why}")


def _check_messages(value: Any, what: str) -> list[dict[str, Any]]:
    ok = isinstance(value, list) and all(
        isinstance(m, Mapping)
        and isinstance(m.get("role"), str)
        and isinstance(m.get("content"), str)
        for m in value
    )
    if not ok:
        raise TypeError(
            f"{what} must be a list of messages {{'role': str, 'content': str}}, got {value!r:.200}"
        )
    return [dict(m) for m in value]


def _check_step(value: Any) -> dict[str, Any]:
    if not isinstance(value, StepResult):
        raise TypeError(f"step returned {type(value).__name__}, not polyrl.envs.StepResult")
    reward = value.reward
    if not isinstance(reward, numbers.Real) or not math.isfinite(float(reward)):
        raise TypeError(f"StepResult.reward={reward!r} is not one finite number")
    info = {str(k): float(v) for k, v in dict(value.info).items()}
    return {
        "observation": _check_messages(list(value.observation), "StepResult.observation"),
        "reward": float(reward),
        "done": bool(value.done),
        "info": info,
    }


class EnvWorker:
    """One Ray actor hosting the envs of its episodes (module docstring)."""

    def __init__(
        self, envs: Mapping[str, Callable[[], Env] | bytes], timeout_s: float, rank: int = 0
    ):
        setup_worker("env", rank)  # --debug: breakpoint() in an env's step pauses here
        self.envs, self.timeout_s = dict(envs), timeout_s
        self.live: dict[int, Env] = {}

    async def _call(self, fn: Callable, *args: Any) -> Any:
        run = fn(*args) if inspect.iscoroutinefunction(fn) else asyncio.to_thread(fn, *args)
        return await asyncio.wait_for(run, self.timeout_s)

    async def _guarded(self, key: int, what: str, work: Any) -> dict[str, Any]:
        try:
            return await work
        except TimeoutError:
            self.live.pop(key, None)
            return _failure("env_timeout", f"{what} ran past {self.timeout_s:g} s")
        except Exception as e:
            self.live.pop(key, None)
            return _failure("env_error", f"{what} raised {type(e).__name__}: {e}")

    async def _reset(self, key: int, source: str, row: Mapping[str, Any]) -> dict[str, Any]:
        factory = self.envs[source]
        if isinstance(factory, bytes):  # unpickled here: one that cannot be fails alone
            factory = self.envs[source] = pickle.loads(factory)
        env = factory()
        messages = _check_messages(await self._call(env.reset, row), "reset's messages")
        self.live[key] = env
        return {
            "messages": messages,
            "tools": [tool.schema() for tool in env.tools] or None,
            "tool_parser": env.tool_parser,
        }

    async def _step(self, key: int, turn: Turn) -> dict[str, Any]:
        env = self.live.get(key)
        if env is None:
            raise KeyError(f"episode {key} has no env on this worker (restarted?)")
        out = _check_step(await self._call(env.step, turn))
        if out["done"]:
            self.live.pop(key, None)
        return out

    @register(Dispatch.BY_KEY, Collect.CONCAT)
    async def reset(self, items: Sequence[tuple[int, str, Mapping[str, Any]]]) -> list[dict]:
        """``(key, data_source, row)`` -> the first messages, tool schemas and parser."""
        return list(
            await asyncio.gather(
                *(self._guarded(k, f"{s} reset", self._reset(k, s, r)) for k, s, r in items)
            )
        )

    @register(Dispatch.BY_KEY, Collect.CONCAT)
    async def step(self, items: Sequence[tuple[int, Turn]]) -> list[dict]:
        """``(key, turn)`` -> observation, reward, done, info (or error, detail)."""
        return list(
            await asyncio.gather(
                *(self._guarded(k, f"step {t.index}", self._step(k, t)) for k, t in items)
            )
        )

    @register(Dispatch.BY_KEY, Collect.ALL)
    def close(self, keys: Sequence[tuple[int]]) -> None:
        """Drop the envs of episodes that ended for a reason of the driver's (a limit)."""
        for (key,) in keys:
            self.live.pop(key, None)


class EnvPool:
    """``num_workers`` :class:`EnvWorker` actors (0: one worker object in the driver).
    :meth:`reset` and :meth:`close` take a list of items (one result per item, in order);
    :meth:`step_one` steps one episode's env.

    options: Ray actor options of each worker (default ``Placement.light_options``)."""

    def __init__(
        self,
        num_workers: int = 2,
        timeout_s: float = 30.0,
        options: Callable[[int], dict[str, Any]] = Placement.light_options,
    ):
        self.timeout_s = timeout_s
        self.envs = dict(ENVS)
        # Each env class travels pickled on its own and is loaded when an episode needs
        # it: an env a worker cannot import (registered in a test module or a notebook
        # the workers do not have) fails its own episodes, not the worker's start.
        shipped: dict[str, Any] = dict(self.envs)
        if num_workers:
            import ray

            shipped = {name: ray.cloudpickle.dumps(cls) for name, cls in self.envs.items()}
        self.group = WorkerGroup(
            "env",
            EnvWorker,
            (shipped, timeout_s),
            num_workers=num_workers,
            options=options,
            max_restarts=-1,
            timeout_s=timeout_s + GRACE_S,
        )

    @property
    def workers(self) -> list[Any]:
        return self.group.workers

    def reset(self, items: Sequence[tuple[int, str, Mapping[str, Any]]]) -> list[dict]:
        return self._run("reset", items)

    async def step_one(self, key: int, turn: Turn) -> dict:
        """:meth:`step` of one episode as a coroutine: each episode steps its env when
        its own turn is sampled (``polyrl.rollout.episodes``)."""
        if self.group.local is not None:
            return (await self.group.local.step([(key, turn)]))[0]
        import ray

        w = key % len(self.workers)
        ref = self.workers[w].step.remote([(key, turn)])
        try:
            return (
                await asyncio.wait_for(asyncio.wrap_future(ref.future()), self.timeout_s + GRACE_S)
            )[0]
        except (
            TimeoutError,
            ray.exceptions.RayActorError,
            ray.exceptions.ActorUnavailableError,
        ) as e:
            return _worker_failure(w, e)

    def close(self, keys: Sequence[int]) -> None:
        """Best effort: a worker that does not answer in time keeps them until it ends."""
        self.group.call("close", [(k,) for k in keys], on_error=lambda *_: None)

    def _run(self, method: str, items: Sequence[tuple]) -> list[dict]:
        def failed(rank: int, index: list[int], error: BaseException) -> list[dict]:
            import ray

            if isinstance(error, (TimeoutError, ray.exceptions.RayActorError)):
                return [_worker_failure(rank, error)] * len(index)
            raise error

        return self.group.call(method, list(items), on_error=failed)

    def shutdown(self) -> None:
        self.group.shutdown()
