"""Which engines leave the GPU between their phases, and which roles' forwards overlap.

Colocated roles (one pool, ``polyrl.cluster.placement``) may take turns on their GPUs: an engine
lives in host memory except while a phase uses it, and the rollout servers sleep while
the trainer works. That costs host <-> device copies every step, so it is done only where
a placement needs it (``RunConfig.offload_colocated``):

- True: every trainer role that shares a GPU pool with another role takes turns (a role
  alone in its pool never moves); the rollout servers sleep when they share the pool and
  ``RolloutConfig.enable_sleep_mode`` is on.
- False: every engine stays resident.
- None (default): as True, unless everything fits side by side: measured after start-up
  (nvidia-smi, device-wide, so vLLM's share and every engine's weights are already in
  it), every shared GPU still has room for the trained roles' gradients and Adam state
  (:data:`TRAIN_STATE_FACTOR` x their weights, split over their devices; a LoRA actor's
  only for its adapters, whose fp32 weights, gradients and moments it keeps) plus
  :data:`HEADROOM` of the GPU for activations. Without a GPU (CPU runs) or nvidia-smi,
  nothing fits: turns stay on, the memory-safe choice.

Roles that do not take turns run their forwards (reference, old log-probs, values) at
once, each on its own workers (``RLTrainer.score``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from polyrl.role_table import ROLE_TABLE, Role

__all__ = [
    "HEADROOM",
    "TRAIN_STATE_FACTOR",
    "param_count",
    "lora_param_count",
    "fits_resident",
    "turn_roles",
]

# Share of each GPU kept free for activations when engines stay resident.
HEADROOM = 0.2
# Gradients (1x) and Adam's two moments (2x), in the weights' dtype, beyond the weights.
TRAIN_STATE_FACTOR = 3
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def _projections(c: dict) -> dict[str, tuple[int, int]]:
    """(in, out) features of each linear projection of one decoder layer of a HF config
    (Qwen2/Llama layout, grouped KV heads)."""
    h, inter, heads = c["hidden_size"], c["intermediate_size"], c["num_attention_heads"]
    head_dim = c.get("head_dim") or h // heads
    width, kv_width = heads * head_dim, (c.get("num_key_value_heads") or heads) * head_dim
    return {
        "q_proj": (h, width),
        "k_proj": (h, kv_width),
        "v_proj": (h, kv_width),
        "o_proj": (width, h),
        "gate_proj": (h, inter),
        "up_proj": (h, inter),
        "down_proj": (inter, h),
    }


def param_count(model_path: str | Path) -> int:
    """Parameters of a decoder-only HF model (Qwen2/Llama layout) from its config.json:
    embeddings (and an untied LM head), attention with grouped KV heads and biases, a
    gated MLP, two norms per layer and the final norm."""
    c = json.loads(Path(model_path, "config.json").read_text())
    h, proj = c["hidden_size"], _projections(c)
    biases = sum(proj[p][1] for p in ("q_proj", "k_proj", "v_proj"))
    per_layer = sum(i * o for i, o in proj.values()) + biases + 2 * h
    embed = c["vocab_size"] * h * (1 if c.get("tie_word_embeddings", False) else 2)
    return c["num_hidden_layers"] * per_layer + embed + h


def lora_param_count(model_path: str | Path, lora: Any) -> int:
    """Parameters of the LoRA adapters ``lora`` (a ``LoraConfig``) on a decoder-only HF
    model (Qwen2/Llama layout) from its config.json: rank x (in + out) for each target
    projection of every layer."""
    c = json.loads(Path(model_path, "config.json").read_text())
    proj = _projections(c)
    return c["num_hidden_layers"] * sum(lora.rank * sum(proj[t]) for t in lora.target_modules)


def fits_resident(
    gpus: Mapping[str, tuple[int, int]], need: Mapping[str, float], headroom: float = HEADROOM
) -> bool:
    """Every GPU (``id -> (used, total)`` bytes) has ``need[id]`` bytes free beyond
    ``headroom`` of its memory."""
    return bool(gpus) and all(
        total - used >= need.get(gpu, 0.0) + headroom * total for gpu, (used, total) in gpus.items()
    )


def turn_roles(
    cfg: Any,
    roles: Mapping[str, Any],
    shares: Mapping[str, Any],
    probe: Callable[[str], list[dict[str, Any] | None]],
) -> tuple[frozenset[str], bool]:
    """``(trainer roles that take turns, whether the rollout servers sleep)`` for this
    run (module docstring): ``roles`` the role table (``polyrl.cluster.roles``), ``shares`` each
    role's ``polyrl.cluster.placement.RoleShare``, ``probe(role)`` one ``{"gpu", "used", "total"}``
    (or None) per worker of a started role (``WorkerGroup.gpu_memory``)."""
    shared = {r for r in roles if len(shares[r].colocated_with) > 1}  # rollout included
    trainers = sorted(r for r in shared if ROLE_TABLE[r].kind == "engine")
    if cfg.offload_colocated is False or not trainers:
        return frozenset(), False
    if cfg.offload_colocated is None:
        if not any(float(cfg.pools[roles[r].pool].get("GPU", 0)) > 0 for r in trainers):
            return frozenset(), False  # CPU pools: offloading would only copy host -> host
        if _all_fit(cfg, roles, trainers, probe):
            return frozenset(), False
    sleeps = Role.ROLLOUT in shared and bool(cfg.rollout.enable_sleep_mode)
    return frozenset(trainers), sleeps


def _all_fit(
    cfg: Any,
    roles: Mapping[str, Any],
    trainers: list[str],
    probe: Callable[[str], list[dict[str, Any] | None]],
) -> bool:
    gpus: dict[str, tuple[int, int]] = {}
    need: dict[str, float] = {}
    weights = param_count(cfg.model_path) * DTYPE_BYTES.get(cfg.model_dtype, 4)
    state = {role: TRAIN_STATE_FACTOR * weights for role in trainers}
    if cfg.lora is not None and Role.ACTOR in state:  # fp32 adapters, their gradients, Adam
        state[Role.ACTOR] = (
            (1 + TRAIN_STATE_FACTOR) * 4 * lora_param_count(cfg.model_path, cfg.lora)
        )
    for role in trainers:
        seen = probe(role)
        if not seen or any(s is None for s in seen):
            return False
        world = roles[role].parallel.world_size if roles[role].parallel else 1
        for s in seen:
            gpus[s["gpu"]] = (s["used"], s["total"])
            if ROLE_TABLE[role].trained:  # each device holds 1/world of the state (FSDP)
                need[s["gpu"]] = need.get(s["gpu"], 0.0) + state[role] / world
    return fits_resident(gpus, need)
