"""Resumable checkpoints with torch.distributed.checkpoint (DCP).

Layout of a checkpoint directory::

    .metadata, __*_*.distcp   DCP: sharded model ("model") and optimizer ("optim") state
    rng/rank{r}.pt            each rank's torch (and CUDA) RNG state
    polyrl_state.json         step, role, world size; written last = "checkpoint complete"

DCP stores DTensor shards with their global layout, so a checkpoint written by N ranks
loads on M ranks (resharding happens on load). The learning-rate schedule is a pure
function of the step (``OptimConfig.lr_at``), so the step *is* its state.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

__all__ = ["save_checkpoint", "load_checkpoint", "STATE_FILE"]

STATE_FILE = "polyrl_state.json"


def _rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def save_checkpoint(
    path: str, model: nn.Module, optimizer: torch.optim.Optimizer | None, extra: dict[str, Any]
) -> None:
    """Write model (+ optimizer) state, this rank's RNG and ``extra`` (JSON, rank 0)."""
    out = Path(path)
    rank = dist.get_rank() if dist.is_initialized() else 0
    if optimizer is None:
        state = {"model": get_model_state_dict(model)}
    else:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
    dcp.save(state, checkpoint_id=str(out))
    (out / "rng").mkdir(parents=True, exist_ok=True)
    torch.save(_rng_state(), out / "rng" / f"rank{rank}.pt")
    _barrier()
    if rank == 0:
        (out / STATE_FILE).write_text(json.dumps(extra, indent=1))
    _barrier()


def load_checkpoint(
    path: str, model: nn.Module, optimizer: torch.optim.Optimizer | None
) -> dict[str, Any]:
    """Restore what :func:`save_checkpoint` wrote (the optimizer only when given one) and
    return its ``extra``. A checkpoint from another world size loads (DCP reshards); the
    RNG is restored only when this rank has a saved state of its own."""
    src = Path(path)
    if not (src / STATE_FILE).is_file():
        raise FileNotFoundError(
            f"{path!r} is not a complete torch_fsdp checkpoint (no {STATE_FILE}; it is written "
            "last, so the save may have been interrupted); pass a directory written by save()"
        )
    extra = json.loads((src / STATE_FILE).read_text())
    if optimizer is None:
        state = {"model": get_model_state_dict(model)}
        dcp.load(state, checkpoint_id=str(src))
        set_model_state_dict(model, state["model"])
    else:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=str(src))
        set_state_dict(
            model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
        )
    rank = dist.get_rank() if dist.is_initialized() else 0
    rng_file = src / "rng" / f"rank{rank}.pt"
    if rng_file.is_file():
        rng = torch.load(rng_file, weights_only=True)
        torch.set_rng_state(rng["torch"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
    return extra
