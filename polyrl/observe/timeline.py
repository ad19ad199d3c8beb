"""A timeline of the run: each phase of the RL loop and each role worker's own calls, as
spans in a Chrome trace file.

``<run_dir>/timeline.json`` (Chrome's Trace Event Format, JSON array form) opens in
https://ui.perfetto.dev or chrome://tracing. Two kinds of tracks:

- ``driver phases`` (pid 0): one track per role (rollout, reward, reference, actor,
  critic, driver) and one span per phase and step, timed by the driver;
- one process per role (``actor workers``, ``rollout workers``, ...) with one thread per
  worker rank (``rank 0``, ``rank 1``, ...): a span for each role method call
  (``actor.forward``, ``actor.train_step``, ``rollout.generate``, ``reward.score``, ...)
  as timed inside that worker, with its step (as in the progress line; None for calls
  without a batch: ``generate``, ``score``) and rank in its arguments.

Workers record their calls in a small bounded buffer (``record``: a tuple appended, no
I/O); at each step's end the driver asks every worker for what it recorded since it last
asked, without waiting for a busy one (a rollout server generating ahead answers at the
next step). Each step's spans are appended as the step ends; the closing ``]`` is
written at the end of the run, and the viewers accept the file without it, so a stalled
or crashed run still shows where time went. Times are wall-clock, so spans of workers on
other nodes line up as well as the nodes' clocks do.
"""

from __future__ import annotations

import collections
import contextlib
import json
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from polyrl.role_table import Role

__all__ = ["PHASE_ROLES", "Timeline", "Traced", "record"]

# Which role's workers run a phase of the RL loop (the driver runs the rest).
PHASE_ROLES = {
    "generate": Role.ROLLOUT,
    "generate_ahead": Role.ROLLOUT,  # RunConfig.max_staleness >= 1: the background generation
    "push_ahead": Role.ROLLOUT,  # max_staleness >= 2: a host copy of the weights it pushed
    "reward": Role.REWARD,
    "dynamic_sampling": Role.ROLLOUT,
    "reference": Role.REFERENCE,
    "teacher_log_probs": Role.TEACHER,
    "old_log_probs": Role.ACTOR,
    "values": Role.CRITIC,
    "update_actor": Role.ACTOR,
    "update_critic": Role.CRITIC,
    "sync_weights": Role.ACTOR,
    "rollout_sleep": Role.ROLLOUT,
    "rollout_wake": Role.ROLLOUT,
    "data": "driver",
    "advantages": "driver",
}
# The driver's tracks: the roles that run a phase, in the role table's (data-flow) order.
TRACKS = (*(role for role in Role if role in PHASE_ROLES.values()), "driver")
# Worker processes in the trace: pid 1 + the role's index in the role table (others last).
WORKER_ROLES = tuple(Role)

# ---------------------------------------------------------------- in a worker process
# (method, wall-clock start, seconds, step) of each role method call since the driver
# last asked; bounded, so a run without a timeline (nobody asks) keeps only the last few.
_SPANS: collections.deque = collections.deque(maxlen=4096)


def record(method: str, start: float, seconds: float, step: int | None) -> None:
    """One call of a role method in this worker (``start``: ``time.time()``)."""
    _SPANS.append((method, start, seconds, step))


class Traced:
    """Base of the role worker classes: the driver's :class:`Timeline` asks for spans."""

    def spans(self) -> list[tuple[str, float, float, int | None]]:
        """The spans recorded since the last call (and forgets them)."""
        out = []
        while _SPANS:
            out.append(_SPANS.popleft())
        return out


# ---------------------------------------------------------------- in the driver
class Timeline:
    """Collects phase spans (``add``) and the workers' spans, appends them to the file
    (``flush``), and ends the array (``close``). A resumed run starts a new file.

    workers: () -> the run's role workers as ``(role, rank, Ray actor handle)``, asked at
      every flush (workers restarted during the run are picked up).
    """

    def __init__(
        self, path: str | Path, workers: Callable[[], Iterable[tuple[str, int, Any]]] = list
    ):
        self.path = Path(path)
        self.origin, self.wall_origin = time.perf_counter(), time.time()
        self.workers = workers
        self.pending: dict[tuple[str, int], Any] = {}  # (role, rank) -> spans() request
        self.named: set[tuple[str, int]] = set()
        self.events: list[dict] = [
            {"name": "process_name", "ph": "M", "pid": 0, "args": {"name": "driver phases"}}
        ] + [
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

    def _worker_spans(self, role: str, rank: int, spans: list) -> None:
        pid = 1 + (WORKER_ROLES.index(role) if role in WORKER_ROLES else len(WORKER_ROLES))
        if (role, rank) not in self.named:
            if not any(r == role for r, _ in self.named):
                name = {"name": f"{role} workers"}
                self.events.append({"name": "process_name", "ph": "M", "pid": pid, "args": name})
            self.named.add((role, rank))
            name = {"name": f"rank {rank}"}
            self.events.append(
                {"name": "thread_name", "ph": "M", "pid": pid, "tid": rank, "args": name}
            )
        for method, start, seconds, step in spans:
            self.events.append(
                {
                    "name": f"{role}.{method}",
                    "cat": "worker",
                    "ph": "X",
                    "pid": pid,
                    "tid": rank,
                    "ts": round((start - self.wall_origin) * 1e6),
                    "dur": round(seconds * 1e6),
                    # the batch's step counts from 0; the trace's (as the progress line) from 1
                    "args": {"step": None if step is None else step + 1, "rank": rank},
                }
            )

    def collect(self, wait_s: float = 0.0) -> None:
        """Ask each worker without a request in flight for its spans; take the answers
        that arrive within ``wait_s`` (0: only those already in; a busy worker answers
        at a later flush). A dead worker's spans are lost with it."""
        try:
            import ray

            for role, rank, handle in self.workers():
                if (role, rank) not in self.pending:
                    self.pending[(role, rank)] = handle.spans.remote()
            refs = list(self.pending.values())
            done = ray.wait(refs, num_returns=len(refs), timeout=wait_s)[0] if refs else []
        except Exception:  # Ray is down (the run is ending on an error): the driver's spans stay
            self.pending.clear()
            return
        for key, ref in list(self.pending.items()):
            if ref in done:
                del self.pending[key]
                with contextlib.suppress(ray.exceptions.RayError):
                    self._worker_spans(*key, ray.get(ref))

    def flush(self) -> None:
        self.collect()
        if not self.events:
            return
        lines = ",\n".join(json.dumps(e) for e in self.events)
        with self.path.open("a") as f:
            f.write(lines if self.first else ",\n" + lines)
        self.first, self.events = False, []

    def close(self) -> None:
        # The answers to the requests in flight, then the spans of the last step.
        self.collect(wait_s=1.0)
        self.collect(wait_s=1.0)
        self.flush()
        with self.path.open("a") as f:
            f.write("\n]\n")
