"""A checkpoint written by 2 gloo ranks (fsdp=2) resumes on 1 (DCP resharding). That the
2-rank fsdp and HSDP updates equal one process's is the contract suite's
(tests/backends/test_contract.py, mesh and world size); both use the run of the
``torch_two_ranks`` fixture (tests/backends/conftest.py)."""

from __future__ import annotations

import torch
from torch_fsdp_helpers import actor, full_weights, one_rank_with_its_port_taken, spawn


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
