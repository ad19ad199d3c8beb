"""Light workers: Ray actors with no device that run user code beside the roles.

Reward workers (``polyrl.rewards.workers``) and env workers (``polyrl.envs.workers``)
are both a :class:`LightWorkers`: ``num_workers`` actors of one class, started with no
CPU reserved (their work is light, and the logical CPUs belong to the roles and to user
tasks), each given its rank, ended together. With ``num_workers=0`` there are none:
the owner then does the work in the driver (a unit test, a notebook). How work is split
is the owner's choice: :meth:`shards` cuts a list into contiguous shards, one per worker.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

__all__ = ["LightWorkers"]


class LightWorkers:
    """``num_workers`` Ray actors of ``cls``, made as ``cls(*args, rank)``.

    options: Ray actor options of worker ``rank`` (default: no CPU reserved).
    env: environment variables of every worker. max_restarts: Ray restarts a dead
    worker this often (its state is lost; the caller decides what that ends).
    """

    def __init__(
        self,
        cls: type,
        args: tuple = (),
        num_workers: int = 2,
        options: Callable[[int], dict[str, Any]] | None = None,
        env: Mapping[str, str] | None = None,
        max_restarts: int = 0,
    ):
        self.workers: list[Any] = []
        if num_workers:
            import ray

            remote = ray.remote(cls)
            for rank in range(num_workers):
                opts = options(rank) if options else {"num_cpus": 0}
                self.workers.append(
                    remote.options(
                        **opts,
                        max_restarts=max_restarts,
                        runtime_env={"env_vars": dict(env or {})},
                    ).remote(*args, rank)
                )

    def __len__(self) -> int:
        return max(len(self.workers), 1)

    def shards(self, n: int) -> list[np.ndarray]:
        """Indices ``0..n-1`` cut into one contiguous non-empty shard per worker."""
        return [s for s in np.array_split(np.arange(n), len(self)) if len(s)]

    def shutdown(self) -> None:
        from polyrl.ray_session import end_actors

        end_actors(self.workers)
        self.workers = []
