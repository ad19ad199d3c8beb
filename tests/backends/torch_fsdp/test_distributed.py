"""A checkpoint written by 2 gloo ranks (fsdp=2) resumes on 1 (DCP resharding). That the
2-rank fsdp and HSDP updates equal one process's is the contract suite's
(tests/backends/test_contract.py, mesh and world size); both use the run of the
``torch_two_ranks`` fixture (tests/backends/conftest.py). A group's port is its own from
the rendezvous on: a world of one needs none, two Ray workers keep theirs listening."""

from __future__ import annotations

import errno
import socket

import torch
from torch_fsdp_helpers import (
    actor,
    full_weights,
    one_rank_with_its_port_taken,
    random_batch,
    spawn,
)

from polyrl.cluster.groups import WorkerGroup
from polyrl.cluster.roles import RoleSpec
from polyrl.cluster.workers import EngineGroup
from polyrl.config import ModelConfig, ParallelConfig


def test_two_rank_checkpoint_loads_on_one_rank(torch_two_ranks, tiny_model_dir):
    """DCP reshards: the fsdp=2 checkpoint restores the same weights and step here."""
    results, out = torch_two_ranks
    engine = actor(tiny_model_dir)
    engine.load(str(out / "ckpt"))
    assert engine.step == 1
    for name, w in full_weights(engine).items():
        torch.testing.assert_close(w, results["fsdp"]["weights"][name], rtol=0, atol=0)


def test_a_world_of_one_needs_no_free_port():
    spawn(one_rank_with_its_port_taken, 1)


def test_a_two_worker_group_keeps_its_port_from_the_rendezvous(
    ray_session, tiny_model_dir, monkeypatch
):
    """Another process that binds the port the rendezvous reported, before the workers
    join, finds it taken, and the group forms (a tiny CPU run's actor died at start so:
    EADDRINUSE in torch's store, 1 start in 6; Ray starts many processes meanwhile)."""
    rendezvous, refused, taken = WorkerGroup.rendezvous, [], []

    def then_another_binds_it(self, *args, **kwargs):
        addr, port = rendezvous(self, *args, **kwargs)
        other = socket.socket()
        try:
            other.bind(("", port))
            other.listen()
            taken.append(other)
        except OSError as e:
            other.close()
            refused.append(e.errno)
        return addr, port

    monkeypatch.setattr(WorkerGroup, "rendezvous", then_another_binds_it)
    spec = RoleSpec(
        "reference", "train", 2, 1, 1, "torch_fsdp",
        ModelConfig(str(tiny_model_dir), role="reference"), None,
        ParallelConfig(mesh={"fsdp": 2}, micro_batch_size=2),
    )  # fmt: skip
    group = None
    try:
        group = EngineGroup(spec, env={"OMP_NUM_THREADS": "1"})
        log_probs = group.forward(random_batch(4))["log_probs"]
    finally:
        if group is not None:
            group.shutdown()
        for s in taken:
            s.close()
    assert refused == [errno.EADDRINUSE]
    assert log_probs.shape[0] == 4 and torch.isfinite(torch.as_tensor(log_probs)).all()
