"""Run checkpoints: atomic, verified on load, no pickle (docs/reliability.md).

A run's checkpoint of step N is the directory ``<run_dir>/checkpoints/step_N``::

    actor/, critic/          each trained role's engine checkpoint (TrainEngine.save)
    manifest.json            what the checkpoint must match to be loaded (see run_manifest)
    trainer_state.json       step + loop state (KL controller ...); written last

It is written under ``step_N.tmp`` and renamed when complete, so a kill at any moment
leaves either the whole checkpoint or a ``.tmp`` directory that loading never looks at
and the next save removes. Loading compares ``manifest.json`` with the run's own and
refuses a mismatch, naming every field that differs and the binding that fixes it. Every
file is JSON or array data (DCP read through a pickle-free reader, orbax's
tensorstore/msgpack): loading a checkpoint runs no code from it.

This module is framework-free: engines are reached through callables.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from polyrl import faults
from polyrl.role_table import trained_roles

__all__ = [
    "CheckpointMismatch",
    "latest_checkpoint",
    "model_shape",
    "run_manifest",
    "check_manifest",
    "check_resumable",
    "save",
    "restore",
    "write_json",
    "save_peft_adapters",
    "MANIFEST",
    "STATE",
]

MANIFEST = "manifest.json"
STATE = "trainer_state.json"
FORMAT = 1
_STEP_DIR = re.compile(r"step_(\d+)")

# Fields of config.json that fix a model's parameter shapes.
SHAPE_KEYS = (
    "architectures",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "vocab_size",
    "tie_word_embeddings",
)

# manifest field -> what to change so that a run matches its checkpoint.
FIXES = {
    "algorithm": "set polyrl.RunConfig.algorithm to the checkpoint's algorithm",
    "trained_roles": "use the algorithm (and algo_overrides) the run started with",
    "model": "set polyrl.RunConfig.model_path to the model the run started from",
    "role": "load a checkpoint of the same role",
    "lora": "bind the polyrl.LoraConfig (RunConfig.lora) the checkpoint was trained with",
}


class CheckpointMismatch(ValueError):
    """A checkpoint that does not fit the run (or engine) asked to load it."""


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The complete checkpoint of the highest step under ``run_dir/checkpoints`` (a
    ``.tmp`` directory left by an interrupted save is never one)."""
    done = [
        (int(m.group(1)), p.parent)
        for p in Path(run_dir, "checkpoints").glob(f"step_*/{STATE}")
        if (m := _STEP_DIR.fullmatch(p.parent.name))
    ]
    return max(done)[1] if done else None


def model_shape(model_path: str | Path) -> dict[str, Any]:
    """The shape-defining fields of a Hugging Face model directory's config.json."""
    cfg = json.loads(Path(model_path, "config.json").read_text())
    return {k: cfg.get(k) for k in SHAPE_KEYS}


def run_manifest(cfg: Any, spec: Any) -> dict[str, Any]:
    """What a run's checkpoint must match: backend, algorithm, trained roles, model shape."""
    return {
        "format": FORMAT,
        "backend": cfg.backend,
        "algorithm": spec.name,
        "trained_roles": [str(role) for role in trained_roles(cfg, spec)],
        "model": model_shape(cfg.model_path),
    }


def check_manifest(found: Mapping[str, Any], expected: Mapping[str, Any], where: str) -> None:
    """Raise :class:`CheckpointMismatch` naming every field of ``expected`` that
    ``found`` (read from the checkpoint at ``where``) differs in, with its fix."""
    diffs = []
    for key, want in expected.items():
        have = found.get(key)
        if key == "backend":  # the other backend's checkpoint is converted (restore)
            continue
        if key == "model" and isinstance(have, dict) and isinstance(want, dict):
            parts = [
                f"{k} {have.get(k)!r} vs {want.get(k)!r}" for k in want if have.get(k) != want[k]
            ]
            if parts:
                diffs.append(f"model shape: checkpoint/run {', '.join(parts)} ({FIXES['model']})")
        elif have != want:
            fix = FIXES.get(key, "use a checkpoint written by this version of polyrl")
            diffs.append(f"{key}: checkpoint {have!r}, this run {want!r} ({fix})")
    if diffs:
        raise CheckpointMismatch(
            f"checkpoint {where} does not match this run: {'; '.join(diffs)}. To start "
            "afresh instead, use a new polyrl.RunConfig.run_dir (or leave out --resume)"
        )


def save_peft_adapters(
    out_dir: str | os.PathLike, adapters: Mapping[str, Any], lora: Any, base_path: str
) -> Path:
    """Write LoRA adapters as a PEFT adapter directory (``adapter_model.safetensors`` +
    ``adapter_config.json``), which ``peft.PeftModel.from_pretrained(base, out_dir)`` and
    vLLM's LoRA support load. ``adapters``: ``{"<module>.lora_A.weight" | "...lora_B...":
    numpy array}`` (HF module paths, no adapter name); ``lora``: the ``LoraConfig``."""
    import numpy as np
    from safetensors.numpy import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {
        f"base_model.model.{k}": np.ascontiguousarray(v, np.float32) for k, v in adapters.items()
    }
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(base_path),
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": list(lora.target_modules),
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
    }
    write_json(out / "adapter_config.json", config)
    return out


def write_json(path: Path, data: Any) -> None:
    """Write ``data`` as JSON and fsync it, so a file a later rename publishes is on disk."""
    with path.open("w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())


def save(
    run_dir: str | Path,
    step: int,
    parts: Mapping[str, Callable[[str], None]],
    state: Mapping[str, Any],
    manifest: Mapping[str, Any],
    keep: int,
    extra_files: Callable[[Path], None] | None = None,
) -> Path:
    """Write checkpoint ``step`` atomically and keep the newest ``keep`` complete ones.

    ``parts``: name -> a callable writing that part (an engine's ``save``) into the
    directory it is given; ``extra_files``: writes more loop state into the checkpoint
    directory. Partial ``.tmp`` directories of interrupted saves are removed.
    """
    root = Path(run_dir, "checkpoints")
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob("step_*.tmp"):
        shutil.rmtree(stale, ignore_errors=True)
        print(f"[checkpoint] removed {stale} (left by an interrupted save)", flush=True)
    path = root / f"step_{step}"
    tmp = path.with_name(path.name + ".tmp")
    tmp.mkdir()
    if faults.active("fail_write", step, "checkpoint"):
        faults.raise_disk_full(str(tmp))
    for name, write in parts.items():
        write(str(tmp / name))
    if extra_files is not None:
        extra_files(tmp)
    if faults.active("kill_in_save", step):
        faults.kill_self()
    write_json(tmp / MANIFEST, dict(manifest))
    write_json(tmp / STATE, {"step": step, **state})
    if path.exists():  # the same step saved again after a resume: replace it
        shutil.rmtree(path)
    tmp.rename(path)  # complete or absent, never half-written
    done = sorted(
        (int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.fullmatch(p.name))
    )
    for _, old in done[: max(len(done) - keep, 0)]:
        shutil.rmtree(old)
    return path


def check_resumable(path: Path | None, manifest: Mapping[str, Any]) -> str | None:
    """Refuse checkpoint ``path`` (None: nothing to check) unless it matches ``manifest``;
    cheap, so ``--resume`` runs it before any worker starts. Returns the backend that
    wrote it when that is not the run's (:func:`restore` converts it), else None."""
    if path is None:
        return None
    found = path / MANIFEST
    if not found.is_file():
        raise CheckpointMismatch(
            f"checkpoint {path} has no {MANIFEST} (written by an older polyrl), so it cannot "
            "be checked against this run; start a new polyrl.RunConfig.run_dir"
        )
    written = json.loads(found.read_text())
    check_manifest(written, manifest, str(path))
    return written["backend"] if written["backend"] != manifest["backend"] else None


def restore(
    path: Path,
    parts: Mapping[str, Callable[[str], None]],
    manifest: Mapping[str, Any],
    exchange: Any = None,
) -> dict[str, Any]:
    """Check checkpoint ``path`` against ``manifest``, load each part, return the state.

    A checkpoint of the other backend is converted part by part into the exchange format
    (``polyrl.backends.exchange``) next to it, loaded from there, and the conversion removed; one
    line names what does not carry over. ``exchange``: the ``polyrl.backends.exchange``
    module (passed in: the backends import this module, so it cannot import them)."""
    other = check_resumable(path, manifest)
    if other is None:
        for name, load in parts.items():
            load(str(path / name))
        return json.loads((path / STATE).read_text())
    if exchange is None:
        raise CheckpointMismatch(f"checkpoint {path} was written by {other}; pass exchange")
    staging = path.with_name(path.name + ".exchange")
    shutil.rmtree(staging, ignore_errors=True)
    try:
        for name, load in parts.items():
            exchange.convert(other, path / name, staging / name)
            load(str(staging / name))
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    print(
        f"[resume] {path} was written by {other}; resuming on {manifest['backend']}: "
        f"{exchange.NOT_CARRIED}",
        flush=True,
    )
    return json.loads((path / STATE).read_text())
