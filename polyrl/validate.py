"""Checks that run before any worker starts or any device is touched.

``check_run(cfg, spec)`` returns every problem with the bound configuration — batch
arithmetic, role isolation, device mapping, the cluster environment — each naming the
gin binding to change, its value and the fix. ``polyrl validate-config`` prints them;
``polyrl train`` refuses to start while any remains.
"""

from __future__ import annotations

import os
from typing import Any

from polyrl.config import RunConfig

__all__ = ["ConfigError", "check_run", "check_cluster", "raise_if_problems"]


class ConfigError(ValueError):
    """The configuration cannot run; ``problems`` lists every finding."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("invalid configuration:\n  " + "\n  ".join(problems))


def raise_if_problems(problems: list[str]) -> None:
    if problems:
        raise ConfigError(problems)


def _batch_problems(cfg: RunConfig, spec: Any) -> list[str]:
    out = []
    # A preference step trains on 2 rows (chosen, rejected) per prompt.
    n = cfg.sampling.n if spec.objective == "rl" else 2
    if cfg.prompts_per_step % cfg.mini_batch_prompts:
        out.append(
            f"RunConfig.prompts_per_step={cfg.prompts_per_step} is not a multiple of "
            f"RunConfig.mini_batch_prompts={cfg.mini_batch_prompts}: every optimizer step must "
            f"see the same number of prompts; make prompts_per_step a multiple of mini_batch_prompts"
        )
    if cfg.mini_batch_prompts > cfg.prompts_per_step:
        out.append(
            f"RunConfig.mini_batch_prompts={cfg.mini_batch_prompts} exceeds "
            f"RunConfig.prompts_per_step={cfg.prompts_per_step}; lower mini_batch_prompts"
        )
    for role, par in (("actor", cfg.actor_parallel), ("critic", cfg.critic_parallel)):
        if role == "critic" and not spec.needs_critic:
            continue
        samples = cfg.mini_batch_prompts * n
        if spec.objective == "preference" and par.micro_batch_size % 2:
            out.append(
                f"{role}/ParallelConfig.micro_batch_size={par.micro_batch_size} is odd: a DPO "
                f"micro-batch holds whole (chosen, rejected) pairs; make it even"
            )
        if samples % par.dp_size:
            out.append(
                f"RunConfig.mini_batch_prompts={cfg.mini_batch_prompts} x SamplingSpec.n={n} = "
                f"{samples} samples per optimizer step do not split over the {role}'s "
                f"{par.dp_size} data-parallel shards ({role}_parallel mesh {dict(par.mesh)}); "
                f"make it a multiple of {par.dp_size}"
            )
    if spec.needs_groups and n < 2:
        out.append(
            f"SamplingSpec.n={n}: algorithm {spec.name!r} compares samples of the same prompt "
            f"(group baseline), so one sample per prompt gives zero advantages; set n >= 2"
        )
    from polyrl.config import DTYPES

    if cfg.model_dtype not in DTYPES:
        out.append(f"RunConfig.model_dtype={cfg.model_dtype!r} is not one of {list(DTYPES)}")
    if cfg.epochs < 1 or cfg.total_steps < 1:
        out.append(
            f"RunConfig.epochs={cfg.epochs} and RunConfig.total_steps={cfg.total_steps} must be >= 1"
        )
    if (
        cfg.optim.total_steps
        < cfg.total_steps * cfg.epochs * (cfg.prompts_per_step // max(cfg.mini_batch_prompts, 1))
        and cfg.optim.schedule == "cosine"
    ):
        out.append(
            f"OptimConfig.total_steps={cfg.optim.total_steps} is fewer than the run's optimizer "
            f"steps; the cosine schedule would sit at its floor — raise actor/OptimConfig.total_steps"
        )
    return out


def _rollout_problems(cfg: RunConfig) -> list[str]:
    out = []
    limit = cfg.rollout.prompt_limit
    if limit + cfg.sampling.max_tokens > cfg.rollout.max_model_len:
        out.append(
            f"RolloutConfig.max_model_len={cfg.rollout.max_model_len} is shorter than the prompt "
            f"limit ({limit}) + SamplingSpec.max_tokens={cfg.sampling.max_tokens}; raise "
            f"max_model_len or set RolloutConfig.max_prompt_len <= "
            f"{cfg.rollout.max_model_len - cfg.sampling.max_tokens}"
        )
    if cfg.sampling.top_p != 1.0 or cfg.sampling.top_k not in (0, -1):
        out.append(
            f"SamplingSpec.top_p={cfg.sampling.top_p} / top_k={cfg.sampling.top_k}: truncated "
            f"sampling makes the rollout's log-probs differ from the trainer's full-softmax "
            f"log-probs (off-policy without correction); use top_p=1.0, top_k=0 for RL"
        )
    return out


def _placement_problems(cfg: RunConfig, spec: Any) -> list[str]:
    from polyrl.weight_sync import TRANSPORTS

    out = []
    if cfg.weight_transport not in TRANSPORTS:
        out.append(
            f"RunConfig.weight_transport={cfg.weight_transport!r} is not one of {list(TRANSPORTS)}"
        )
    elif cfg.weight_transport == "cuda_ipc" and cfg.role_pools.get("actor") != cfg.role_pools.get(
        "rollout"
    ):
        out.append(
            "RunConfig.weight_transport='cuda_ipc' needs the actor and rollout in the same pool "
            f"(same GPUs), but role_pools maps them to {cfg.role_pools.get('actor')!r} and "
            f"{cfg.role_pools.get('rollout')!r}; use 'nccl' or 'object_store', or colocate them"
        )
    from polyrl.roles import role_names

    for role in role_names(cfg, spec):
        pool = cfg.role_pools.get(role)
        if pool is None:
            out.append(
                f"RunConfig.role_pools has no entry for role {role!r}; map it to one of "
                f"{sorted(cfg.pools)}"
            )
        elif pool not in cfg.pools:
            out.append(
                f"RunConfig.role_pools[{role!r}]={pool!r} is not a pool in RunConfig.pools "
                f"({sorted(cfg.pools)})"
            )
    return out


def check_cluster(cfg: RunConfig) -> list[str]:
    """The machine and Ray environment: GPUs asked for exist, Ray address reachable."""
    out = []
    address = os.environ.get("RAY_ADDRESS")
    multi_node = any(int(r.get("nodes", 1)) > 1 for r in cfg.pools.values())
    # On a cluster (RAY_ADDRESS, or pools over several nodes) the placement checks each
    # pool against the nodes' resources when it starts; here only this machine's GPUs.
    want_gpus = sum(float(r.get("GPU", 0)) for r in cfg.pools.values())
    if want_gpus and not address and not multi_node:
        try:
            import torch

            have = torch.cuda.device_count()
        except ImportError:
            have = 0
        if have < want_gpus:
            out.append(
                f"RunConfig.pools asks for {want_gpus:g} GPUs but this machine has {have}; set "
                f"the pools' 'GPU' to 0 to run on CPU, or run on a GPU machine"
            )
    if address and address not in ("auto", "local") and ":" not in address:
        out.append(
            f"RAY_ADDRESS={address!r} is not host:port, 'auto' or 'local'; unset it for a local cluster"
        )
    return out


def check_run(cfg: RunConfig, spec: Any, cluster: bool = True) -> list[str]:
    """Every problem with ``cfg`` for algorithm ``spec`` (empty list: good to go)."""
    from polyrl.backends.base import ENGINES

    problems = []
    if cfg.backend not in ENGINES:
        problems.append(
            f"RunConfig.backend={cfg.backend!r} is not a registered backend; choose one of "
            f"{sorted(ENGINES)} (include gin/backends/<name>.gin)"
        )
    problems += _batch_problems(cfg, spec)
    if spec.objective == "rl":
        problems += _rollout_problems(cfg)
    problems += _placement_problems(cfg, spec)
    if cfg.backend in ENGINES:
        from polyrl.roles import build_roles, role_problems

        problems += role_problems(cfg, build_roles(cfg, spec))
    if cluster:
        problems += check_cluster(cfg)
    return problems
