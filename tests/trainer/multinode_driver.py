"""A polyrl driver joining the test cluster (tests/trainer/test_multinode.py runs it in its
own process, with RAY_ADDRESS set): two tiny GRPO steps with the actor in the two-node
pool; prints one JSON line: where each actor worker ran and the last step's metrics.

With ``resume``: a JAX run on two hosts resumed on one (see :func:`resume`).

With backend ``hsdp``: the torch actor as HSDP over the two worker nodes (mesh data=2 x
fsdp=2: shard inside a node, replicate across) and as one rank, one optimizer step on the
same batch each; prints both steps' loss and grad norm and the log-probs after the step.

Usage: python multinode_driver.py BACKEND RUN_DIR
"""

from __future__ import annotations

import json
import os
import sys

GRPO = "gin/experiments/tiny_grpo.gin"


def _params(
    backend: str, run_dir: str, nodes: int = 2, transport: str = "object_store"
) -> list[str]:
    """Tiny GRPO with the actor (mesh data=2) in a pool over ``nodes`` worker nodes."""
    return [
        f"polyrl.RunConfig.run_dir = {run_dir!r}",
        f"polyrl.RunConfig.backend = {backend!r}",
        f"polyrl.RunConfig.weight_transport = {transport!r}",
        "polyrl.RunConfig.tensorboard = False",
        "polyrl.RunConfig.total_steps = 2",
        "polyrl.RunConfig.prompts_per_step = 8",
        "polyrl.RunConfig.mini_batch_prompts = 8",
        "polyrl.RunConfig.algo_overrides = {'use_kl_loss': False}",
        f"polyrl.RunConfig.pools = {{'train': {{'CPU': 1, 'nodes': {nodes}, 'trainer': 1}}, "
        "'gen': {'CPU': 1, 'head': 1}}",
        "actor/polyrl.RoleConfig.pool = 'train'",
        "polyrl.RolloutConfig.pool = 'gen'",
        "actor/polyrl.ParallelConfig.mesh = {'data': 2}",
    ]


def main(backend: str, run_dir: str) -> None:
    """``backend`` may name a weight transport too: ``jax_pjit:nccl``."""
    import ray

    from polyrl.configure.launch import _components, parse_config, prepare
    from polyrl.loop.trainer import RLTrainer

    backend, _, transport = backend.partition(":")
    cfg, _ = parse_config([GRPO], _params(backend, run_dir, transport=transport or "object_store"))
    cfg, spec = prepare(cfg)
    trainer = RLTrainer(cfg, spec, _components(cfg, spec))
    try:
        names = {
            n["NodeID"]: next((k for k in ("node_a", "node_b") if k in n["Resources"]), "head")
            for n in ray.nodes()
            if n["Alive"]
        }
        where = trainer.actor.where()
        last = trainer.run()
        gcs = ray.get_runtime_context().gcs_address
    finally:
        trainer.shutdown()
    print(json.dumps({"actor_nodes": [names[w["node"]] for w in where], "gcs": gcs, "last": last}))


def nll(outputs, batch, ctx):
    """Token-mean NLL under the loss contract (divided by the global token count)."""
    mask = batch["response_mask"]
    loss = -(outputs["log_probs"] * mask).sum() / ctx.global_tokens
    return loss, {}


def hsdp(run_dir: str) -> None:
    from pathlib import Path

    import numpy as np
    import ray

    from polyrl.batch import from_token_lists
    from polyrl.cluster.placement import Placement
    from polyrl.cluster.roles import RoleSpec
    from polyrl.cluster.workers import EngineGroup
    from polyrl.config import ModelConfig, OptimConfig, ParallelConfig
    from polyrl.data.tiny import ensure_tiny_model

    ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=False)
    model = ModelConfig(str(ensure_tiny_model(Path(run_dir) / "models")))
    # eps=1e-4: Adam's first step ~ lr * sign(g) would otherwise amplify the fp32
    # summation-order noise of near-zero gradients (tests/backends/torch_fsdp).
    optim = OptimConfig(lr=1e-3, eps=1e-4)
    rng = np.random.default_rng(0)
    batch = from_token_lists(
        [rng.integers(4, 58, rng.integers(1, 7)).tolist() for _ in range(8)],
        [rng.integers(4, 58, rng.integers(1, 6)).tolist() for _ in range(8)],
        pad_id=0,
    )
    out = {}
    for name, pool, workers, hosts, mesh in (
        ("hsdp", {"CPU": 2, "nodes": 2, "trainer": 1}, 4, 2, {"data": 2, "fsdp": 2}),
        ("one", {"CPU": 1, "head": 1}, 1, 1, {"data": 1}),
    ):
        spec = RoleSpec(
            "actor", name, workers, hosts, 1, "torch_fsdp", model, optim,
            ParallelConfig(mesh=mesh, micro_batch_size=2),
        )  # fmt: skip
        placement = Placement({name: pool}, {"actor": spec})
        group = EngineGroup(spec, lambda rank, p=placement: p.options("actor", rank))
        where = group.where()
        metrics = group.train_step(batch, nll)
        out[name] = {
            "nodes": [w["node"] for w in where],
            "loss": metrics["loss"],
            "grad_norm": metrics["grad_norm"],
            "log_probs": group.forward(batch)["log_probs"].tolist(),
        }
        group.shutdown()
    print(json.dumps(out))


def resume(run_dir: str) -> None:
    """The JAX actor as two hosts (one per worker node) takes three steps, checkpointing
    at step 2 (each host writes its shards); then the run resumes from that checkpoint
    with the actor as ONE host over both of its devices and takes step 3 again. Prints
    both runs' metrics rows."""
    from pathlib import Path

    from polyrl.configure.launch import train
    from polyrl.loop.metrics import read_jsonl

    more = ["polyrl.RunConfig.total_steps = 3", "polyrl.RunConfig.save_every = 2"]
    train([GRPO], [*_params("jax_pjit", run_dir, nodes=2), *more])
    full = read_jsonl(Path(run_dir) / "metrics.jsonl")
    train([GRPO], [*_params("jax_pjit", run_dir, nodes=1), *more], resume=True)
    print(json.dumps({"full": full, "resumed": read_jsonl(Path(run_dir) / "metrics.jsonl")}))


if __name__ == "__main__":
    if sys.argv[1] == "hsdp":
        hsdp(sys.argv[2])
    elif sys.argv[1] == "resume":
        resume(sys.argv[2])
    else:
        main(*sys.argv[1:3])
