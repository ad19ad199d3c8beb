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
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)

from polyrl.backends import exchange

__all__ = [
    "save_checkpoint",
    "load_checkpoint",
    "read_extra",
    "export_exchange",
    "load_exchange",
    "set_full_params",
    "STATE_FILE",
]

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


_OPTIM_STATE = "optim.state."


def export_exchange(path: str) -> exchange.Exchange:
    """The checkpoint at ``path`` as full fp32 arrays under HF names (one process, no
    process group: DCP reads every shard). The DCP keys are ``model.<name>`` and
    ``optim.state.<name>.<exp_avg|exp_avg_sq|step>``; byte items (param groups) are
    never read."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    extra = read_extra(path)
    meta = _SafeReader(Path(path)).read_metadata()
    state = {
        key: torch.empty(md.size, dtype=md.properties.dtype)
        for key, md in meta.state_dict_metadata.items()
        if isinstance(md, TensorStorageMetadata)
    }
    _dcp_load(state, Path(path))
    params = {
        k[len("model.") :]: v.float().numpy() for k, v in state.items() if k.startswith("model.")
    }
    moments: dict[str, dict] = {m: {} for m in exchange.MOMENTS}
    adam_steps = set()
    for key, value in state.items():
        if not key.startswith(_OPTIM_STATE):
            continue
        name, _, field = key[len(_OPTIM_STATE) :].rpartition(".")
        if field in moments:
            moments[field][name] = value.float().numpy()
        elif field == "step":
            adam_steps.add(int(value.item()))
    if len(adam_steps) > 1:  # one optimizer step for all parameters, so one count
        raise ValueError(f"{path}: parameters have different Adam step counts {adam_steps}")
    info = {k: extra[k] for k in ("step", "role", "model")}
    info["adam_step"] = adam_steps.pop() if adam_steps else 0
    return exchange.Exchange(params, moments if moments["exp_avg"] else {}, info)


def set_full_params(model: nn.Module, params: dict[str, Any]) -> None:
    """Set every parameter from full arrays under HF names (numpy, any float dtype); each
    rank keeps its shard. A parameter missing from ``params`` raises naming it."""
    missing = sorted({k for k, _ in model.named_parameters()} - set(params))
    if missing:
        raise ValueError(f"no weights given for {len(missing)} parameter(s), e.g. {missing[:3]}")
    full = StateDictOptions(full_state_dict=True)
    # Only the given names: a tied ``lm_head.weight`` alias left in the state dict would
    # write the old embedding back over the new one.
    model_sd = {
        k: torch.as_tensor(params[k]).to(v.dtype)
        for k, v in get_model_state_dict(model, options=full).items()
        if k in params
    }
    set_model_state_dict(
        model, model_sd, options=StateDictOptions(full_state_dict=True, strict=False)
    )


def load_exchange(
    path: str, model: nn.Module, optimizer: torch.optim.Optimizer | None
) -> exchange.Exchange:
    """Load an exchange directory (``polyrl.backends.exchange``) into this rank's shards: full
    tensors in, each rank keeps its part (``full_state_dict`` + DTensor distribution)."""
    state = exchange.read(path, {k for k, _ in model.named_parameters()})
    set_full_params(model, state.params)
    full = StateDictOptions(full_state_dict=True)
    if optimizer is not None:
        if not state.moments:
            raise ValueError(f"exchange checkpoint {path} has no optimizer state to train from")
        optim_sd = get_optimizer_state_dict(model, optimizer, options=full)
        for name, entry in optim_sd["state"].items():
            for moment in exchange.MOMENTS:
                entry[moment] = torch.from_numpy(state.moments[moment][name]).to(
                    entry[moment].dtype
                )
            entry["step"] = torch.full_like(entry["step"], state.adam_step)
        set_optimizer_state_dict(model, optimizer, optim_sd, options=full)
    return state
