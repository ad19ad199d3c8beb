"""The "nccl" transport's broadcast group on CPU (gloo, the same code path as NCCL on GPU),
with real vLLM-CPU servers: this process plays the trainer's rank 0. The group forms
once, carries the weights (the servers' log-probs equal transformers' on the pushed
model), and is formed anew after a server restart. Plus what validate-config accepts."""

from __future__ import annotations

import numpy as np
import pytest
from rollout_reference import LOGPROB_ATOL, hf_log_probs, load_hf, prompts_batch

from polyrl.rollout import SamplingSpec
from polyrl.weight_sync import iter_buckets, transport_problems


def _buckets(model):
    return iter_buckets(model.state_dict().items(), bucket_bytes=64 * 1024)


def _check(pool, model) -> None:
    out = pool.generate(
        prompts_batch([6, 40], seed=2), SamplingSpec(n=2, temperature=0.9, max_tokens=8, seed=4)
    )
    assert set(out["rollout_weight_version"].tolist()) == {pool.version}
    ref = hf_log_probs(model, out, temperature=0.9, vocab=pool.sampling_vocab_size)
    np.testing.assert_allclose(out["rollout_log_probs"], ref, atol=LOGPROB_ATOL, rtol=0)


def _restart(ray, server) -> None:
    """Kill ``server`` and wait until Ray has restarted it (a new boot id answers)."""
    import time

    old = ray.get(server.info.remote())["boot_id"]
    ray.kill(server, no_restart=False)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            if ray.get(server.info.remote(), timeout=30)["boot_id"] != old:
                return
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError):
            pass  # still dying or restarting
        time.sleep(0.5)
    raise AssertionError("the killed rollout server did not come back within 180 s")


def test_broadcast_group_carries_weights_and_reforms_after_restart(
    pool, padded_model_dir, ray_session
):
    ray = ray_session
    syncer = pool.weight_syncer("nccl")
    assert syncer.ensure_group() is True  # trainer rank 0 (here) + 2 servers x 1 worker
    first = syncer.strategy.group
    assert syncer.ensure_group() is False  # same servers: the group stays
    model = load_hf(padded_model_dir, seed=41)
    stats = syncer.push(_buckets(model), pool.version + 1)
    pool.commit(stats)
    assert stats.buckets > 1 and stats.retained is None
    assert pool.weight_versions() == [pool.version] * 2
    _check(pool, model)

    # Server 1 restarts: it is back at version 0 and in no group. The pool re-syncs it
    # (nothing retained: from resync_source, as the trainer's actor), then the syncer
    # forms a new group with it and the next push reaches both servers.
    pool.resync_source = lambda: _buckets(model)
    _restart(ray, pool.servers[1])
    pool._recover(1)
    assert pool.weight_versions() == [pool.version] * 2
    assert syncer.ensure_group() is True and syncer.strategy.group != first
    model2 = load_hf(padded_model_dir, seed=42)
    pool.commit(syncer.push(_buckets(model2), pool.version + 1))
    assert pool.weight_versions() == [pool.version] * 2
    _check(pool, model2)


# slow: flaky. Once in three full default-tier runs (2026-12-03) the surviving server
# stayed blocked in the broken broadcast past every timeout (the syncer gave up after
# 300 s), the rest passed in 20-24 s: open in docs/reliability.md.
@pytest.mark.slow
def test_server_killed_during_group_push_is_resynced_before_it_generates(
    pool, padded_model_dir, ray_session
):
    """Server 0 is killed after the 3rd of 23 buckets of a group push: rank 0's
    broadcast fails (gloo: connection reset), the syncer tears the group down, forms one
    with server 1 alone, resends the unacknowledged buckets and completes the push there
    (server 0 reported lost); commit() waits for Ray's restart and re-syncs server 0
    before it generates, and the next push forms the group with it again."""
    ray = ray_session
    syncer = pool.weight_syncer("nccl")
    syncer.ensure_group()
    new = load_hf(padded_model_dir, seed=77)
    pool.resync_source = lambda: _buckets(new)  # the trainer's actor, in a run

    def buckets():
        for i, bucket in enumerate(iter_buckets(new.state_dict().items(), 16 * 1024)):
            if i == 3:
                ray.kill(pool.servers[0], no_restart=False)
            yield bucket

    stats = syncer.push(buckets(), pool.version + 1)
    assert stats.lost == [0] and stats.buckets > 10
    assert ray.get(pool.servers[1].weight_version.remote()) == stats.version
    pool.commit(stats)  # server 0: restarted, re-synced from resync_source
    assert pool.weight_versions() == [stats.version] * 2
    _check(pool, new)  # both servers score like transformers on the pushed weights

    assert syncer.ensure_group() is True  # a new group, with the restarted server 0
    model2 = load_hf(padded_model_dir, seed=78)
    stats = syncer.push(_buckets(model2), pool.version + 1)
    assert stats.lost == []
    pool.commit(stats)
    _check(pool, model2)


GPU = {"CPU": 4, "GPU": 1}
CPU = {"CPU": 1, "GPU": 0}


@pytest.mark.parametrize(
    "transport, pools, actor, rollout, ok",
    [
        ("object_store", {"a": GPU, "b": CPU}, "a", "b", True),
        ("object_store", {"a": CPU}, "a", "a", True),
        ("cuda_ipc", {"a": GPU}, "a", "a", True),
        ("cuda_ipc", {"a": CPU}, "a", "a", False),  # no GPU memory to share
        ("cuda_ipc", {"a": GPU, "b": GPU}, "a", "b", False),  # separate GPUs
        ("nccl", {"a": GPU, "b": GPU}, "a", "b", True),
        ("nccl", {"a": CPU, "b": CPU}, "a", "b", True),  # gloo
        ("nccl", {"a": GPU}, "a", "a", False),  # colocated: one device, two ranks
        ("nccl", {"a": GPU, "b": CPU}, "a", "b", False),  # mixed devices
    ],
)
def test_validate_accepts_only_what_the_placement_supports(transport, pools, actor, rollout, ok):
    problems = transport_problems(transport, actor, rollout, pools)
    assert (problems == []) == ok, problems
    if not ok:
        (msg,) = problems
        assert f"RunConfig.weight_transport={transport!r}" in msg
        assert "use " in msg.lower()  # names the fix


def test_cuda_ipc_needs_single_gpu_servers():
    # a torch rank shares a buffer on its one GPU; a tp=2 server's second GPU gets none
    (msg,) = transport_problems("cuda_ipc", "a", "a", {"a": {"GPU": 2}}, tensor_parallel=2)
    assert "tensor_parallel_size=2" in msg and "set tensor_parallel_size=1" in msg
    assert transport_problems("object_store", "a", "a", {"a": {"GPU": 2}}, tensor_parallel=2) == []
