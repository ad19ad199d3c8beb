"""polyrl.cluster.groups.WorkerGroup on a real local Ray: each dispatch/collect mode puts the
right items on the right rank and gives them back in order (the same in-process), a
dead worker is named with its role, rank, node and process, Ray's restart is waited for,
a failed rank can be replaced by the caller, and calls and start-ups time out with an
error that says what was asked."""

from __future__ import annotations

import os
import sys
import time

import numpy as np
import pytest

from polyrl.batch import Batch
from polyrl.cluster.groups import Collect, Dispatch, WorkerGroup, register
from polyrl.cluster.reliability import WorkerDied


class Echo:
    """Says which rank got what."""

    def __init__(self, tag: str, rank: int) -> None:
        self.tag, self.rank = tag, rank

    @register(Dispatch.ONE, Collect.FIRST)
    def one(self, x: int) -> tuple[int, int]:
        return self.rank, x

    def every(self, x: int) -> tuple[str, int, int]:  # undeclared: ALL, ALL
        return self.tag, self.rank, x

    @register(Dispatch.EACH)
    def each(self, x: str, y: int) -> tuple[int, str, int]:
        return self.rank, x, y

    @register(Dispatch.SPLIT, Collect.CONCAT)
    def split(self, items: list[str]) -> list[tuple[int, str]]:
        return [(self.rank, s) for s in items]

    @register(Dispatch.SPLIT, Collect.CONCAT)
    def rows(self, batch: Batch) -> dict[str, np.ndarray]:
        return {"rank": np.full(len(batch), self.rank), "x": batch["x"] * 10}

    @register(Dispatch.BY_KEY, Collect.CONCAT)
    async def keyed(self, items: list[tuple[int, str]]) -> list[tuple[int, str]]:
        return [(self.rank, s) for _, s in items]

    def ping(self) -> int:
        return self.rank

    def die_if(self, rank: int) -> int:
        if self.rank == rank:
            os._exit(1)
        return self.rank

    def nap(self, seconds: float) -> int:
        time.sleep(seconds)
        return self.rank


# as polyrl train does: the workers import what the driver can (this test module)
ENV = {"PYTHONPATH": os.pathsep.join(sys.path)}


def _group(n: int, **kw) -> WorkerGroup:
    options = lambda rank: {"num_cpus": 0}  # noqa: E731
    return WorkerGroup("echo", Echo, ("t",), num_workers=n, options=options, env=ENV, **kw)


@pytest.fixture(scope="module")
def group(ray_session):
    """Three workers that Ray restarts once each (one group for the module: each worker
    is a process to start, seconds on a loaded 2-core machine)."""
    group = _group(3, max_restarts=1)
    yield group
    group.shutdown()


def _modes(group: WorkerGroup) -> dict:
    batch = Batch({"x": np.arange(6)})
    return {
        "one": group.call("one", 7),
        "every": group.call("every", 1),
        "each": group.call("each", ["a", "b", "c"][: group.num_workers], 5),
        "split": group.call("split", list("abcdefg")),
        "rows": group.call("rows", batch),
        "keyed": group.call("keyed", [(5, "p"), (1, "q"), (3, "r"), (0, "s"), (4, "t")]),
    }


def test_dispatch_and_collect_modes(group):
    got = _modes(group)
    assert got["one"] == (0, 7)
    assert got["every"] == [("t", 0, 1), ("t", 1, 1), ("t", 2, 1)]
    assert got["each"] == [(0, "a", 5), (1, "b", 5), (2, "c", 5)]
    # 7 items over 3 ranks: contiguous shards of 3, 2, 2, back in input order
    assert got["split"] == list(zip([0, 0, 0, 1, 1, 2, 2], "abcdefg"))
    # a Batch: equal shards of 2 rows, outputs concatenated row-wise
    assert got["rows"]["rank"].tolist() == [0, 0, 1, 1, 2, 2]
    assert got["rows"]["x"].tolist() == [0, 10, 20, 30, 40, 50]
    # key % 3: 5 -> 2, 1 -> 1, 3 -> 0, 0 -> 0, 4 -> 1; results in the input's order
    assert got["keyed"] == [(2, "p"), (1, "q"), (0, "r"), (0, "s"), (1, "t")]
    assert group.call("split", []) == [] and group.call("keyed", []) == []  # no rank called
    # In-process (no actors): the same calls on one rank 0.
    local = _modes(_group(0))
    assert local["split"] == [(0, s) for s in "abcdefg"]
    assert local["keyed"] == [(0, s) for s in "pqrst"]
    assert local["rows"]["x"].tolist() == got["rows"]["x"].tolist()
    assert local["every"] == [("t", 0, 1)] and local["each"] == [(0, "a", 5)]


def test_a_call_times_out_naming_role_and_method(group):
    with pytest.raises(TimeoutError, match=r"role 'echo': nap did not return within 0.3 s"):
        group.submit("nap", 1.5).result(timeout_s=0.3)


def test_dead_worker_is_named_revived_or_replaced(group):
    node = group.where()[1]
    with pytest.raises(WorkerDied) as err:
        group.call("die_if", 1)
    said = str(err.value)
    assert f"role 'echo' worker (rank 1) died on node {node['ip']}" in said
    assert f"pid {node['pid']}" in said and "logs/" in said, said
    assert err.value.rank == 1
    assert group.revive(1, "ping") == 1  # Ray restarted it (max_restarts=1): it answers
    with pytest.raises(WorkerDied, match=r"rank 1"):
        group.call("die_if", 1)  # its last restart used up
    # the caller's on_error stands in for the dead rank's shard
    got = group.call("split", list("abcde"), on_error=lambda rank, idx, e: [(-rank, "x")] * 2)
    assert got == [(0, "a"), (0, "b"), (-1, "x"), (-1, "x"), (2, "e")]
    with pytest.raises(RuntimeError, match=r"worker 1 is dead and Ray will not restart it"):
        group.revive(1, "ping")


def test_start_up_times_out_naming_what_was_asked(ray_session):
    # more CPUs than the cluster has: never scheduled
    greedy = WorkerGroup(
        "greedy",
        Echo,
        ("t",),
        num_workers=1,
        options=lambda r: {"num_cpus": 3},
        env=ENV,
        ready_timeout_s=1,
    )
    with pytest.raises(
        TimeoutError,
        match=r"role 'greedy': 1 worker\(s\) did not start within 1 s\. Each asks "
        r"for \{'num_cpus': 3\}.*lower it",
    ):
        greedy.start("every", 0, fix="lower it")
    assert greedy.workers == []  # ended
