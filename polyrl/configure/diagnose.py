"""``polyrl diagnose RUN_DIR --step N``: the three-way check offline (docs/diagnosis.md).

Reads the batch the shadow check saved at step ``N`` (``<run_dir>/shadow/step_N_batch``,
``RunConfig.shadow_every``) and the weights that scored it (checkpoint ``step_<N-1>``; the
model itself for step 1), builds one engine of each backend in this process (on the
host's devices, a world of one), and

* recomputes the training backend's (the one the step's record names) and the other
  backend's log-probs and entropy of the batch, next to vLLM's sampled ones saved in it:
  the same metrics and verdict as the online check (``polyrl.observe.shadow``), printed
  beside the online ones;
* runs one update of the run's actor loss on the saved batch on both backends and prints
  each one's loss and gradient norm (before clipping).

Everything goes to ``<run_dir>/shadow/step_N_diagnose.json``.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any

__all__ = ["diagnose", "format_diagnosis", "saved_step"]


def _engine(
    backend: str, model: Any, parallel: Any, optim: Any, weights: Path | None, ckpt_backend: str
):
    from polyrl.backends import exchange
    from polyrl.backends.base import engine_on_one_device

    engine = engine_on_one_device(backend)
    engine.init(model, optim, parallel)
    if weights is None:
        return engine
    if backend == ckpt_backend:
        engine.load(str(weights))
        return engine
    with tempfile.TemporaryDirectory() as tmp:
        exchange.convert(ckpt_backend, weights, Path(tmp) / "actor")
        engine.load(str(Path(tmp) / "actor"))
    return engine


def saved_step(run_dir: str | Path, step: int) -> SimpleNamespace:
    """What the run saved for ``step``, checked: ``online`` (the shadow check's record),
    ``cfg`` and ``spec`` (the run's config), ``ckpt`` and ``ckpt_backend`` (the checkpoint
    that scored the batch and the backend that wrote it; ``None`` and ``""`` for step 1),
    ``sides`` (which backend was the training side and which the shadow at that step, as
    the step's record says) and ``batch_stem`` (the saved batch, for ``load_batch``)."""
    from polyrl.configure.launch import parse_config, prepare

    run = Path(run_dir)
    stem = run / "shadow" / f"step_{step}"
    if not stem.with_name(stem.name + "_batch.npz").exists():
        done = sorted(
            int(p.stem.split("_")[1])
            for p in run.glob("shadow/step_*.json")
            if p.stem.split("_")[1].isdigit()
        )
        raise FileNotFoundError(
            f"{run} has no shadow batch of step {step} (shadow/step_{step}_batch.npz); steps "
            f"with one: {done or 'none'} (set polyrl.RunConfig.shadow_every to save them)"
        )
    online = json.loads(stem.with_suffix(".json").read_text())
    cfg, _ = parse_config([str(run / "operative_config.gin")])
    cfg, spec = prepare(cfg)
    ckpt = run / "checkpoints" / f"step_{step - 1}"
    if step > 1 and not ckpt.is_dir():
        raise FileNotFoundError(
            f"step {step} was scored by the weights of checkpoint {ckpt}, which the run did not "
            "keep; diagnose a step right after a checkpoint (polyrl.RunConfig.save_every, "
            "keep_checkpoints) or step 1"
        )
    ckpt_backend = json.loads((ckpt / "manifest.json").read_text())["backend"] if step > 1 else ""
    # The step's own record: a run resumed on the other backend has that backend in its
    # config now, while the steps before the resume were trained by the first one.
    sides = {side: online["sides"][side] for side in ("train", "shadow")}
    return SimpleNamespace(
        online=online,
        cfg=cfg,
        spec=spec,
        ckpt=ckpt if step > 1 else None,
        ckpt_backend=ckpt_backend,
        sides=sides,
        batch_stem=stem.with_name(stem.name + "_batch"),
    )


def diagnose(run_dir: str | Path, step: int) -> dict[str, Any]:
    """The offline three-way check and one update on both backends (module docstring)."""
    import dataclasses

    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # before jax is first imported here
    from transformers import AutoTokenizer

    from polyrl.cluster.roles import build_roles
    from polyrl.config import ParallelConfig
    from polyrl.loop.async_rollout import load_batch
    from polyrl.observe import shadow

    saved = saved_step(run_dir, step)
    cfg, spec, online, sides = saved.cfg, saved.spec, saved.online, saved.sides
    batch = load_batch(saved.batch_stem)
    # The run's actor engine (model, dtype, attention, micro-batches) on one device.
    actor = build_roles(cfg, spec)["actor"]
    vocab = online.get("sampling_vocab_size")
    model = dataclasses.replace(actor.model, sampling_vocab_size=vocab)
    parallel = dataclasses.replace(actor.parallel, mesh=ParallelConfig().mesh)
    temperature = float(cfg.sampling.temperature) or 1.0
    loss = spec.make_actor_loss()
    scores, updates = {}, {}
    for side, backend in sides.items():
        engine = _engine(
            backend,
            model,
            parallel,
            cfg.actor.optim,
            None if saved.ckpt is None else saved.ckpt / "actor",
            saved.ckpt_backend,
        )
        scores[side] = engine.forward(batch, temperature=temperature, entropy=True)
        update = engine.train_step(batch, loss, temperature=temperature, entropy=spec.needs_entropy)
        updates[backend] = {"loss": float(update["loss"]), "grad_norm": float(update["grad_norm"])}
        del engine
    offline = batch.with_columns(
        {
            "old_log_probs": scores["train"]["log_probs"],
            "old_entropy": scores["train"]["entropy"],
            "shadow_log_probs": scores["shadow"]["log_probs"],
            "shadow_entropy": scores["shadow"]["entropy"],
        }
    )
    tokenizer = AutoTokenizer.from_pretrained(cfg.model_path)
    metrics, worst, verdict = shadow.compare(offline, tokenizer, cfg.shadow_tolerance)
    out = {
        "step": step,
        "weights": cfg.model_path if saved.ckpt is None else str(saved.ckpt),
        "sides": {"rollout": "vLLM", **sides},
        "online": {"metrics": online["metrics"], "odd_side": online["odd_side"]},
        "offline": {"metrics": metrics, "odd_side": verdict, "worst": worst},
        "update": updates,
    }
    path = saved.batch_stem.with_name(f"step_{step}_diagnose.json")
    path.write_text(json.dumps(out, indent=1))
    out["path"] = str(path)
    return out


def format_diagnosis(d: dict[str, Any]) -> str:
    """The table ``polyrl diagnose`` prints."""
    from polyrl.observe.shadow import PAIRS

    on, off = d["online"]["metrics"], d["offline"]["metrics"]
    sides = d["sides"]
    lines = [
        f"step {d['step']} (weights: {d['weights']}); sides: "
        + ", ".join(f"{k} = {v}" for k, v in sides.items()),
        f"  {'pair':<16} {'online mean':>12} {'offline mean':>13} {'online max':>11} {'offline max':>12}",
    ]
    for a, b in PAIRS:
        key = f"{a}_{b}"
        lines.append(
            f"  {a + '-' + b:<16} {on[f'shadow/gap_mean/{key}']:12.3g} "
            f"{off[f'shadow/gap_mean/{key}']:13.3g} {on[f'shadow/gap_max/{key}']:11.3g} "
            f"{off[f'shadow/gap_max/{key}']:12.3g}"
        )
    named = lambda s: "none" if s is None else f"{s} ({sides.get(s, s)})"  # noqa: E731
    lines.append(
        f"  side that disagrees: online {named(d['online']['odd_side'])}, "
        f"offline {named(d['offline']['odd_side'])}"
    )
    lines.append("  one update on the batch (loss, grad norm before clipping):")
    for backend, u in d["update"].items():
        lines.append(f"    {backend:<11} loss {u['loss']:.6g}  grad_norm {u['grad_norm']:.6g}")
    worst = d["offline"]["worst"][:3]
    if worst:
        lines.append(
            "  worst tokens: "
            + "; ".join(
                f"{w['token']!r} at row {w['row']} pos {w['position']} (spread {w['spread']:.3g})"
                for w in worst
            )
        )
    lines.append(f"  written: {d['path']}")
    return "\n".join(lines)
