"""WorkerGroup: the one class that starts, places, calls and ends a set of Ray workers.

Every kind of worker of a run is a :class:`WorkerGroup`: a role's engine ranks
(``polyrl.cluster.workers.EngineGroup``), the rollout servers (``polyrl.rollout.pool``), the
reward workers (``polyrl.rewards.workers``) and the env workers (``polyrl.envs.workers``).
Those modules only add what their role needs (an engine group's rendezvous, the rollout
pool's retry and re-sync, ...); creation, placement, fan-out, timeouts, dead-worker
reports and restarts live here.

Creation: worker ``rank`` is ``cls(*args, rank)`` in a Ray actor whose options are
``options(rank)`` (resources and scheduling strategy from ``polyrl.cluster.placement``, maybe
the worker's own GPUs in ``runtime_env``), with a ``runtime_env`` that adds ``env`` and
the test-only fault hooks (``polyrl.faults``), and ``max_restarts`` (Ray restarts a
dead worker that often; its state is lost). ``num_workers=0`` makes one worker object
in this process instead (a unit test, a notebook): calls then run here, the same way.

Calls: each worker method declares how a call is spread over the ranks and how their
results come back (:func:`register`; an undeclared method goes to every rank with the
same arguments and returns every rank's result):

* dispatch ``ONE``: rank 0 only; ``ALL``: every rank, the same arguments; ``EACH``: the
  first argument holds one value per rank; ``SPLIT``: the first argument (a Batch, or a
  list) cut into contiguous shards, one per rank (a Batch into equal ones); ``BY_KEY``:
  the first argument is a list of items ``(key, ...)``, item to rank ``key % ranks``
  (an episode stays on its worker).
* collect ``FIRST``: rank 0's result; ``ALL``: every called rank's, in rank order;
  ``CONCAT``: the ranks' results joined back in the order of the input (lists, or dicts
  of arrays concatenated row-wise).

A worker that dies during a call raises :class:`polyrl.cluster.reliability.WorkerDied` naming
the role, the rank, its node and process, and what to check; one rank's failed
collective caused by a dead peer is reported as the peer's death (the cause), not as the
symptom. Callers that tolerate a failed rank (the rollout pool retries its shard, the env
pool ends its episodes) pass ``on_error`` instead.
"""

from __future__ import annotations

import asyncio
import enum
import inspect
import os
import socket
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from polyrl import faults
from polyrl.batch import Batch
from polyrl.cluster import session
from polyrl.cluster.reliability import WorkerDied

__all__ = [
    "Dispatch",
    "Collect",
    "register",
    "WorkerGroup",
    "Calls",
    "gather",
]


class Dispatch(enum.Enum):
    ONE = "one"
    ALL = "all"
    EACH = "each"
    SPLIT = "split"
    BY_KEY = "by_key"


class Collect(enum.Enum):
    FIRST = "first"
    ALL = "all"
    CONCAT = "concat"


_MODES = "__polyrl_modes__"
# (rank, the indices of the items it got or None, the error) -> that rank's result instead
OnError = Callable[[int, "list[int] | None", BaseException], Any]


def register(
    dispatch: Dispatch = Dispatch.ALL, collect: Collect = Collect.ALL
) -> Callable[[Callable], Callable]:
    """Declare how a worker method's calls are spread and collected (module docstring)."""

    def deco(fn: Callable) -> Callable:
        setattr(fn, _MODES, (dispatch, collect))
        return fn

    return deco


def modes(cls: type, method: str) -> tuple[Dispatch, Collect]:
    """The declared modes of ``cls.method`` (default: every rank, every result)."""
    fn = getattr(cls, method, None)
    if fn is None:
        raise AttributeError(f"{cls.__name__} has no method {method!r}")
    return getattr(fn, _MODES, (Dispatch.ALL, Collect.ALL))


def _where_this_runs(_worker: Any) -> dict[str, Any]:
    """The Ray node this process runs on (id and address), its pid, the GPUs it sees
    (CUDA_VISIBLE_DEVICES) and the JAX platform it is pinned to (JAX_PLATFORMS)."""
    import ray

    env = os.environ.get
    return {
        "node": ray.get_runtime_context().get_node_id(),
        "ip": ray.util.get_node_ip_address(),
        "pid": os.getpid(),
        "gpus": env("CUDA_VISIBLE_DEVICES", ""),
        "jax": env("JAX_PLATFORMS", ""),
    }


def _rendezvous(_worker: Any, listen: Callable[[], int] | None) -> tuple[str, int]:
    """This node's address and a port on it where a collective group meets: ``listen()``'s
    (kept listening in this process), or a free port, closed again."""
    import ray

    if listen is not None:
        return ray.util.get_node_ip_address(), listen()
    with socket.socket() as s:
        s.bind(("", 0))
        return ray.util.get_node_ip_address(), s.getsockname()[1]


class WorkerGroup:
    """``num_workers`` Ray workers of ``cls`` for ``role`` (the name its errors use);
    ``ray`` must be initialised unless ``num_workers`` is 0 (module docstring).

    options: rank -> Ray actor options (``polyrl.cluster.placement``). env: environment of every
    worker. max_restarts: Ray restarts a dead worker this often. timeout_s: default limit
    of every call (None: none). ready_timeout_s: limit of :meth:`start` and :meth:`revive`.
    """

    def __init__(
        self,
        role: str,
        cls: type,
        args: tuple = (),
        *,
        num_workers: int,
        options: Callable[[int], dict[str, Any]],
        env: Mapping[str, str] | None = None,
        max_restarts: int = 0,
        timeout_s: float | None = None,
        ready_timeout_s: float = 600.0,
    ):
        # a Role is a str; its plain value reads as the role in messages and logs
        self.role, self.cls, self.options = str(role), cls, options
        self.max_restarts = max_restarts
        self.timeout_s, self.ready_timeout_s = timeout_s, ready_timeout_s
        self.workers: list[Any] = []
        self.local = None if num_workers else cls(*args, 0)
        self._where: list[Any] = []  # each worker's _where_this_runs, asked at creation
        # A warm session's workers (polyrl.cluster.session): its host names them, a run
        # attached to it looks them up and, at its end, lets go of them.
        self.session = session.borrowed(self.role) if num_workers else None
        if num_workers:
            import ray

            remote = ray.remote(cls)
            for rank in range(num_workers):
                name = session.actor_name(self.role, rank)
                if self.session == "attach":
                    worker = ray.get_actor(name)
                else:
                    opts = self.actor_options(rank, env)
                    opts |= {"name": name} if self.session == "serve" else {}
                    worker = remote.options(**opts).remote(*args, rank)
                self.workers.append(worker)
                self._where.append(worker.__ray_call__.remote(_where_this_runs))

    def actor_options(self, rank: int, env: Mapping[str, str] | None = None) -> dict[str, Any]:
        """Ray actor options of worker ``rank``: ``options(rank)``, its ``runtime_env``
        variables over ``env`` and the fault hooks, and the restart policy."""
        opts = dict(self.options(rank))
        own = opts.pop("runtime_env", {}).get("env_vars", {})
        base = dict(env or {})
        if os.environ.get(faults.ENV):  # test-only fault hooks reach the workers too
            base.setdefault(faults.ENV, os.environ[faults.ENV])
        return {
            **opts,
            "max_restarts": self.max_restarts,
            "max_task_retries": 0,
            "runtime_env": {"env_vars": {**base, **own}},
        }

    @property
    def num_workers(self) -> int:
        """Ranks a call is spread over (the in-process worker counts as one)."""
        return len(self.workers) or 1

    # ------------------------------------------------------------------ calls
    def submit(self, method: str, *args: Any, **kwargs: Any) -> Calls:
        """Start ``method`` on the ranks its dispatch mode picks, without waiting."""
        dispatch, collect = modes(self.cls, method)
        parts = self._spread(dispatch, args)
        if self.local is not None:
            fn = getattr(self.local, method)
            done = []
            for _, _, a in parts:
                out = fn(*a, **kwargs)
                done.append(asyncio.run(out) if inspect.iscoroutine(out) else out)
            return Calls(self, method, collect, [(0, i, None) for _, i, _ in parts], done)
        calls = [
            (rank, index, getattr(self.workers[rank], method).remote(*a, **kwargs))
            for rank, index, a in parts
        ]
        return Calls(self, method, collect, calls)

    def call(
        self,
        method: str,
        *args: Any,
        timeout_s: float | None = None,
        on_error: OnError | None = None,
        **kwargs: Any,
    ) -> Any:
        """:meth:`submit` and wait: the collected result (see :meth:`Calls.result`)."""
        return self.submit(method, *args, **kwargs).result(timeout_s, on_error)

    def call_one(self, rank: int, method: str, *args: Any, **kwargs: Any) -> Any:
        """``method`` on worker ``rank`` alone, whatever its dispatch (a retry elsewhere)."""
        ref = getattr(self.workers[rank], method).remote(*args, **kwargs)
        return Calls(self, method, Collect.FIRST, [(rank, None, ref)]).result()

    def _spread(self, dispatch: Dispatch, args: tuple) -> list[tuple[int, list[int] | None, tuple]]:
        """``(rank, indices of the first argument's items it got or None, its args)``."""
        n, rest = self.num_workers, args[1:]
        if dispatch is Dispatch.ONE:
            return [(0, None, args)]
        if dispatch is Dispatch.ALL:
            return [(r, None, args) for r in range(n)]
        first = args[0]
        if dispatch is Dispatch.EACH:
            if len(first) != n:
                raise ValueError(f"{self.role}: {len(first)} per-rank values for {n} workers")
            return [(r, None, (first[r], *rest)) for r in range(n)]
        if dispatch is Dispatch.SPLIT and isinstance(first, Batch):
            shards = first.split(n) if n > 1 else [first]
            return [(r, None, (s, *rest)) for r, s in enumerate(shards)]
        if dispatch is Dispatch.SPLIT:
            index = [s.tolist() for s in np.array_split(np.arange(len(first)), n) if len(s)]
        else:  # BY_KEY
            by_rank: dict[int, list[int]] = {}
            for i, item in enumerate(first):
                by_rank.setdefault(int(item[0]) % n, []).append(i)
            index = [by_rank.get(r, []) for r in range(n)]
        return [(r, idx, ([first[i] for i in idx], *rest)) for r, idx in enumerate(index) if idx]

    # ---------------------------------------------------------- dead workers
    def start(self, method: str, *args: Any, fix: str = "") -> Any:
        """Call ``method`` as the workers' start-up (within ``ready_timeout_s``); if they
        do not come up, end the group and raise an error that says what each worker asked
        for, what Ray has, and ``fix``."""
        return self.started(self.submit(method, *args), fix)

    def started(self, calls: Calls, fix: str = "") -> Any:
        """Wait for a start-up call submitted earlier (``submit``: the caller started
        other work meanwhile) as :meth:`start` waits for its own."""
        try:
            return calls.result(self.ready_timeout_s)
        except TimeoutError:
            raise self._not_started(fix) from None
        except WorkerDied as e:
            self.shutdown()
            raise RuntimeError(f"role {self.role!r}: a worker failed to start: {e}") from e

    def _not_started(self, fix: str) -> TimeoutError:
        import ray

        asked, n = self.options(0), len(self.workers)
        self.shutdown()
        return TimeoutError(
            f"role {self.role!r}: {n} worker(s) did not start within "
            f"{self.ready_timeout_s:g} s. Each asks for {asked}; Ray has "
            f"{ray.available_resources()} available. {fix}".strip()
        )

    def rendezvous(self, fix: str = "", listen: Callable[[], int] | None = None) -> tuple[str, int]:
        """Rank 0's node address and a port there: where a torch.distributed or
        jax.distributed group of these workers meets. listen: run in rank 0's process (the
        one that later joins the group) to choose the port and keep it listening until the
        group's store takes it over (``polyrl.backends.base.ProcessModel.listen``); None: a
        free port, closed again, that the group binds itself (another process may take it
        in between)."""
        import ray

        try:
            ref = self.workers[0].__ray_call__.remote(_rendezvous, listen)
            return ray.get(ref, timeout=self.ready_timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise self._not_started(fix) from None

    def where(self) -> list[dict[str, Any]]:
        """Where each worker runs (as it was when it started): its Ray node id and address,
        pid, the GPUs it sees (CUDA_VISIBLE_DEVICES) and its JAX platform (JAX_PLATFORMS)."""
        import ray

        return ray.get(self._where)

    def died(self, rank: int, error: BaseException) -> WorkerDied:
        """The report of worker ``rank``'s death: role, rank, where it ran, what to check."""
        import ray

        where = ""
        if rank < len(self._where) and ray.wait([self._where[rank]], timeout=0)[0]:
            try:
                w = ray.get(self._where[rank])
                where = f"node {w['ip']} ({w['node'][:12]}), pid {w['pid']}"
            except ray.exceptions.RayError:
                pass
        said = str(error).strip().splitlines()
        cause = type(error).__name__ + (f": {said[0]}" if said else "")
        return WorkerDied(self.role, rank, cause, where)

    def revive(self, rank: int, probe: str, fix: str = "") -> Any:
        """Wait until worker ``rank`` answers ``probe`` (Ray restarting it, within
        ``ready_timeout_s``) and return its answer. ``fix``: the bindings that set this
        group's restarts and wait, named when the worker does not come back."""
        import ray

        worker = self.workers[rank]
        deadline = time.monotonic() + self.ready_timeout_s
        while True:
            try:
                left = max(1.0, deadline - time.monotonic())
                return ray.get(getattr(worker, probe).remote(), timeout=left)
            except ray.exceptions.ActorUnavailableError:  # restarting: ask again shortly
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"role {self.role!r} worker {rank} did not come back within "
                        f"{self.ready_timeout_s:g} s ({fix})"
                    ) from None
                time.sleep(0.5)
            except ray.exceptions.RayActorError as e:
                raise RuntimeError(
                    f"role {self.role!r} worker {rank} is dead and Ray will not restart it "
                    f"(max_restarts={self.max_restarts} used up? {fix}): {e}"
                ) from e

    def shutdown(self) -> None:
        """End every worker and wait until its process is gone (a session's, borrowed by
        an attached run: let go of them, the session keeps them)."""
        from polyrl.cluster.ray_session import end_actors

        if self.session != "attach":
            end_actors(self.workers)
        self.workers = []


class Calls:
    """One method's calls in flight on a :class:`WorkerGroup`."""

    def __init__(
        self,
        group: WorkerGroup,
        method: str,
        collect: Collect,
        parts: list[tuple[int, list[int] | None, Any]],
        done: list[Any] | None = None,
    ):
        self.group, self.method, self.collect = group, method, collect
        self.parts, self.done = parts, done  # done: the in-process worker's results

    @property
    def refs(self) -> list[Any]:
        return [ref for _, _, ref in self.parts]

    def result(self, timeout_s: float | None = None, on_error: OnError | None = None) -> Any:
        """Wait for every called rank (at most ``timeout_s``, default the group's) and
        collect. Without ``on_error`` a dead worker raises WorkerDied, a worker's error is
        re-raised and a timeout raises TimeoutError; with it, a failed rank's result is
        ``on_error(rank, its item indices, error)``."""
        values = self.done if self.done is not None else self._wait(timeout_s, on_error)
        return self._collect(values)

    def _wait(self, timeout_s: float | None, on_error: OnError | None) -> list[Any]:
        import ray

        timeout_s = self.group.timeout_s if timeout_s is None else timeout_s
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        at = {ref: i for i, ref in enumerate(self.refs)}
        values: list[Any] = [None] * len(self.parts)
        pending = list(self.refs)
        while pending:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            done, pending = ray.wait(pending, num_returns=1, timeout=left)
            if not done:  # past the deadline: every rank still running failed
                for ref in pending:
                    values[at[ref]] = self._failed(at[ref], self._late(timeout_s), on_error)
                break
            i = at[done[0]]
            try:
                values[i] = ray.get(done[0])
            except ray.exceptions.RayActorError as e:
                if on_error is None:
                    raise self.group.died(self.parts[i][0], e) from e
                values[i] = self._failed(i, e, on_error)
            except ray.exceptions.RayTaskError as e:
                if on_error is None:
                    self._name_the_dead(pending)
                values[i] = self._failed(i, e, on_error)
        return values

    def _late(self, timeout_s: float | None) -> TimeoutError:
        return TimeoutError(
            f"role {self.group.role!r}: {self.method} did not return within {timeout_s:g} s"
        )

    def _failed(self, i: int, error: BaseException, on_error: OnError | None) -> Any:
        rank, index, _ = self.parts[i]
        if on_error is None:
            raise error
        return on_error(rank, index, error)

    def _name_the_dead(self, pending: list[Any]) -> None:
        """A rank's call failed. When a peer died, the live ranks' collective fails too
        (gloo: connection reset), often before Ray reports the death: if another rank's
        call ends with its worker dead within 30 s, raise WorkerDied for it (the cause)
        instead of the failed call's error (the symptom)."""
        import ray

        at = {ref: i for i, ref in enumerate(self.refs)}
        deadline = time.monotonic() + 30.0
        while pending and time.monotonic() < deadline:
            done, pending = ray.wait(pending, num_returns=1, timeout=deadline - time.monotonic())
            for ref in done:
                try:
                    ray.get(ref)
                except ray.exceptions.RayActorError as e:
                    raise self.group.died(self.parts[at[ref]][0], e) from e
                except ray.exceptions.RayTaskError:
                    pass  # another live rank's failed collective

    def _collect(self, values: list[Any]) -> Any:
        if not values:  # an empty split or keyed list: no rank was called
            return None if self.collect is Collect.FIRST else []
        if self.collect is Collect.FIRST:
            return values[0]
        if self.collect is Collect.ALL:
            return values
        index = [idx for _, idx, _ in self.parts]
        if index and index[0] is not None:  # a split or keyed list: back in input order
            out: list[Any] = [None] * sum(len(idx) for idx in index)
            for idx, part in zip(index, values):
                for j, value in zip(idx, part):
                    out[j] = value
            return out
        if isinstance(values[0], Mapping):
            return {k: np.concatenate([v[k] for v in values]) for k in values[0]}
        return [v for part in values for v in part]


def gather(pending: Mapping[str, Calls]) -> Iterator[tuple[str, Any]]:
    """``(name, result)`` of each pending call as it completes (first done, first out), so a
    caller can time each of several calls that run at once. A call whose worker failed is
    raised as soon as it fails (its other workers may wait forever in a collective)."""
    import ray

    left = dict(pending)
    while left:
        refs = [r for p in left.values() for r in p.refs]
        ray.wait(refs, num_returns=1)
        ready = set(ray.wait(refs, num_returns=len(refs), timeout=0)[0])
        for name, p in list(left.items()):
            done = [r for r in p.refs if r in ready]
            if len(done) == len(p.refs) or _any_failed(done):
                del left[name]
                yield name, p.result()


def _any_failed(refs: Sequence[Any]) -> bool:
    import ray

    for ref in refs:
        try:
            ray.get(ref)
        except Exception:
            return True
    return False
