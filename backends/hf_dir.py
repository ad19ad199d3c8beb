"""Hugging Face model directories from weight buckets (``TrainEngine.export_weights``).

:func:`write_hf` is the one writer of both backends: it takes the buckets an engine's
``export_weights`` yields (full tensors under HF names, torch or jax arrays) and writes
``model.safetensors`` (sharded with an index past ``max_shard_bytes``), ``config.json``
(the source model's, with the exported dtype) and the tokenizer/generation files of the
source model; transformers and vLLM load the result like the source. Whatever
``export_weights`` returns is what is written, so an engine that trains adapters exports
merged weights through the same path. Shared by the backends (the torch engine's
``save_hf``) and the core (``polyrl.configure.hf_export``, ``polyrl.cluster.workers``), like
``backends/buckets.py``; torch (which writes the safetensors) is imported lazily.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from polyrl.checkpoints import match_mode

__all__ = ["write_hf", "value_head_config", "TOKENIZER_FILES"]

# Files of a source model directory besides weights and config.json that an export keeps.
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


def _shards(buckets: Iterable[Any], max_shard_bytes: int, keep: bool):
    """Regroup buckets into shards ``{name: CPU torch tensor}`` of at most
    ``max_shard_bytes`` (a larger tensor gets one of its own). Without ``keep`` (a rank
    that only takes part in the gathers) the tensors are dropped and empty shards with
    their names come out, so every rank walks the same sequence."""
    current: dict[str, Any] = {}
    names: list[str] = []
    size = 0
    for bucket in buckets:
        for name, x in bucket:
            nbytes = int(x.nbytes)  # torch, jax and numpy arrays all say
            if names and size + nbytes > max_shard_bytes:
                yield names, current
                current, names, size = {}, [], 0
            names.append(name)
            if keep:
                current[name] = _cpu_torch(x)
            size += nbytes
    if names:
        yield names, current


def write_hf(
    buckets: Iterable[Any],
    src_dir: str | Path,
    out_dir: str | Path,
    *,
    write: bool = True,
    config: Mapping[str, Any] | None = None,
    max_shard_bytes: int = 5 << 30,
    value_head: bool = False,
) -> Path:
    """Write the weights in ``buckets`` as an HF directory at ``out_dir`` (module doc).

    ``config``: the ``config.json`` to write (default: ``src_dir``'s, with ``torch_dtype``
    set to the weights' floating dtype). ``write`` False: consume the buckets (each may be
    a collective every rank joins) and write nothing (the ranks other than the first).
    ``value_head``: the weights are a value model's (``model.*`` + ``score.weight``): the
    config becomes its sequence classifier's (:func:`value_head_config`).
    """
    from safetensors.torch import save_file

    out = Path(out_dir)
    if write:
        out.mkdir(parents=True, exist_ok=True)
    shard_names: list[list[str]] = []
    total, dtype = 0, None
    for names, tensors in _shards(buckets, max_shard_bytes, write):
        shard_names.append(names)
        if write:
            save_file(tensors, str(out / f".shard-{len(shard_names) - 1}"), {"format": "pt"})
            total += sum(t.numel() * t.element_size() for t in tensors.values())
            floats = [t.dtype for t in tensors.values() if t.is_floating_point()]
            dtype = dtype or (str(floats[0]).removeprefix("torch.") if floats else None)
    if not write:
        return out
    if len(shard_names) == 1:
        files = ["model.safetensors"]
        (out / ".shard-0").rename(out / files[0])
    else:
        weight_map, files = {}, []
        for i, names in enumerate(shard_names):
            files.append(f"model-{i + 1:05d}-of-{len(shard_names):05d}.safetensors")
            (out / f".shard-{i}").rename(out / files[-1])
            weight_map.update(dict.fromkeys(names, files[-1]))
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    src = Path(src_dir)
    if config is None:
        config = json.loads((src / "config.json").read_text())
        if dtype:
            config = {**config, "torch_dtype": dtype}
            config.pop("dtype", None)
    if value_head:
        config = value_head_config(config)
    (out / "config.json").write_text(json.dumps(dict(config), indent=2, sort_keys=True))
    match_mode([out / name for name in files], out / "config.json")
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, out / name)
    return out


def value_head_config(config: Mapping[str, Any], bias: bool = False) -> dict[str, Any]:
    """A causal LM's ``config`` made a value model's (critic, reward model): the family's
    sequence-classification architecture (token-classification with a ``bias`` on the
    head) with ``num_labels=1``, whose key layout ``model.* + score.*`` is what a value
    model exports; transformers' ``AutoModelForSequenceClassification`` and polyrl's
    reward_model role load it."""
    archs = config.get("architectures") or [str(config.get("model_type", "")).capitalize()]
    family = archs[0].split("For")[0]
    kind = "TokenClassification" if bias else "SequenceClassification"
    out = {k: v for k, v in config.items() if k not in ("id2label", "label2id")}
    return {**out, "architectures": [f"{family}For{kind}"], "num_labels": 1}


def _cpu_torch(x: Any):
    """A contiguous CPU torch tensor with ``x``'s values (torch, jax or numpy array;
    bfloat16 kept: numpy's ml_dtypes bfloat16 is reinterpreted bit for bit)."""
    import numpy as np
    import torch

    if isinstance(x, torch.Tensor):
        return x.detach().to("cpu").contiguous()
    arr = np.asarray(x)
    if arr.dtype.name == "bfloat16":  # torch has no numpy bfloat16: same bits as uint16
        return torch.from_numpy(np.ascontiguousarray(arr).view(np.uint16)).view(torch.bfloat16)
    return torch.from_numpy(np.array(arr))  # a writable copy (jax hands out read-only views)
