"""The entry points' gin layer: gin files -> a frozen, validated RunConfig -> a run.

This module and polyrl/bindings.py (which names every binding problem) are the only ones
that import gin (DESIGN.md "Configuration"). The bound
dataclasses — never gin — travel to the Ray workers.

gin names (see gin/base.gin): ``RunConfig`` (the root), ``OptimConfig`` (scopes
``actor/`` and ``critic/``), ``ParallelConfig`` (scopes ``actor/``, ``reference/``,
``critic/``), ``SamplingSpec``, ``RolloutConfig``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from polyrl.config import OptimConfig, ParallelConfig, RunConfig, SweepConfig
from polyrl.user_code import import_modules, runtime_env

__all__ = ["parse_config", "prepare", "train", "sweep", "GIN_ROOT"]

GIN_ROOT = Path(__file__).resolve().parents[1] / "gin"


def _register() -> Any:
    import gin
    from polyrl.debug import DebugConfig
    from polyrl.rollout.sampling import RolloutConfig, SamplingSpec

    for cls in (
        RunConfig,
        OptimConfig,
        ParallelConfig,
        SamplingSpec,
        RolloutConfig,
        SweepConfig,
        DebugConfig,
    ):
        with contextlib.suppress(ValueError):  # already registered in this process
            gin.external_configurable(cls, module="polyrl")
    return gin


def parse_config(
    gin_files: Sequence[str],
    gin_params: Sequence[str] = (),
    root: str = "polyrl.RunConfig",
    imports: Sequence[str] = (),
) -> tuple[Any, str]:
    """Bind gin files + ``--gin_param`` overrides and build the ``root`` configurable
    (the RunConfig; the SweepConfig for a sweep).

    gin file paths are taken as given, else relative to the repository root; ``include``
    lines inside them resolve the same way. ``imports`` (``--import``) are imported
    before parsing and added to ``RunConfig.imports``, whose modules are imported too.
    """
    import_modules(imports)
    from polyrl.bindings import bind

    _register()
    search = [GIN_ROOT, GIN_ROOT.parent]
    cfg, operative = bind([_find_gin(f) for f in gin_files], gin_params, root, search)
    if isinstance(cfg, RunConfig):
        cfg = dataclasses.replace(cfg, imports=tuple(dict.fromkeys((*cfg.imports, *imports))))
        import_modules(cfg.imports)
        if cfg.debug is None:  # polyrl.DebugConfig bindings, without a RunConfig.debug line
            import gin

            cfg = dataclasses.replace(cfg, debug=gin.get_configurable("polyrl.DebugConfig")())
    return cfg, operative


def _find_gin(name: str) -> Path:
    """A gin file as given, else relative to the repository root; absolute."""
    for path in (Path(name), GIN_ROOT.parent / name):
        if path.exists():
            return path.resolve()
    raise FileNotFoundError(f"--gin_file {name!r} not found (looked in . and {GIN_ROOT.parent})")


def prepare(cfg: RunConfig) -> tuple[RunConfig, Any]:
    """Fill defaults that need the file system (the tiny model) and run every
    validate-config check (``polyrl.validate.preflight``); print its warnings."""
    from polyrl.validate import preflight

    cfg, spec, warnings, _ = preflight(cfg)
    for warning in warnings:
        print(f"[polyrl] warning: {warning}", flush=True)
    return cfg, spec


def _components(cfg: RunConfig, spec: Any) -> SimpleNamespace:
    import ray
    from transformers import AutoTokenizer

    from polyrl.data.loader import PairSource, PromptSource
    from polyrl.debug import DebugSession
    from polyrl.evaluation import validation_prompts
    from polyrl.placement import Placement
    from polyrl.roles import build_roles
    from polyrl.rollout import RolloutPool

    tokenizer = AutoTokenizer.from_pretrained(cfg.model_path)
    kw = {
        "seed": cfg.seed,
        "max_prompt_tokens": cfg.rollout.prompt_limit,
        "overlong": cfg.rollout.overlong_prompt,
    }
    source = PromptSource if spec.objective == "rl" else PairSource
    prompts = (
        source.from_files(cfg.train_files, tokenizer, **kw)
        if cfg.train_files
        else source.from_task(cfg.task, cfg.n_train_prompts, tokenizer, **kw)
    )
    val_prompts = validation_prompts(cfg, tokenizer, **kw) if spec.objective == "rl" else None
    if not ray.is_initialized():
        # A local start gets the pools' CPUs plus RunConfig.user_cpus for the user's own tasks.
        pool_cpus = sum(float(r.get("CPU", 0)) for r in cfg.pools.values())
        init_ray(cfg.ray_num_cpus or pool_cpus + cfg.user_cpus, cfg.imports, cfg.debug)
    debug = DebugSession.start(cfg.debug)
    roles = build_roles(cfg, spec)
    placement = Placement(cfg.pools, roles)
    pool = None
    if spec.objective == "rl":
        share = placement.shares["rollout"]
        pool = RolloutPool(
            dataclasses.replace(cfg.rollout, num_cpus=share.num_cpus, num_gpus=share.num_gpus),
            placement=lambda i: placement.options("rollout", i),
        )
    return SimpleNamespace(
        tokenizer=tokenizer,
        prompts=prompts,
        val_prompts=val_prompts,
        pool=pool,
        placement=placement,
        roles=roles,
        debug=debug,
    )


def init_ray(num_cpus: float | None, imports: Sequence[str] = (), debug: Any = None) -> None:
    """Join the Ray cluster named by ``RAY_ADDRESS`` (``host:port`` of a ``ray start
    --head``, or ``auto``: docs/scaling.md), else start a private local one of
    ``num_cpus`` CPUs (never a cluster some other ``ray start`` left on the machine)."""
    import ray

    address = os.environ.get("RAY_ADDRESS", "local")
    local = {"num_cpus": num_cpus} if address == "local" else {}
    env = runtime_env(imports)
    if debug is not None and debug.enabled:  # docs/debugging.md
        env["env_vars"].update(debug.env())
        os.environ.setdefault("RAY_DEDUP_LOGS", "0")  # every log point's line, each step
        local |= {"dashboard_host": debug.host} if address == "local" else {}
    ray.init(
        address=address,
        include_dashboard=bool(debug and debug.enabled),
        log_to_driver=True,
        runtime_env=env,
        **local,
    )


def train(
    gin_files: Sequence[str],
    gin_params: Sequence[str] = (),
    resume: bool = False,
    on_step: Any = None,
    imports: Sequence[str] = (),
    debug: bool = False,
) -> dict:
    """``polyrl train``: parse, validate, write the operative config, run. ``debug``
    (``--debug``): Ray's distributed debugger in every role (docs/debugging.md)."""
    from polyrl.checkpoints import check_resumable, latest_checkpoint, run_manifest
    from polyrl.debug import for_debugging
    from polyrl.reliability import check_free_space, check_run_dir
    from polyrl.trainer import PreferenceTrainer, RLTrainer

    cfg, operative = parse_config(gin_files, gin_params, imports=imports)
    check_run_dir(cfg.run_dir)  # before anything is written or started
    cfg, spec = prepare(for_debugging(cfg, debug))
    check_free_space(cfg, spec)
    if resume:  # a checkpoint of another backend/algorithm/model fails before workers start
        check_resumable(latest_checkpoint(cfg.run_dir), run_manifest(cfg, spec))
    run_dir = Path(cfg.run_dir)
    (run_dir / "operative_config.gin").write_text(operative)
    print(
        f"[polyrl] run {run_dir}: {spec.name} on {cfg.backend}, model {cfg.model_path}", flush=True
    )
    loop = RLTrainer if spec.objective == "rl" else PreferenceTrainer
    from polyrl.health import watch_pending

    components = _components(cfg, spec)
    trainer = loop(cfg, spec, components)
    pending = watch_pending(cfg.user_cpus)
    try:
        return trainer.run(resume=resume, on_step=on_step)
    finally:
        pending.set()
        trainer.shutdown()
        if components.debug is not None:
            components.debug.close()


def _trial(
    params: dict,
    gin_files: Sequence[str],
    gin_params: Sequence[str],
    root: str,
    imports: Sequence[str],
    cwd: str,
) -> None:
    """One Ray Tune trial: ``polyrl train`` with the trial's gin bindings, in its own
    process (gin bindings are per process, and a trial's workers must not be captured
    by the trial's placement group). It joins the sweep's Ray cluster as a new driver;
    each line its run appends to metrics.jsonl is reported to Tune."""
    import subprocess
    import time

    import ray
    from ray import tune

    from polyrl.metrics import read_jsonl

    trial_dir = Path(root, f"trial_{tune.get_context().get_trial_id()}")
    bindings = [
        *gin_params,
        *(f"{k} = {v!r}" for k, v in params.items()),
        f"polyrl.RunConfig.run_dir = {str(trial_dir)!r}",
    ]
    cmd = [sys.executable, "-m", "polyrl.cli", "train"]
    cmd += [a for f in gin_files for a in ("--gin_file", f)]
    cmd += [a for b in bindings for a in ("--gin_param", b)]
    cmd += [a for m in imports for a in ("--import", m)]
    trial_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "RAY_ADDRESS": ray.get_runtime_context().gcs_address}
    log = (trial_dir / "train.log").open("w")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=cwd)
    reported, latest = 0, {}
    while True:
        done = proc.poll() is not None
        path = trial_dir / "metrics.jsonl"
        rows = read_jsonl(path) if path.exists() else []
        for row in rows[reported:]:  # the latest value of every metric (val/ is sparse)
            latest |= row
            tune.report(dict(latest))
        reported = len(rows)
        if done:
            break
        time.sleep(1.0)
    log.close()
    if proc.returncode:
        tail = (trial_dir / "train.log").read_text()[-3000:]
        raise RuntimeError(
            f"trial run exited with {proc.returncode}; end of {trial_dir / 'train.log'}:\n{tail}"
        )


def sweep(
    gin_files: Sequence[str], gin_params: Sequence[str] = (), imports: Sequence[str] = ()
) -> Any:
    """``polyrl sweep``: grid-search ``SweepConfig.grid`` with Ray Tune; returns the
    ResultGrid. Each trial parses the gin files itself (gin bindings are per process)
    and is checked by ``validate-config`` rules before Tune starts."""
    import functools

    import ray
    from ray import tune

    # Tune runs trials in their own working directories: pass absolute gin paths.
    gin_files = [str(_find_gin(f)) for f in gin_files]
    sweep_cfg, _ = parse_config(gin_files, gin_params, root="polyrl.SweepConfig", imports=imports)
    if not sweep_cfg.grid:
        raise ValueError(
            "SweepConfig.grid is empty: bind e.g. "
            "polyrl.SweepConfig.grid = {'actor/polyrl.OptimConfig.lr': [1e-3, 3e-3]}"
        )
    base, _ = parse_config(gin_files, gin_params, imports=imports)
    root = Path(base.run_dir).resolve()
    for combo in _grid(sweep_cfg.grid):  # fail before any trial starts
        cfg, _ = parse_config(gin_files, [*gin_params, *(f"{k} = {v!r}" for k, v in combo.items())])
        prepare(dataclasses.replace(cfg, run_dir=str(root / "validate")))
    if not ray.is_initialized():
        # Logical CPUs: each concurrent trial's pools, plus a sliver per trial driver.
        pool_cpus = sum(float(r.get("CPU", 0)) * r.get("nodes", 1) for r in base.pools.values())
        init_ray(base.ray_num_cpus or pool_cpus * sweep_cfg.max_concurrent_trials + 1, base.imports)
    trainable = functools.partial(
        _trial,
        gin_files=list(gin_files),
        gin_params=list(gin_params),
        root=str(root),
        imports=list(base.imports),
        cwd=os.getcwd(),
    )
    # The trial process only drives: its workers reserve the pool's resources themselves.
    trainable = tune.with_resources(trainable, {"cpu": 0.01})
    tuner = tune.Tuner(
        trainable,
        param_space={k: tune.grid_search(list(v)) for k, v in sweep_cfg.grid.items()},
        tune_config=tune.TuneConfig(
            metric=sweep_cfg.metric,
            mode=sweep_cfg.mode,
            num_samples=sweep_cfg.num_samples,
            max_concurrent_trials=sweep_cfg.max_concurrent_trials,
        ),
        run_config=tune.RunConfig(name="sweep", storage_path=str(root / "tune")),
    )
    return tuner.fit()


def _grid(grid: dict) -> list[dict]:
    import itertools

    keys = list(grid)
    return [dict(zip(keys, values)) for values in itertools.product(*(grid[k] for k in keys))]
