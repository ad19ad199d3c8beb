"""A timeline of the run: each phase of each role as a span in a Chrome trace file.

``<run_dir>/timeline.json`` (Chrome's Trace Event Format, JSON array form) opens in
https://ui.perfetto.dev or chrome://tracing: one track per role (rollout, reward,
reference, actor, critic, driver) and one span per phase and step, with the step number in
its arguments. Each step's spans are appended as the step ends; the closing ``]`` is
written at the end of the run, and the viewers accept the file without it, so a stalled
or crashed run still shows where time went.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

__all__ = ["PHASE_ROLES", "Timeline"]

# Which role's workers run a phase of the RL loop (the driver runs the rest).
PHASE_ROLES = {
    "generate": "rollout",
    "reward": "reward",
    "dynamic_sampling": "rollout",
    "reference": "reference",
    "old_log_probs": "actor",
    "values": "critic",
    "update_actor": "actor",
    "update_critic": "critic",
    "sync_weights": "actor",
    "rollout_sleep": "rollout",
    "rollout_wake": "rollout",
    "data": "driver",
    "advantages": "driver",
}
TRACKS = ("rollout", "reward", "reference", "actor", "critic", "driver")


class Timeline:
    """Collects phase spans (``add``), appends them to the file (``flush``), and ends
    the array (``close``). A resumed run starts a new file."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.origin = time.perf_counter()
        self.events: list[dict] = [
            {"name": "thread_name", "ph": "M", "pid": 0, "tid": i, "args": {"name": role}}
            for i, role in enumerate(TRACKS)
        ]
        self.path.write_text("[\n")
        self.first = True

    def add(self, phase: str, start: float, seconds: float, step: int) -> None:
        """A span of ``phase`` that began at ``time.perf_counter()`` value ``start``."""
        role = PHASE_ROLES.get(phase, "driver")
        self.events.append(
            {
                "name": phase,
                "cat": role,
                "ph": "X",
                "pid": 0,
                "tid": TRACKS.index(role),
                "ts": round((start - self.origin) * 1e6),
                "dur": round(seconds * 1e6),
                "args": {"step": step},
            }
        )

    def flush(self) -> None:
        if not self.events:
            return
        lines = ",\n".join(json.dumps(e) for e in self.events)
        with self.path.open("a") as f:
            f.write(lines if self.first else ",\n" + lines)
        self.first, self.events = False, []

    def close(self) -> None:
        self.flush()
        with self.path.open("a") as f:
            f.write("\n]\n")
