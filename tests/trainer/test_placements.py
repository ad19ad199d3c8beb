"""Every placement and weight transport that validate-config accepts on CPU starts and
syncs (issue 10). The fast test walks the grid (backend x colocated/disaggregated pools x
transport x synchronous/async) through validate-config and checks that the accepted set
is exactly the set listed in COVERED, each with the test that runs it end to end; a
combination validation starts accepting without a run fails it. The slow test runs each
one not run elsewhere: two tiny GRPO steps, with a 2-worker actor (torch: two ranks; JAX:
one host worker over two devices), where the rollout servers must hold the trainer's
weights after the first update.

Pools over several nodes need a cluster: tests/trainer/test_multinode.py runs them, with
the object store and (slow) the "nccl" broadcast group on gloo, on both backends.
"""

from __future__ import annotations

import itertools

import pytest

from polyrl.configure.launch import parse_config, train
from polyrl.configure.validate import ConfigError, preflight
from polyrl.loop.metrics import read_jsonl

GINS = {
    "torch_fsdp": "gin/experiments/tiny_grpo.gin",
    "jax_pjit": "gin/experiments/tiny_grpo_jax.gin",
}
POOLS = {
    "colocated": [
        "polyrl.RunConfig.pools = {'shared': {'CPU': 2}}",
        "actor/polyrl.RoleConfig.pool = 'shared'",
        "reference/polyrl.RoleConfig.pool = 'shared'",
        "polyrl.RolloutConfig.pool = 'shared'",
    ],
    "disaggregated": [
        "polyrl.RunConfig.pools = {'train': {'CPU': 1}, 'gen': {'CPU': 1}}",
        "actor/polyrl.RoleConfig.pool = 'train'",
        "reference/polyrl.RoleConfig.pool = 'train'",
        "polyrl.RolloutConfig.pool = 'gen'",
    ],
}
TRANSPORTS = ("object_store", "cuda_ipc", "nccl")
RUN = "tests/trainer/test_placements.py::test_placement_starts_and_syncs"
# (backend, pools, transport, async) -> the test that runs it end to end.
COVERED = {
    ("torch_fsdp", "colocated", "object_store", False): "tests/trainer/test_trainer.py::test_grpo_learns_on_torch",
    ("torch_fsdp", "colocated", "object_store", True): "tests/trainer/test_async.py::test_async_grpo_learns_with_bounded_staleness",
    ("jax_pjit", "colocated", "object_store", False): "tests/trainer/test_trainer.py::test_grpo_learns_on_jax",
    **{
        (backend, "disaggregated", transport, mode): RUN
        for backend in GINS
        for transport in ("object_store", "nccl")
        for mode in (False, True)
    },
    ("jax_pjit", "colocated", "object_store", True): RUN,
}  # fmt: skip


def _params(run_dir, backend, pools, transport, mode) -> list[str]:
    return [
        f"polyrl.RunConfig.run_dir = {str(run_dir)!r}",
        "polyrl.RunConfig.tensorboard = False",
        *POOLS[pools],
        f"polyrl.RunConfig.weight_transport = {transport!r}",
        f"polyrl.RunConfig.async_rollout = {mode}",
    ]


def test_every_accepted_cpu_placement_is_covered(tmp_path):
    accepted = set()
    for combo in itertools.product(GINS, POOLS, TRANSPORTS, (False, True)):
        cfg, _ = parse_config([GINS[combo[0]]], _params(tmp_path / "run", *combo))
        try:
            preflight(cfg)
        except ConfigError:
            continue
        accepted.add(combo)
    assert accepted == set(COVERED), sorted(accepted ^ set(COVERED))


@pytest.mark.slow
@pytest.mark.parametrize("combo", sorted(c for c, test in COVERED.items() if test == RUN), ids=str)
def test_placement_starts_and_syncs(ray_session, tmp_path, combo):
    backend, pools, transport, mode = combo
    run = tmp_path / "run"
    train(
        [GINS[backend]],
        [
            *_params(run, *combo),
            "polyrl.RunConfig.total_steps = 2",
            "actor/polyrl.ParallelConfig.mesh = {'data': 2}",
        ],
    )
    rows = read_jsonl(run / "metrics.jsonl")
    assert len(rows) == 2, rows
    assert all(r["sync/gb"] > 0 for r in rows)
    # The first batch is sampled by the initial weights, which trainer and servers share:
    # fp32 kernel noise (~5e-7, docs/rollout.md). The second is sampled after the first
    # update (lr 3e-3 moves log-probs by over 1e-3): synchronous, the servers must hold
    # the updated weights; async, they are one update behind and the batch says so.
    assert rows[0]["rollout/log_prob_diff_max"] < 1e-4, rows
    if mode:
        assert [r["rollout/staleness_max"] for r in rows] == [0, 1], rows
    else:
        assert rows[1]["rollout/log_prob_diff_max"] < 1e-4, rows
        assert [r["rollout/staleness_max"] for r in rows] == [0, 0], rows
