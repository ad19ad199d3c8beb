"""The entry points' gin layer: gin files -> a frozen, validated RunConfig -> a run.

This module and polyrl/configure/bindings.py (which names every binding problem) are the only ones
that import gin (docs/design.md "Configuration"). The bound
dataclasses — never gin — travel to the Ray workers.

gin names (see gin/base.gin): ``RunConfig`` (the root), ``RoleConfig`` (one per engine
role, scopes ``actor/``, ``reference/``, ``teacher/``, ``critic/``, ``reward_model/``,
``shadow/``) with
its ``ParallelConfig`` and ``OptimConfig`` (built in the role's scope), ``LoraConfig``,
``SamplingSpec``, ``RolloutConfig``, ``TinyModelSpec``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import sys
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from polyrl.cluster.user_code import import_modules
from polyrl.config import (
    LoraConfig,
    OptimConfig,
    ParallelConfig,
    RoleConfig,
    RunConfig,
    SweepConfig,
    TinkerConfig,
)

__all__ = ["parse_config", "prepare", "train", "find_gin", "init_run_ray", "GIN_ROOT"]

GIN_ROOT = Path(__file__).resolve().parents[2] / "gin"


def _quiet_gin_lookups(record: logging.LogRecord) -> bool:
    """gin logs ``ERROR:root:Path not found`` for every search path it tries before the
    one that has an include: normal lookups, not errors (a missing file still raises)."""
    return not str(record.msg).startswith("Path not found")


def _register() -> Any:
    import gin

    if _quiet_gin_lookups not in logging.getLogger().filters:
        logging.getLogger().addFilter(_quiet_gin_lookups)
    from polyrl.data.tiny import TinyModelSpec
    from polyrl.envs import EpisodeConfig
    from polyrl.loop.judge import JudgeConfig
    from polyrl.observe.debug import DebugConfig
    from polyrl.rollout.sampling import RolloutConfig, SamplingSpec

    for cls in (
        RunConfig,
        OptimConfig,
        ParallelConfig,
        RoleConfig,
        LoraConfig,
        SamplingSpec,
        RolloutConfig,
        SweepConfig,
        DebugConfig,
        TinyModelSpec,
        EpisodeConfig,
        JudgeConfig,
        TinkerConfig,
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
    from polyrl.configure.bindings import bind

    _register()
    search = [GIN_ROOT, GIN_ROOT.parent]
    cfg, operative = bind([find_gin(f) for f in gin_files], gin_params, root, search)
    if isinstance(cfg, RunConfig):
        cfg = dataclasses.replace(cfg, imports=tuple(dict.fromkeys((*cfg.imports, *imports))))
        import_modules(cfg.imports)
    return cfg, operative


def find_gin(name: str) -> Path:
    """A gin file as given, else relative to the repository root; absolute."""
    for path in (Path(name), GIN_ROOT.parent / name):
        if path.exists():
            return path.resolve()
    raise FileNotFoundError(f"--gin_file {name!r} not found (looked in . and {GIN_ROOT.parent})")


def prepare(cfg: RunConfig, reward_rows: dict | None = None) -> tuple[RunConfig, Any]:
    """Fill defaults that need the file system (the tiny model) and run every
    validate-config check (``polyrl.configure.validate.preflight``; ``reward_rows``: score the
    rewards later); print its warnings."""
    from polyrl.configure.validate import preflight

    cfg, spec, warnings, _ = preflight(cfg, reward_rows)
    for warning in warnings:
        print(f"[polyrl] warning: {warning}", flush=True)
    return cfg, spec


def init_run_ray(cfg: RunConfig, copy_logs: bool = True, namespace: str | None = None) -> None:
    """The run's Ray (``polyrl.cluster.ray_session.init_ray``): a local start gets the
    pools' CPUs plus RunConfig.user_cpus for the user's own tasks. ``namespace``: Ray's
    (a warm session's host: ``polyrl.cluster.session``)."""
    from polyrl.cluster.ray_session import init_ray

    pool_cpus = sum(float(r.get("CPU", 0)) for r in cfg.pools.values())
    cpus = cfg.ray_num_cpus or pool_cpus + cfg.user_cpus
    init_ray(
        cfg.run_dir,
        cpus,
        cfg.imports,
        cfg.debug,
        cfg.cache_dir,
        copy_logs=copy_logs,
        namespace=namespace,
    )


def _checks_beside_ray(
    cfg: RunConfig, startup: Any, checks: Any, warm: Any = None
) -> tuple[Any, bool, Any]:
    """``checks()`` (every check before a worker starts) on a thread of their own while
    a local Ray starts on this one (after a ray.init on another thread, ray.shutdown took
    15 s instead of 1.3 s): on the idle 2-core machine, 2.7 s and 2.3-3.3 s one after the
    other, 3.6-4.6 s side by side (issue 48). No worker starts before both are done; a
    run the checks refuse leaves no Ray behind. Start-up phases:
    "ray" (its start), then "checks" (what is left of them). With a warm session to
    attach to (``warm``: ``polyrl.cluster.session.up``), this thread joins its Ray
    instead (the phase "attach"; its own Ray if that fails). Joining a cluster
    (``RAY_ADDRESS``: after the checks, as before) or a Ray already running: the checks
    alone. Returns their result, whether Ray was started here and the session joined."""
    if _joins_ray():
        with startup.phase("checks"):
            return checks(), False, None
    from polyrl.cluster import session

    pool = ThreadPoolExecutor(1, thread_name_prefix="polyrl-checks")
    checked = pool.submit(checks)
    pool.shutdown(wait=False)
    try:
        if warm is not None:
            with startup.phase("attach"):
                warm = session.connect(warm, cfg)
        if warm is None:
            with startup.phase("ray"):
                init_run_ray(cfg, copy_logs=False)
        with startup.phase("checks"):  # what is left of them
            return checked.result(), warm is None, warm
    except BaseException:
        import ray

        ray.shutdown()
        session.release()
        raise


def _joins_ray() -> bool:
    """Whether the run joins a Ray it did not start: ``RAY_ADDRESS`` (a cluster, a sweep's
    trial; ``local`` is a start of its own) or one already initialised in this process (a
    test, a notebook)."""
    ray = sys.modules.get("ray")
    joins = os.environ.get("RAY_ADDRESS", "local") != "local"
    return joins or (ray is not None and ray.is_initialized())


def servers(placement: Any, role: str, config: Any, wait: bool = True) -> Any:
    """A RolloutPool of ``role`` (the rollout, a judge) on its share of the run's pools
    (``placement``: a ``polyrl.cluster.placement.Placement``); ``wait``: as RolloutPool's."""
    from polyrl.rollout import RolloutPool

    share = placement.shares[role]
    return RolloutPool(
        dataclasses.replace(config, num_cpus=share.num_cpus, num_gpus=share.num_gpus),
        placement=lambda i: placement.options(role, i),
        wait=wait,
    )


def _components(
    cfg: RunConfig, spec: Any, reward_rows: dict | None = None, startup: Any = None
) -> SimpleNamespace:
    """The run's data, Ray, rollout pool (and an LLM judge's own) and placement. ``reward_rows``: the rows whose
    rewards ``prepare`` left to score once Ray runs; ``startup``: the run's StartupLog."""
    import ray

    from polyrl.cluster.placement import Placement, trial_placement
    from polyrl.cluster.roles import build_roles
    from polyrl.configure.validate import raise_if_problems, reward_problems
    from polyrl.data.loader import source_for
    from polyrl.data.tokenizer import load_tokenizer
    from polyrl.loop.evaluation import validation_prompts
    from polyrl.loop.metrics import StartupLog
    from polyrl.observe.debug import DebugSession
    from polyrl.role_table import Role

    startup = startup or StartupLog()
    tokenizer = load_tokenizer(cfg.model_path, cfg.cache_dir)
    from polyrl.configure.validate import row_limit

    kw = {
        "seed": cfg.seed,
        "max_prompt_tokens": row_limit(cfg, spec)[0],
        "overlong": cfg.rollout.overlong_prompt,
    }
    source = source_for(spec.data_kind)
    prompts = (
        source.from_files(cfg.train_files, tokenizer, **kw)
        if cfg.train_files
        else source.from_task(cfg.task, cfg.n_train_prompts, tokenizer, **kw)
    )
    val_prompts = validation_prompts(cfg, tokenizer, source, **kw) if spec.evaluates else None
    if not ray.is_initialized():
        with startup.phase("ray"):
            init_run_ray(cfg)
    # Each reward on a few rows, before any worker starts (here: a reward may use Ray).
    raise_if_problems(reward_problems(reward_rows or {}, cfg.reward_timeout_s))
    debug = DebugSession.start(cfg.debug)
    roles = build_roles(cfg, spec)
    placement = Placement(cfg.pools, roles, reserved=trial_placement())
    pool = judge_pool = None
    # vLLM starts while the trainer starts its roles; RLTrainer waits for it after
    if spec.objective == "rl":
        with startup.phase("rollout servers"):
            pool = servers(placement, Role.ROLLOUT, cfg.rollout, wait=False)
    if Role.JUDGE in roles:  # JudgeConfig.model_path: the judge's own servers
        with startup.phase("judge servers"):
            judge_pool = servers(placement, Role.JUDGE, cfg.judge.servers(cfg.rollout), False)
    return SimpleNamespace(
        tokenizer=tokenizer,
        prompts=prompts,
        val_prompts=val_prompts,
        pool=pool,
        judge_pool=judge_pool,
        placement=placement,
        roles=roles,
        debug=debug,
        startup=startup,
    )


def train(
    gin_files: Sequence[str],
    gin_params: Sequence[str] = (),
    resume: bool = False,
    on_step: Any = None,
    imports: Sequence[str] = (),
    debug: bool = False,
    overwrite: bool = False,
    resume_or_start: bool = False,
    use_session: bool = True,
) -> dict:
    """``polyrl train``: parse, validate, write the operative config, run. ``debug``
    (``--debug``): Ray's distributed debugger in every role (docs/debugging.md).
    A run_dir that holds metrics or checkpoints needs ``resume`` (continue it) or
    ``overwrite`` (delete its outputs once the checks pass). ``resume`` refuses a run_dir
    with no checkpoint; ``resume_or_start`` (``--resume-or-start``) starts it at step 0.
    ``use_session`` (off: ``--no-session``): attach to the warm session that is up and
    fits the run (``polyrl.cluster.session``; never when the run joins a Ray it did not
    start)."""
    from polyrl.checkpoints import check_resumable, resume_point, run_manifest
    from polyrl.cluster import session
    from polyrl.cluster.ray_session import copy_worker_logs
    from polyrl.cluster.reliability import (
        check_free_space,
        check_fresh_run_dir,
        check_run_dir,
        clear_run_outputs,
        interrupt_message,
    )
    from polyrl.loop.metrics import StartupLog
    from polyrl.loop.trainer import LOOPS
    from polyrl.observe.debug import for_debugging

    startup = StartupLog()  # from here to the first step (docs/training.md "Output")
    cfg, operative = parse_config(gin_files, gin_params, imports=imports)
    with interrupt_message(cfg.run_dir):  # Ctrl-C: how to continue
        check_run_dir(cfg.run_dir)  # before anything is written or started
        resume = resume or resume_or_start
        check_fresh_run_dir(cfg.run_dir, resume, overwrite)
        # The checkpoint to continue from, its files checked against their checksums (a
        # damaged one is named and set aside): before the checks and any worker start.
        start = resume_point(cfg.run_dir, start_fresh=resume_or_start) if resume else None
        cfg = for_debugging(cfg, debug)
        reward_rows: dict = {}

        def checks() -> tuple[RunConfig, Any]:
            checked, spec = prepare(cfg, reward_rows)
            check_free_space(checked, spec)
            # a checkpoint of another backend/algorithm/model fails before workers start
            check_resumable(start, run_manifest(checked, spec))
            return checked, spec

        warm = session.up() if use_session and not _joins_ray() else None
        (cfg, spec), ray_started, warm = _checks_beside_ray(cfg, startup, checks, warm)
        if warm is not None:
            with startup.phase("attach"):  # (one that does not fit disconnects: its own Ray)
                warm = session.attach(warm, cfg, spec)
        run_dir = Path(cfg.run_dir)
        if overwrite and (gone := clear_run_outputs(run_dir)):
            print(f"[polyrl] --overwrite: deleted {', '.join(gone)} in {run_dir}", flush=True)
        (run_dir / "operative_config.gin").write_text(operative)
        print(
            f"[polyrl] run {run_dir}: {spec.name} on {cfg.backend}, model {cfg.model_path}",
            flush=True,
        )
        if ray_started or warm:  # into the run dir, now that --overwrite has cleared it
            copy_worker_logs(cfg.run_dir, cfg.debug, warm.job if warm else None)
        loop = LOOPS[spec.objective]
        from polyrl.observe.health import watch_pending

        try:
            with session.attached() if warm else contextlib.nullcontext():
                components = _components(cfg, spec, reward_rows, startup)
                components.session = warm
                trainer = loop(cfg, spec, components)
            pending = watch_pending(cfg.user_cpus)
            try:
                return trainer.run(resume=resume, on_step=on_step)
            finally:
                pending.set()
                trainer.shutdown()
                if components.debug is not None:
                    components.debug.close()
        finally:
            session.release()  # (an attached run: the next may attach)
