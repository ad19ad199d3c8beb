"""Where polyrl puts each worker's GPUs, on a cluster that declares GPUs without having
any (tests/trainer/test_gpu_map.py runs it with RAY_ADDRESS set): for each layout (JSON
on argv: name -> gin overrides of tiny_grpo.gin), build the role table and the
Placement as ``polyrl train`` does, start every role worker (the real EngineWorker, never
started, so nothing imports torch or jax or touches CUDA) and a stand-in for every rollout
server with the Ray options polyrl computes, and report what each one got. Prints one
JSON line: layout -> role -> [{"node", "gpus", "jax", "num_gpus"} per worker].

Usage: python gpu_map_driver.py RUN_DIR LAYOUTS_JSON
"""

from __future__ import annotations

import json
import os
import sys


class ServerStandIn:
    """Stands where a RolloutServer would (its vLLM would need the GPUs it only sees)."""

    def __init__(self, config, index: int) -> None:
        pass


def layout(run_dir: str, params: list[str]) -> dict[str, list[dict]]:
    from polyrl.cluster.groups import WorkerGroup
    from polyrl.cluster.placement import Placement
    from polyrl.cluster.roles import build_roles
    from polyrl.cluster.workers import EngineWorker, engine_env
    from polyrl.configure.launch import parse_config, prepare
    from polyrl.rollout.server import server_env

    cfg, _ = parse_config(
        ["gin/experiments/tiny_grpo.gin"], [f"polyrl.RunConfig.run_dir = {run_dir!r}", *params]
    )
    cfg, spec = prepare(cfg)
    roles = build_roles(cfg, spec)
    placement = Placement(cfg.pools, roles)
    out, groups = {}, []
    try:
        for name, role in roles.items():
            options = lambda rank, n=name: placement.options(n, rank)  # noqa: E731
            if name == "rollout":  # as RolloutPool starts them
                cls, arg, env = ServerStandIn, (cfg.rollout,), server_env(cfg.rollout)
            else:  # as EngineGroup starts them (engines not started)
                cls, arg, env = EngineWorker, (role.backend,), engine_env(role, options, None)
            group = WorkerGroup(
                name, cls, arg, num_workers=role.num_workers, options=options, env=env
            )
            groups.append(group)
            where = group.where()
            out[name] = [
                {
                    **{k: w[k] for k in ("node", "gpus", "jax")},
                    "num_gpus": options(i).get("num_gpus", 0),
                }
                for i, w in enumerate(where)
            ]
    finally:
        for group in groups:
            group.shutdown()
        placement.release()
    return out


def main(run_dir: str, layouts: str) -> None:
    import ray

    ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=False)
    names = {
        n["NodeID"]: next((k for k in n["Resources"] if k.startswith("node_")), "head")
        for n in ray.nodes()
        if n["Alive"]
    }
    result = {}
    for name, params in json.loads(layouts).items():
        found = layout(os.path.join(run_dir, name), params)
        result[name] = {
            role: [{**w, "node": names[w["node"]]} for w in workers]
            for role, workers in found.items()
        }
    print(json.dumps(result))


if __name__ == "__main__":
    main(*sys.argv[1:3])
