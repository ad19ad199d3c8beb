"""A trainer's shutdown gives everything back to the Ray session: its workers' processes
are gone when it returns, and its pools' placement groups are released, so the next run
in the same session (a test module, a notebook, a sweep's next trial) can reserve them.
Before, ``ray.kill`` returned at once and the placement groups stayed: a second run whose
pool asked for the same resources waited 120 s and failed: on 2 x H200 the GPU tests of
tests/trainer/test_gpu_scale.py passed one by one and the second failed when both ran
in one Ray session."""

from __future__ import annotations

import time

import psutil
import pytest

from polyrl.configure.launch import _components, parse_config, prepare

GRPO = "gin/experiments/tiny_grpo.gin"


@pytest.fixture(scope="module")
def ray_slots():
    """A private local Ray with a custom resource, so the pool needs a placement group
    (CPU-only pools without one do not: ``polyrl.cluster.placement``)."""
    import ray

    assert not ray.is_initialized()
    ray.init(
        address="local",
        num_cpus=2,
        resources={"slot": 1},
        include_dashboard=False,
        log_to_driver=False,
    )
    yield ray
    ray.shutdown()


def _trainer(run_dir):  # one step of the tiny GRPO, every role in the pool "shared"
    from polyrl.loop.trainer import RLTrainer

    cfg, _ = parse_config(
        [GRPO],
        [
            f"polyrl.RunConfig.run_dir = {str(run_dir)!r}",
            "polyrl.RunConfig.tensorboard = False",
            "polyrl.RunConfig.total_steps = 1",
            "polyrl.RunConfig.pools = {'shared': {'CPU': 2, 'slot': 1}}",
        ],
    )
    cfg, spec = prepare(cfg)
    return RLTrainer(cfg, spec, _components(cfg, spec))


def test_shutdown_frees_processes_and_placement_groups(ray_slots, tmp_path):
    ray = ray_slots
    trainer = _trainer(tmp_path / "first")
    assert ray.available_resources().get("slot", 0) == 0  # the pool holds the slot
    actors = [*trainer.actor.workers, *trainer.reference.workers, *trainer.pool.servers]
    pids = ray.get([a.__ray_call__.remote(lambda self: __import__("os").getpid()) for a in actors])
    trainer.run()
    trainer.shutdown()
    alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]
    assert not alive, f"worker processes still alive after shutdown: {alive}"
    deadline = time.monotonic() + 10  # Ray's resource view catches up within a heartbeat
    while ray.available_resources().get("slot", 0) < 1 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert ray.available_resources().get("slot", 0) == 1, "the placement group was kept"
