"""Full weights out of a sharded model, under Hugging Face names.

:func:`iter_buckets` gathers one parameter at a time (``DTensor.full_tensor()``, a
collective every rank joins in the same order; on a one-rank mesh the local tensor is
already whole) and groups the full tensors into buckets of about ``bucket_bytes``, so no
rank holds more than one bucket of gathered weights.
Names are exactly the keys ``save_pretrained`` writes: ``named_parameters()`` yields a
tied parameter once, under its first name (``model.embed_tokens.weight``; the tied
``lm_head.weight`` is left out, as HF does), plus persistent buffers (non-persistent
ones such as rotary ``inv_freq`` are not checkpoint state).

:func:`save_hf` writes those buckets as HF safetensors (sharded with an index past
``max_shard_bytes``) with the config and the tokenizer files, loadable by transformers
and vLLM.
"""

from __future__ import annotations

import copy
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from polyrl.backends.buckets import iter_buckets as group_buckets
from polyrl.backends.torch_fsdp import lora

__all__ = ["hf_named_tensors", "full", "iter_buckets", "save_hf", "TOKENIZER_FILES"]

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "added_tokens.json",
    "chat_template.jinja",
    "generation_config.json",
)


def hf_named_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, local tensor or DTensor shard) in ``save_pretrained``'s key set."""
    yield from model.named_parameters()
    persistent = set(model.state_dict(keep_vars=True))
    for name, buf in model.named_buffers():
        if name in persistent:
            yield name, buf


def full(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The whole tensor on ``device`` (an all-gather for a DTensor shard; a DTensor on a
    mesh of one rank, or replicated, already holds it whole: no collective, no copy)."""
    if isinstance(t, DTensor):
        local = t.to_local()
        if t.device_mesh.size() == 1 or all(p.is_replicate() for p in t.placements):
            return local.to(device)
        if local.device != device:  # CPU-offloaded shard on a GPU world: gather on device
            t = DTensor.from_local(
                local.to(device), t.device_mesh, t.placements, shape=t.shape, stride=t.stride()
            )
        return t.full_tensor()
    return t.detach().to(device)


def iter_buckets(
    model: nn.Module,
    bucket_bytes: int,
    dtype: torch.dtype,
    device: torch.device,
    lora_scale: float | None = None,
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Buckets ``[(hf_name, full tensor in dtype)]`` of at most ``bucket_bytes`` each (a
    single tensor larger than that gets a bucket of its own). Every rank must consume
    the whole iterator: each tensor is a collective. ``lora_scale``: the model carries
    LoRA adapters, exported merged into the base weights (``lora.merged``)."""
    pairs = ((name, full(shard.detach(), device)) for name, shard in hf_named_tensors(model))
    if lora_scale is not None:
        pairs = lora.merged(pairs, lora_scale)
    cast = ((n, t.to(dtype) if t.is_floating_point() else t) for n, t in pairs)
    yield from group_buckets(cast, bucket_bytes)


def _hf_config(hf_config, value_head: nn.Linear | None):
    """The config to save: the model's own, or for a value model the family's
    sequence-classification (head without bias) / token-classification (with bias)
    architecture with ``num_labels=1``, whose key layout ``model.* + score.*`` matches."""
    config = copy.deepcopy(hf_config)
    if value_head is not None:
        family = type(hf_config).__name__.removesuffix("Config")
        kind = "TokenClassification" if value_head.bias is not None else "SequenceClassification"
        config.architectures = [f"{family}For{kind}"]
        config.num_labels = 1
    return config


def _write_shards(buckets, out: Path, max_shard_bytes: int, write: bool) -> None:
    """Regroup buckets into safetensors shards of at most ``max_shard_bytes``; only
    ``write`` ranks keep and write them, the others just take part in the gathers."""
    from safetensors.torch import save_file

    names: list[list[str]] = [[]]  # tensor names per shard, for the index
    current: dict[str, torch.Tensor] = {}
    size = total = 0

    def flush() -> None:
        if write and current:
            save_file(current, str(out / f".shard-{len(names) - 1}"), metadata={"format": "pt"})
        current.clear()

    for bucket in buckets:
        for name, tensor in bucket:
            nbytes = tensor.numel() * tensor.element_size()
            if names[-1] and size + nbytes > max_shard_bytes:
                flush()
                names.append([])
                size = 0
            names[-1].append(name)
            if write:
                current[name] = tensor.detach().cpu().contiguous()
            size += nbytes
            total += nbytes
    flush()
    if not write:
        return
    if len(names) == 1:
        (out / ".shard-0").rename(out / "model.safetensors")
        return
    weight_map = {}
    for i, shard in enumerate(names):
        fname = f"model-{i + 1:05d}-of-{len(names):05d}.safetensors"
        (out / f".shard-{i}").rename(out / fname)
        weight_map.update({name: fname for name in shard})
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def save_hf(
    model: nn.Module,
    hf_config,
    src_path: str,
    out_dir: str,
    *,
    dtype: torch.dtype,
    device: torch.device,
    is_main: bool,
    value_head: nn.Linear | None = None,
    max_shard_bytes: int = 5 << 30,
    lora_scale: float | None = None,
) -> None:
    """Write ``model`` as an HF directory at ``out_dir`` (rank 0 writes; every rank must
    call it, the gather is collective): safetensors in ``dtype``, ``config.json`` and the
    tokenizer/generation files copied from ``src_path``."""
    out = Path(out_dir)
    if is_main:
        out.mkdir(parents=True, exist_ok=True)
    buckets = iter_buckets(model, min(max_shard_bytes, 1 << 30), dtype, device, lora_scale)
    _write_shards(buckets, out, max_shard_bytes, write=is_main)
    if not is_main:
        return
    config = _hf_config(hf_config, value_head)
    config.dtype = dtype  # what config.json records as the weights' dtype
    config.save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (Path(src_path) / name).is_file():
            shutil.copy2(Path(src_path) / name, out / name)
