"""Resumable checkpoints with torch.distributed.checkpoint (DCP).

Layout of a checkpoint directory::

    .metadata, __*_*.distcp   DCP: sharded model ("model") and optimizer ("optim") state
    rng/rank{r}.pt            each rank's torch (and CUDA) RNG state
    polyrl_state.json         step, role, world size; written last = "checkpoint complete"

DCP stores DTensor shards with their global layout, so a checkpoint written by N ranks
loads on M ranks (resharding happens on load). The learning-rate schedule is a pure
function of the step (``OptimConfig.lr_at``), so the step *is* its state.

Loading unpickles nothing arbitrary: DCP's ``.metadata`` (a pickle) is read by an
unpickler that only builds DCP's own metadata classes, and the optimizer's non-tensor
entries (DCP's byte items) and the RNG files must pass ``torch.load(weights_only=True)``.
A checkpoint crafted to run code on load is refused with ``pickle.UnpicklingError``.
"""

from __future__ import annotations

import io
import json
import pickle
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

__all__ = ["save_checkpoint", "load_checkpoint", "read_extra", "STATE_FILE"]

STATE_FILE = "polyrl_state.json"

# The only globals a DCP ``.metadata`` pickle may name (what torch 2.13 writes).
_METADATA_GLOBALS = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath", "Path"},
    "collections": {"OrderedDict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP metadata and refuses any other global (no code runs from the file)."""

    def find_class(self, module: str, name: str) -> Any:
        if name in _METADATA_GLOBALS.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(
            getattr(torch, name, None), torch.dtype | torch.layout | torch.memory_format
        ):
            return getattr(torch, name)
        raise pickle.UnpicklingError(
            f"DCP metadata names {module}.{name}, which a polyrl checkpoint never holds; "
            "refusing to load it (the file may have been tampered with)"
        )


class _SafeReader(dcp.FileSystemReader):
    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        from torch.distributed.checkpoint.metadata import StorageMeta

        with open(Path(self.path, ".metadata"), "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        metadata.storage_meta = metadata.storage_meta or StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _SafePlanner(dcp.DefaultLoadPlanner):
    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        # Vet the bytes with the weights-only unpickler first (it raises on anything
        # else); DCP's own load then reads data known to hold only plain values.
        torch.load(value, weights_only=True)
        value.seek(0)
        super().load_bytes(read_item, value)


def _dcp_load(state: dict[str, Any], path: Path) -> None:
    dcp.load(state, storage_reader=_SafeReader(path), planner=_SafePlanner())


def _rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def _options(trainable_only: bool) -> StateDictOptions:
    """``trainable_only`` (LoRA): frozen parameters are neither saved nor expected."""
    return StateDictOptions(ignore_frozen_params=trainable_only, strict=not trainable_only)


def save_checkpoint(
    path: str,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    extra: dict[str, Any],
    trainable_only: bool = False,
) -> None:
    """Write model (+ optimizer) state, this rank's RNG and ``extra`` (JSON, rank 0);
    ``trainable_only``: of the model, only the parameters that train (LoRA adapters)."""
    out = Path(path)
    rank = dist.get_rank() if dist.is_initialized() else 0
    opts = _options(trainable_only)
    if optimizer is None:
        state = {"model": get_model_state_dict(model, options=opts)}
    else:
        model_sd, optim_sd = get_state_dict(model, optimizer, options=opts)
        state = {"model": model_sd, "optim": optim_sd}
    dcp.save(state, checkpoint_id=str(out))
    (out / "rng").mkdir(parents=True, exist_ok=True)
    torch.save(_rng_state(), out / "rng" / f"rank{rank}.pt")
    _barrier()
    if rank == 0:
        (out / STATE_FILE).write_text(json.dumps(extra, indent=1))
    _barrier()


def read_extra(path: str) -> dict[str, Any]:
    """The ``extra`` a complete checkpoint at ``path`` was saved with."""
    if not Path(path, STATE_FILE).is_file():
        raise FileNotFoundError(
            f"{path!r} is not a complete torch_fsdp checkpoint (no {STATE_FILE}; it is written "
            "last, so the save may have been interrupted); pass a directory written by save()"
        )
    return json.loads(Path(path, STATE_FILE).read_text())


def load_checkpoint(
    path: str,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    trainable_only: bool = False,
) -> dict[str, Any]:
    """Restore what :func:`save_checkpoint` wrote (the optimizer only when given one) and
    return its ``extra``. A checkpoint from another world size loads (DCP reshards); the
    RNG is restored only when this rank has a saved state of its own."""
    src = Path(path)
    extra = read_extra(path)
    opts = _options(trainable_only)
    if optimizer is None:
        state = {"model": get_model_state_dict(model, options=opts)}
        _dcp_load(state, src)
        set_model_state_dict(model, state["model"], options=opts)
    else:
        model_sd, optim_sd = get_state_dict(model, optimizer, options=opts)
        state = {"model": model_sd, "optim": optim_sd}
        _dcp_load(state, src)
        set_state_dict(
            model,
            optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
            options=opts,
        )
    rank = dist.get_rank() if dist.is_initialized() else 0
    rng_file = src / "rng" / f"rank{rank}.pt"
    if rng_file.is_file():
        rng = torch.load(rng_file, weights_only=True)
        torch.set_rng_state(rng["torch"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
    return extra
