"""Hugging Face checkpoints <-> the JAX models' flat parameter dicts.

Parameters live in a flat dict ``{path: array}`` whose NNX paths are the HF names and
whose arrays have HF's layout (a linear ``<module>.weight`` is [out, in], see
``models.Linear``), so loading and export rename and transpose nothing.

Loading reads safetensors with ``safetensors.numpy`` (no torch); export yields full,
unsharded arrays under the names ``save_pretrained`` writes, in weight buckets
(``polyrl.weight_sync.to_torch`` then hands each array to torch through DLPack,
zero-copy when both sit on the same device); each bucket packs itself for a transport's
flat buffer (``bridge.pack_arrays``); ``polyrl.backends.hf_dir.write_hf`` writes them as an
HF directory.
"""

from __future__ import annotations

import functools
import glob
import json
import os
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import jax
import numpy as np

from polyrl.backends.buckets import OwnBucket
from polyrl.backends.buckets import iter_buckets as group_buckets
from polyrl.backends.jax_pjit.bridge import pack_arrays, torch_device
from polyrl.backends.jax_pjit.distributed import gather
from polyrl.backends.jax_pjit.models import TransformerConfig

__all__ = [
    "VALUE_HEAD_NAMES",
    "read_hf_config",
    "read_safetensors",
    "load_hf_params",
    "ExportBucket",
    "export_buckets",
]

# Value-head weight names used by HF (*ForTokenClassification / *ForSequenceClassification),
# TRL's AutoModelForCausalLMWithValueHead and OpenRLHF, in order of preference.
VALUE_HEAD_NAMES = ("score.weight", "v_head.summary.weight", "value_head.weight")


def read_hf_config(path: str | os.PathLike) -> dict[str, Any]:
    cfg_file = Path(path) / "config.json"
    if not cfg_file.exists():
        raise FileNotFoundError(
            f"{cfg_file} does not exist; ModelConfig.path must be a local Hugging Face model "
            "directory (config.json + *.safetensors)"
        )
    return json.loads(cfg_file.read_text())


def read_safetensors(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """All tensors of the ``*.safetensors`` files in directory ``path`` as numpy."""
    from safetensors.numpy import load_file

    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(
            f"no *.safetensors file in {path}; convert the checkpoint with "
            "save_pretrained(..., safe_serialization=True)"
        )
    out: dict[str, np.ndarray] = {}
    for f in files:
        out.update(load_file(f))
    return out


def _value_head(tensors: Mapping[str, np.ndarray], hidden: int, where: str) -> np.ndarray | None:
    """The [1, E] value-head weight in ``tensors`` under any of VALUE_HEAD_NAMES, or None."""
    for name in VALUE_HEAD_NAMES:
        if name in tensors:
            w = np.asarray(tensors[name]).reshape(-1, hidden)
            if w.shape[0] != 1:
                raise ValueError(
                    f"{where}: {name} has {w.shape[0]} outputs; a value head needs exactly 1 "
                    "(num_labels=1)"
                )
            return w
    return None


def load_hf_params(
    path: str | os.PathLike,
    config: TransformerConfig,
    expected: Mapping[str, tuple[int, ...]],
    value_head_path: str | None = None,
) -> dict[str, np.ndarray]:
    """Flat ``{path: numpy array}`` for the model whose parameters have ``expected``
    shapes, read from the HF checkpoint at ``path``.

    HF prefixes (``model.``) are kept; a tied ``lm_head.weight`` (some checkpoints save it
    anyway) is ignored; a missing value head (``score.*``) is zero-initialised unless
    ``value_head_path`` or the checkpoint itself provides one. Missing or mis-shaped
    weights raise, naming them.
    """
    params = read_safetensors(path)
    if "score.weight" in expected:
        head = (
            _value_head(read_safetensors(value_head_path), config.hidden_size, str(value_head_path))
            if value_head_path
            else _value_head(params, config.hidden_size, str(path))
        )
        params["score.weight"] = (
            np.zeros((1, config.hidden_size), np.float32) if head is None else head
        )
    missing = sorted(set(expected) - set(params))
    if missing:
        raise ValueError(
            f"{path}: checkpoint lacks {len(missing)} weight(s) the {config.architecture} "
            f"model needs, e.g. {missing[:5]}; is config.json from the same checkpoint?"
        )
    wrong = {
        k: (params[k].shape, tuple(s))
        for k, s in expected.items()
        if tuple(params[k].shape) != tuple(s)
    }
    if wrong:
        raise ValueError(f"{path}: weight shapes (found, expected) differ: {wrong}")
    return {k: params[k] for k in expected}


class _Planned(NamedTuple):
    """An array to export and its size once cast (what ``group_buckets`` reads)."""

    array: jax.Array
    nbytes: int


class ExportBucket(OwnBucket):
    """One bucket of :func:`export_buckets`: ``(hf_name, array)`` pairs, made on first
    access by one compiled program (the casts, :func:`_exporter`).

    ``pack_source`` is the same bucket before that program: ``(names, arrays on one
    device, dtype)``. :meth:`pack` (what ``polyrl.weight_sync.pack_flat`` calls) packs
    from it with one program that casts and writes the flat bytes at once (CUDA IPC and
    NCCL pushes never make the pairs)."""

    def __init__(self, names: list[str], arrays: list[jax.Array], dtype, device):
        self.pack_source = (names, arrays, dtype)
        self._device = device

    def make(self) -> list[tuple[str, jax.Array]]:
        names, arrays, dtype = self.pack_source
        return list(zip(names, _exporter(dtype, self._device)(*arrays)))

    def pack(self, alloc: Any):
        return pack_arrays(*self.pack_source, alloc=alloc)

    @property
    def torch_device(self):
        return torch_device(self.pack_source[1][0])

    def __len__(self) -> int:
        return len(self.pack_source[0])


def export_buckets(
    params: Mapping[str, jax.Array] | Iterable[tuple[str, jax.Array]],
    bucket_bytes: int,
    dtype: Any = None,
    device: jax.Device | None = None,
) -> Iterator[ExportBucket]:
    """Buckets of ``(hf_name, full array on one device)``, about ``bucket_bytes`` each
    (:class:`ExportBucket`), from a ``{name: array}`` dict or a lazy stream of pairs
    (``lora.merged``).

    Arrays keep their (HF) layout and are cast to ``dtype`` (default: as stored). A
    bucket's arrays are gathered onto ``device`` (default: this process's first device)
    when the bucket is built, so at most one bucket of gathered weights is alive at a
    time; its casts run as one compiled program (compiled once per bucket layout), not
    one dispatch per array.
    """
    device = device or jax.local_devices()[0]
    pairs = params.items() if isinstance(params, Mapping) else params
    planned = (
        (path, _Planned(x, int(x.size) * np.dtype(dtype or x.dtype).itemsize)) for path, x in pairs
    )
    for bucket in group_buckets(planned, bucket_bytes):
        paths = [path for path, _ in bucket]
        arrays = [p.array for _, p in bucket]
        if not all(a.is_fully_addressable for a in arrays):  # shards on other hosts
            arrays = [gather(a, device) for a in arrays]  # an all-gather each
        elif any(a.sharding.device_set != {device} for a in arrays):
            arrays = jax.device_put(arrays, device)  # one call (no copy for those there)
        dt = None if dtype is None else np.dtype(dtype)
        yield ExportBucket(paths, arrays, dt, device)


@functools.cache
def _exporter(dtype: np.dtype | None, device: jax.Device):
    """One jitted program: each array cast to ``dtype``, the results on ``device``."""

    def export(*arrays):
        return [a.astype(dtype or a.dtype) for a in arrays]

    return jax.jit(export, out_shardings=jax.sharding.SingleDeviceSharding(device))
