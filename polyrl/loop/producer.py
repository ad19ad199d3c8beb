"""The hand-off between the rollout side and the trainer, implemented once.

A :class:`Producer` is where a step's batch comes from. Its two work policies are its
subclasses: bounded staleness (:class:`polyrl.loop.async_rollout.Rollouts`: whole
batches generated up to ``max_staleness`` versions ahead, or in the step when it is 0)
and streaming (:class:`polyrl.loop.streaming.Stream`: groups in rounds, batched as they
finish, partial rollouts, multi-turn episodes). The hand-off itself is the same:

- a generator thread runs *units* of work (a batch, a round of requests, a wave of
  episode turns) while the trainer trains; :meth:`take` waits for the step's batch;
- :meth:`sync` pushes weight version ``v`` to the servers once no unit is in flight
  (or at once where the servers pause requests in flight while it lands,
  ``RolloutConfig.continue_in_place``); with a host copy of the weights (``snapshot``) a
  busy generator is handed the copy and pushes it itself before its next unit, so the
  trainer does not wait;
- :meth:`exclusive` runs the trainer's own generation (DAPO's refills) with no unit in
  flight.

A waiting push either goes before new work (streaming: it waits for one round at most)
or lets the generator first start the unit the servers' version may sample
(``push_first = False``, bounded staleness: this pins ``max_staleness = 1`` to verl's
one-step-off schedule, whatever the timing). Every wait is on one condition variable
(threads) or an asyncio event the condition's notifications set (the stream's episode
turns): nothing polls.
"""

from __future__ import annotations

import abc
import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from polyrl.batch import Batch

__all__ = ["Producer"]

Push = Callable[[], dict[str, float]]


class Producer(abc.ABC):
    """The trainer-side interface (:meth:`take`, :meth:`sync`, :meth:`exclusive`,
    :meth:`discard`, :meth:`save`, :meth:`load`) and the generator's hand-off loop
    (:meth:`_next_unit`). A subclass says what a unit is (:meth:`_produce`), when one may
    start (:meth:`_admit`) and how a step's batch is made (:meth:`take`).

    ``async/`` metrics (since the last :meth:`sync`): ``generate_s`` (the units' wall
    time), the units run (``STATS[1]``), ``gen_idle_s`` (the generator waited for the
    bound or a push), ``wait_s`` (the trainer waited for generation: for its batch or to
    push), ``pushed_ahead`` and ``push_ahead_s`` (copies the generator pushed, and the
    seconds it spent pushing them), and the subclass's own."""

    STATS: tuple[str, ...] = (
        *("generate_s", "units", "gen_idle_s", "wait_s", "pushed_ahead", "push_ahead_s"),
    )
    push_first = True  # a waiting push goes before new work
    thread_name = "polyrl-producer"

    def __init__(
        self,
        max_staleness: int,
        on_span: Callable[[str, float, float, int], None] | None = None,
        phase: Callable[[str], Any] = lambda name: contextlib.nullcontext(),
    ):
        self.limit, self.on_span = max_staleness, on_span
        self.phase = phase  # times the trainer's waits ("generate") and pushes
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._alive = False  # the generator's thread runs (it stops after a failure)
        self._error: BaseException | None = None  # the generator's, raised by take()
        self._version = 0  # the weight version the rollout servers hold
        self._busy = False  # the generator runs a unit (or pushes a copy handed to it)
        self._waiting = False  # the trainer waits to push or to run exclusive
        self._hold = False  # the trainer pushes or runs exclusive: no unit starts
        self._stop = False
        self._snapshot: tuple[Push, int] | None = None  # a copy for the generator to push
        self._stats = dict.fromkeys(self.STATS, 0.0)
        # (name, start, s, step) per unit ("generate_ahead") and pushed copy ("push_ahead")
        self._spans: list[tuple[str, float, float, int | None]] = []

    # ------------------------------------------------------------ what a subclass says
    @property
    def synchronous(self) -> bool:
        """No generator: the step generates its own batch (:meth:`take`)."""
        return False

    @property
    def in_place(self) -> bool:
        """The servers pause the requests in flight while a push lands."""
        return False

    @abc.abstractmethod
    def _produce(self) -> None:
        """The generator's thread: ``while self._next_unit(): <run one unit>``."""

    @abc.abstractmethod
    def _admit(self) -> bool:
        """(lock held) Whether a unit may start now (admitting its work)."""

    def _done(self) -> bool:
        """(lock held) Nothing is left to generate: the generator ends."""
        return False

    def _startable(self) -> bool:
        """(lock held) With ``push_first = False``: the generator may start a unit under
        the servers' version now (a push waits for it even if its thread has not woken)."""
        return False

    def _gauges(self) -> dict[str, float]:
        """(lock held) ``async/`` values of the moment, reported beside the stats."""
        return {}

    # ------------------------------------------------------------ trainer side
    @abc.abstractmethod
    def take(self, step: int) -> tuple[Batch, dict[str, float]]:
        """Step ``step``'s batch (waiting for it) and its ``rollout/`` and ``async/``
        metrics."""

    def save(self, path: Path) -> None:  # noqa: B027 (optional: nothing to keep by default)
        """Write what a checkpoint keeps of the producer under ``path`` (nothing here)."""

    @abc.abstractmethod
    def load(self, path: Path | None, step: int) -> None:
        """Start (again) at step ``step`` from checkpoint ``path``, the servers holding
        weight version ``step``."""

    def _start(self) -> None:
        """(lock held) Start the generator's thread, once."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=self.thread_name, daemon=True)
            self._alive = True
            self._thread.start()

    def _wait(self, ready: Callable[[], bool]) -> None:
        """(lock held) Wait until ``ready()`` or the generator failed (``async/wait_s``)."""
        t0 = time.perf_counter()
        while not ready() and self._error is None:
            self._cond.wait()
        self._stats["wait_s"] += time.perf_counter() - t0

    def sync(
        self,
        push: Push,
        version: int,
        required: bool = False,
        snapshot: Callable[[], Push] | None = None,
    ) -> dict[str, float]:
        """Push weight ``version`` to the servers with ``push()`` once no unit is in
        flight (module docstring). With ``snapshot`` (``snapshot()`` copies the weights
        now and returns a push of that copy) a busy generator does not make the trainer
        wait: the copy is taken (phase "snapshot_weights"; ``async/sync_deferred`` = 1)
        and the generator pushes it before its next unit; ``required`` (e.g. before a
        validation) pushes now regardless. Returns ``push``'s metrics and the ``async/``
        metrics since the last call."""
        if self.synchronous:
            with self.phase("sync_weights"):
                return push()
        with self._cond:
            self._snapshot = None
            if snapshot is not None and not required and self._defers():
                with self.phase("snapshot_weights"):
                    self._snapshot = (snapshot(), version)
                self._notify()
                return {"async/sync_deferred": 1.0} | self._report()
            with self.phase("generate"):
                in_flight = self._hold_off(self.in_place, timed=True)
            try:
                with self._unlocked(), self.phase("sync_weights"):
                    out = push()
            finally:
                self._hold = False
                self._notify()
            self._version = version
            if self.in_place:
                self._stats["pushed_in_flight"] += float(in_flight)
            return out | {"async/sync_deferred": 0.0} | self._report()

    def _defers(self) -> bool:
        """(lock held) A push now would wait for the generator: a copy goes to it instead."""
        return (self._busy and not self.in_place) or self._startable()

    def _hold_off(self, in_place: bool, timed: bool) -> bool:
        """(lock held) Wait until no unit is in flight (but one the servers pause, with
        ``in_place``) nor, with ``push_first = False``, startable; then hold the
        generator off (``_hold``). Returns whether a unit is in flight (paused)."""
        self._waiting = True
        self._notify()
        t0 = time.perf_counter()
        while (self._busy and not in_place) or self._startable():
            self._cond.wait()
        if timed:
            self._stats["wait_s"] += time.perf_counter() - t0
        self._waiting, self._hold = False, True
        return self._busy

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        """No unit of the generator runs while the body does (e.g. a refill generated
        by the trainer's thread)."""
        if self.synchronous:
            yield
            return
        with self._cond:
            self._hold_off(in_place=False, timed=False)
        try:
            yield
        finally:
            with self._cond:
                self._hold = False
                self._notify()

    def _report(self) -> dict[str, float]:
        """The ``async/`` metrics since the last call; the units as ``generate_ahead``
        spans and the pushed copies as ``push_ahead`` spans to ``on_span`` (the timeline;
        a unit without a step is labelled with the step the servers' weights train next,
        a copy with the step whose weights it holds), from the trainer's thread."""
        with self._cond:  # (re-entrant)
            out = {f"async/{k}": v for k, v in self._stats.items()} | self._gauges()
            self._stats = dict.fromkeys(self._stats, 0.0)
            spans, self._spans = self._spans, []
            version = self._version
        for name, start, seconds, step in spans if self.on_span else ():
            self.on_span(name, start, seconds, version + 1 if step is None else step)
        return out

    def discard(self) -> None:
        """Stop the generator (a unit in flight finishes on its own, in its daemon thread)."""
        with self._cond:
            self._stop, self._alive = True, False
            self._notify()

    # ------------------------------------------------------------ the generator
    def _run(self) -> None:
        try:
            self._produce()
        except BaseException as e:  # re-raised by take() in the trainer
            with self._cond:
                self._error, self._busy = e, False
        finally:
            with self._cond:
                self._alive = False
                self._notify()

    def _held(self) -> bool:
        """(lock held) The trainer holds the generator off (its push, or its exclusive)."""
        return self._hold or (self._waiting and self.push_first)

    def _next_unit(self) -> bool:
        """Wait until a unit may start (pushing a copy handed to the generator first);
        True with ``_busy`` set, False once the generator stops or is done."""
        with self._cond:
            t0, pushing = time.perf_counter(), 0.0
            try:
                while not self._stop and not self._done():
                    if self._snapshot is not None and not self._held():
                        pushing += self._push_copy()
                    elif not self._held() and self._admit():
                        self._busy = True
                        return True
                    else:
                        self._cond.wait()
                return False
            finally:
                self._stats["gen_idle_s"] += time.perf_counter() - t0 - pushing

    def _push_copy(self) -> float:
        """(lock held) Push the copy the trainer handed over, as a unit of its own (a
        ``push_ahead`` span); its seconds."""
        (push, version), self._snapshot = self._snapshot, None
        self._busy = True
        t0 = time.perf_counter()
        try:
            with self._unlocked():
                push()
        finally:
            self._busy = False
            self._notify()
        seconds = time.perf_counter() - t0
        self._version = version
        self._spans.append(("push_ahead", t0, seconds, version))
        self._stats["pushed_ahead"] += 1
        self._stats["push_ahead_s"] += seconds
        return seconds

    def _finish_unit(self, t0: float, step: int | None = None) -> None:
        """(lock held) A unit that started at ``t0`` ended: timed, counted, a span (of
        ``step``, or the step the servers' weights train next when None)."""
        seconds = time.perf_counter() - t0
        self._spans.append(("generate_ahead", t0, seconds, step))
        self._stats["generate_s"] += seconds
        self._stats[self.STATS[1]] += 1
        self._busy = False
        self._notify()

    # ------------------------------------------------------------ the lock
    def _notify(self) -> None:
        """(lock held) Wake every waiter: the trainer, the generator (and its turns)."""
        self._cond.notify_all()

    @contextlib.contextmanager
    def _unlocked(self) -> Iterator[None]:
        """(lock held) The body runs with the lock released."""
        self._cond.release()
        try:
            yield
        finally:
            self._cond.acquire()
