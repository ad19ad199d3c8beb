"""Run checkpoints: atomic, verified on load, no pickle (docs/reliability.md).

A run's checkpoint of step N is the directory ``<run_dir>/checkpoints/step_N``::

    actor/, critic/          each trained role's engine checkpoint (TrainEngine.save)
    manifest.json            what the checkpoint must match to be loaded (see run_manifest)
    trainer_state.json       step + loop state (KL controller ...)
    checksums.json           size and blake3 of every other file; written last

It is written under ``step_N.tmp`` and renamed when complete, so a kill at any moment
leaves either the whole checkpoint or a ``.tmp`` directory that loading never looks at
and the next save removes. ``--resume`` (:func:`resume_point`, on the driver before any
worker starts) checks the files against ``checksums.json``: a damaged checkpoint is named,
moved aside to ``step_N.damaged`` (kept, never loaded) and the previous intact one used.
Loading compares ``manifest.json`` with the run's own and
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
import stat
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from polyrl import faults
from polyrl.role_table import trained_roles

__all__ = [
    "CheckpointMismatch",
    "CheckpointDamaged",
    "NoCheckpoint",
    "latest_checkpoint",
    "resume_point",
    "damage",
    "model_shape",
    "run_manifest",
    "check_manifest",
    "check_resumable",
    "save",
    "restore",
    "write_json",
    "save_peft_adapters",
    "match_mode",
    "MANIFEST",
    "STATE",
    "CHECKSUMS",
]

MANIFEST = "manifest.json"
STATE = "trainer_state.json"
CHECKSUMS = "checksums.json"
FRESH_FLAG = "--resume-or-start"  # polyrl train: resume, or start at step 0 when nothing is saved
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


class CheckpointDamaged(OSError):
    """Every checkpoint of a run has a file that differs from what was written."""


class NoCheckpoint(FileNotFoundError):
    """``--resume`` into a run dir that holds no checkpoint."""


def _complete(run_dir: str | Path) -> list[tuple[int, Path]]:
    """(step, path) of every complete checkpoint under ``run_dir/checkpoints`` (a ``.tmp``
    directory left by an interrupted save, or a ``.damaged`` one, is never one), newest first."""
    return sorted(
        (
            (int(m.group(1)), p.parent)
            for p in Path(run_dir, "checkpoints").glob(f"step_*/{STATE}")
            if (m := _STEP_DIR.fullmatch(p.parent.name))
        ),
        reverse=True,
    )


def complete(run_dir: str | Path) -> list[Path]:
    """Every complete checkpoint under ``run_dir/checkpoints``, newest first."""
    return [path for _, path in _complete(run_dir)]


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The complete checkpoint of the highest step under ``run_dir/checkpoints``."""
    done = complete(run_dir)
    return done[0] if done else None


def _digest(path: Path) -> str:
    import blake3  # a dependency of vLLM; several GB/s on every core

    return blake3.blake3(max_threads=blake3.blake3.AUTO).update_mmap(path).hexdigest()


def write_checksums(directory: Path) -> None:
    """Record the size and blake3 of every file under ``directory`` in ``checksums.json``."""
    files = sorted(p for p in directory.rglob("*") if p.is_file() and p.name != CHECKSUMS)
    sums = {
        str(p.relative_to(directory)): {"bytes": p.stat().st_size, "blake3": _digest(p)}
        for p in files
    }
    write_json(directory / CHECKSUMS, {"files": sums})


def damage(path: Path) -> list[str] | None:
    """What differs in checkpoint ``path`` from its ``checksums.json``, one phrase per file
    (``[]``: intact); None when it has none (written before polyrl recorded them)."""
    sums = path / CHECKSUMS
    if not sums.is_file():
        return None
    try:
        files = json.loads(sums.read_text())["files"]
    except (ValueError, KeyError) as e:
        return [f"{CHECKSUMS}: unreadable ({e})"]
    found = []
    for name, want in files.items():
        file = path / name
        if not file.is_file():
            found.append(f"{name}: missing")
        elif (size := file.stat().st_size) != want["bytes"]:
            found.append(f"{name}: {size} bytes, {want['bytes']} were written")
        elif _digest(file) != want["blake3"]:
            found.append(f"{name}: {size} bytes as written but its blake3 checksum differs")
    return found


def _set_aside(path: Path) -> Path:
    """Rename damaged checkpoint ``path`` to a free ``step_N.damaged[.k]``: kept, never loaded."""
    aside, k = path.with_name(path.name + ".damaged"), 1
    while aside.exists():
        aside, k = path.with_name(f"{path.name}.damaged.{k}"), k + 1
    path.rename(aside)
    return aside


def resume_point(run_dir: str | Path, start_fresh: bool = False) -> Path | None:
    """The checkpoint ``--resume`` continues from: the newest one whose files match their
    checksums (cheap next to a start: run on the driver before any worker starts).

    Each damaged checkpoint newer than it is named in one warning line and moved aside to
    ``step_N.damaged``. A checkpoint without checksums (written before polyrl recorded
    them) is used unverified, as before, with a line saying so. Raises
    :class:`NoCheckpoint` when there is none (``start_fresh``: None, step 0) and
    :class:`CheckpointDamaged`, naming every damaged file, when none is intact."""
    done = _complete(run_dir)
    if not done:
        if start_fresh:
            return None
        raise NoCheckpoint(
            f"--resume: polyrl.RunConfig.run_dir={str(run_dir)!r} holds no checkpoint "
            f"(checkpoints/step_N) to continue from. Check that the gin files and --gin_param "
            f"name the run_dir the run wrote, or pass {FRESH_FLAG} to start at step 0 when "
            "there is none"
        )
    damaged = []
    for _, path in done:
        found = damage(path)
        if found is None:
            print(
                f"[resume] {path} has no {CHECKSUMS} (written before polyrl recorded "
                "checksums): its files are not verified",
                flush=True,
            )
        if not found:
            for bad, what in damaged:
                aside = _set_aside(bad)
                print(
                    f"[resume] warning: checkpoint {bad} is damaged ({'; '.join(what)}); "
                    f"kept as {aside.name}, resuming from {path}",
                    flush=True,
                )
            return path
        damaged.append((path, found))
    listed = "; ".join(f"{p.name}: {', '.join(what)}" for p, what in damaged)
    raise CheckpointDamaged(
        f"--resume: every checkpoint under {Path(run_dir, 'checkpoints')} is damaged ({listed}). "
        "Restore these files from a copy, or start afresh in a new polyrl.RunConfig.run_dir "
        "(or --overwrite, which deletes them)"
    )


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
    # A local base by its absolute path: PEFT and vLLM resolve a relative one against
    # the directory they run in, not the one the run ran in.
    base = Path(base_path)
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(base.resolve()) if base.exists() else str(base_path),
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": list(lora.target_modules),
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
    }
    write_json(out / "adapter_config.json", config)
    match_mode([out / "adapter_model.safetensors"], out / "adapter_config.json")
    return out


def write_json(path: Path, data: Any) -> None:
    """Write ``data`` as JSON and fsync it, so a file a later rename publishes is on disk."""
    with path.open("w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())


def match_mode(paths: Iterable[Path], like: Path) -> None:
    """Give ``paths`` the permission bits of ``like``, a file created the ordinary way
    (0666 less the umask). safetensors writes each file through a private temporary
    file, mode 0600, which left exported weights unreadable to anyone else."""
    mode = stat.S_IMODE(like.stat().st_mode)
    for path in paths:
        os.chmod(path, mode)


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
    write_checksums(tmp)  # every part and state file, as written
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
