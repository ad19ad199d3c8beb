"""Run health: warnings that make a run that learns nothing visible in minutes.

:func:`watch_pending` reports Ray tasks and actors that wait for resources (a user's
verifier task on a cluster whose CPUs the pools hold), instead of a silent hang.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["watch_pending"]


def _demands(gcs_address: str) -> dict[str, int]:
    """Resource requests Ray cannot place right now: ``"{'CPU': 1.0}" -> count``."""
    from ray.autoscaler.v2.sdk import get_cluster_status

    status = get_cluster_status(gcs_address)
    out: dict[str, int] = {}
    for demand in status.resource_demands.ray_task_actor_demand:
        for req in demand.bundles_by_count:
            key = str(dict(sorted(req.bundle.items())))
            out[key] = out.get(key, 0) + req.count
    return out


def watch_pending(
    user_cpus: float,
    after_s: float = 60.0,
    every_s: float = 10.0,
    echo: Callable[[str], Any] = print,
) -> threading.Event:
    """Start a daemon thread that reports, once each, resource requests that have waited
    more than ``after_s`` seconds; set the returned event to stop it."""
    import ray

    gcs = ray.get_runtime_context().gcs_address
    stop = threading.Event()

    def loop() -> None:
        first_seen: dict[str, float] = {}
        reported: set[str] = set()
        while not stop.wait(every_s):
            try:
                now, pending = time.monotonic(), _demands(gcs)
            except Exception:  # the cluster is going away: nothing left to watch
                return
            first_seen = {k: first_seen.get(k, now) for k in pending}
            for key, since in first_seen.items():
                if now - since >= after_s and key not in reported:
                    reported.add(key)
                    echo(
                        f"[polyrl] WARNING: {pending[key]} Ray task(s)/actor(s) asking for {key} "
                        f"have waited {now - since:.0f} s and cannot be scheduled: Ray has "
                        f"{ray.available_resources()} free. polyrl's pools hold their CPUs; leave "
                        f"room with RunConfig.user_cpus (now {user_cpus:g}) or ask for fewer "
                        f"resources (num_cpus=0 for a light task)"
                    )

    threading.Thread(target=loop, name="polyrl-pending-watch", daemon=True).start()
    return stop
