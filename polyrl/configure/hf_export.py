"""``polyrl export``: a run's checkpoint of either backend as a Hugging Face directory.

:func:`export_checkpoint` reads the checkpoint's manifest (which backend wrote it, the
model shape) and the run's ``operative_config.gin`` (``model_path``), loads the actor's
checkpoint into that backend's engine in this process and writes its ``export_weights``
with ``polyrl.backends.hf_dir.write_hf``, the writer the runs' own exports
(``RunConfig.export_every`` / ``export_final``, ``polyrl.cluster.workers.EngineWorker.export_hf``)
and the torch engine's ``save_hf`` use. Framework imports are lazy.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from polyrl.backends.hf_dir import write_hf

__all__ = ["export_checkpoint", "read_run_config"]


def read_run_config(run_dir: str | Path) -> Any:
    """The RunConfig a run was started with (its ``operative_config.gin``)."""
    from polyrl.configure.launch import parse_config

    gin_file = Path(run_dir, "operative_config.gin")
    if not gin_file.is_file():
        raise FileNotFoundError(
            f"{gin_file} does not exist: is {run_dir} a polyrl run directory (polyrl train "
            "writes it at the start of every run)?"
        )
    cfg, _ = parse_config([str(gin_file)])
    return cfg


def export_checkpoint(
    run_dir: str | Path,
    out_dir: str | Path,
    step: int | None = None,
    adapters_only: bool = False,
) -> Path:
    """``polyrl export``: load the actor of checkpoint ``step`` (default: the latest) of
    ``run_dir`` into the backend that wrote it (read from the checkpoint's manifest) and
    write its weights as an HF directory at ``out_dir`` (a LoRA run's merged weights), or
    with ``adapters_only`` a LoRA run's adapters as a PEFT adapter directory. A
    reward-model run (algorithm ``reward_model``) has no actor: its critic is written, as
    a sequence classifier the reward_model role loads. Returns the checkpoint loaded.

    The engine runs in this process on one device (the checkpoint's sharding is
    resharded on load); the model's config and tokenizer come from the run's
    ``RunConfig.model_path`` (None: the tiny model under ``run_dir/models``), checked
    against the manifest's model shape.
    """
    from polyrl import checkpoints
    from polyrl.algos import get_algorithm
    from polyrl.backends.base import engine_on_one_device
    from polyrl.config import ModelConfig, ParallelConfig
    from polyrl.role_table import exported_role

    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"run directory {str(run_dir)!r} does not exist")
    if step is None:
        path = checkpoints.latest_checkpoint(run_dir)
        if path is None:
            raise FileNotFoundError(
                f"{run_dir}/checkpoints has no complete checkpoint: the run saved none "
                "(polyrl.RunConfig.save_every); its final weights are in "
                f"{run_dir}/hf when it ran with polyrl.RunConfig.export_final"
            )
    else:
        path = run_dir / "checkpoints" / f"step_{step}"
        if not (path / checkpoints.STATE).is_file():
            have = sorted(p.name for p in (run_dir / "checkpoints").glob("step_*"))
            raise FileNotFoundError(
                f"--step {step}: {path} is not a complete checkpoint; the run has {have}"
            )
    if found := checkpoints.damage(path):  # as --resume checks it, before any engine loads it
        others = [f"--step {p.name.removeprefix('step_')}" for p in checkpoints.complete(run_dir)]
        others.remove(f"--step {path.name.removeprefix('step_')}")
        raise checkpoints.CheckpointDamaged(
            f"checkpoint {path} is damaged ({'; '.join(found)}): restore its files from a "
            f"copy, or export another checkpoint of the run ({', '.join(others) or 'none'})"
        )
    manifest = json.loads((path / checkpoints.MANIFEST).read_text())
    cfg = read_run_config(run_dir)
    if adapters_only and cfg.lora is None:
        raise ValueError(
            f"--adapters-only: the run {str(run_dir)!r} trained no LoRA adapters "
            "(polyrl.RunConfig.lora is None); export its full weights without the flag"
        )
    model_path = cfg.model_path
    if model_path is None:  # the run trained the tiny model it built (polyrl.configure.validate)
        from polyrl.data.tiny import ensure_tiny_model

        model_path = str(ensure_tiny_model(run_dir / "models", cfg.tiny_model))
    if not Path(model_path, "config.json").is_file():
        raise FileNotFoundError(
            f"the run's polyrl.RunConfig.model_path={cfg.model_path!r} (its config and "
            "tokenizer) is not a local Hugging Face directory here"
        )
    checkpoints.check_manifest(manifest, {"model": checkpoints.model_shape(model_path)}, str(path))
    # A reward-model run trained the critic (a value head), exported as a classifier.
    role = exported_role(get_algorithm(cfg.algorithm))
    model = ModelConfig(path=model_path, role=role, dtype=cfg.model_dtype, lora=cfg.lora)
    engine = engine_on_one_device(manifest["backend"])
    engine.init(model, cfg.role_config(role).optim, ParallelConfig())
    engine.load(str(path / role))
    if adapters_only:
        engine.save_adapters(str(out_dir))
    else:
        write_hf(
            engine.export_weights(1 << 30), model_path, out_dir, value_head=model.has_value_head
        )
    return path
