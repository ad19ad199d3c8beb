"""``polyrl sweep``: Ray Tune over gin bindings, and ``polyrl report SWEEP_DIR``.

Each trial is a full ``polyrl train`` process (gin bindings are per process) started by
a Tune function trainable from the directory the user ran ``polyrl sweep`` in, so
relative gin includes and train files resolve as they do for ``polyrl train``. The
trial's Tune placement group holds one bundle for the trial driver plus its run's pools
(:func:`polyrl.cluster.placement.pool_bundles`); the run places its workers inside it, so Tune
starts as many trials as the cluster holds and a stopped trial frees its workers.

The sweep directory (``RunConfig.run_dir``)::

    sweep.json            what was swept: bindings, metric, mode, smoothing
    <NN>_<bindings>/      one polyrl run directory per trial (+ trial.json: its status)
    results.csv           the ranked table (bindings, steps, final/best/smoothed metric, status)
    best_operative_config.gin   the best trial's operative config
    curves.png            every trial's metric per step
    tune/                 Ray Tune's own state (what ``--resume`` restores)
"""

from __future__ import annotations

import csv
import functools
import io
import json
import logging
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from polyrl.cluster.placement import TRIAL_PG_ENV
from polyrl.loop.metrics import read_jsonl

__all__ = [
    "run_sweep",
    "trial_name",
    "summarize",
    "rank",
    "write_results",
    "report",
]

# The trial driver's own bundle: it only drives (its workers hold the pools' bundles).
DRIVER_BUNDLE = {"CPU": 0.01}


# ---------------------------------------------------------------- naming and the table
def _short(binding: str) -> str:
    """``actor/polyrl.OptimConfig.lr`` -> ``actor.lr``; ``polyrl.RunConfig.backend`` -> ``backend``."""
    scope, _, name = binding.rpartition("/")
    leaf = name.rsplit(".", 1)[-1]
    return f"{scope.replace('/', '.')}.{leaf}" if scope else leaf


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)


def trial_name(index: int, params: Mapping[str, Any]) -> str:
    """A trial directory named by its bindings: ``03_actor.lr=0.003_backend=jax_pjit``
    (characters other than letters, digits and ``._=+-`` become ``-``)."""
    parts = [f"{_short(k)}={_fmt(v)}" for k, v in params.items()]
    name = re.sub(r"[^A-Za-z0-9._=+-]", "-", "_".join([f"{index:02d}", *parts]))
    return name[:120]


def summarize(rows: Sequence[Mapping[str, Any]], metric: str, mode: str, k: int) -> dict:
    """steps, final, best and ``smoothed`` (mean of the last ``k`` logged values) of
    ``metric`` over a run's metrics rows; NaN where it never logged the metric."""
    values = [float(r[metric]) for r in rows if metric in r]
    if not values:
        return {"steps": len(rows), "final": math.nan, "best": math.nan, "smoothed": math.nan}
    tail = values[-k:]
    return {
        "steps": len(rows),
        "final": values[-1],
        "best": max(values) if mode == "max" else min(values),
        "smoothed": sum(tail) / len(tail),
    }


def rank(trials: Sequence[dict], mode: str) -> list[dict]:
    """Trials ordered best first by ``smoothed``; trials without a value come last."""

    def key(t: dict) -> tuple[int, float]:
        v = t["smoothed"]
        if v is None or math.isnan(v):
            return (1, 0.0)
        return (0, -v if mode == "max" else v)

    return sorted(trials, key=key)


def _trials(root: Path) -> list[dict]:
    """Every trial of the sweep in ``root``: trial.json + its metrics summary."""
    meta = json.loads((root / "sweep.json").read_text())
    out = []
    for info_path in sorted(root.glob("*/trial.json")):
        info = json.loads(info_path.read_text())
        metrics = info_path.parent / "metrics.jsonl"
        rows = read_jsonl(metrics) if metrics.exists() else []
        summary = summarize(rows, meta["metric"], meta["mode"], meta["smooth_steps"])
        out.append({**info, **summary, "dir": info_path.parent.name})
    return rank(out, meta["mode"])


def write_results(root: Path) -> Path:
    """``results.csv`` (ranked), ``curves.png`` and ``best_operative_config.gin``."""
    meta = json.loads((root / "sweep.json").read_text())
    trials = _trials(root)
    bindings = meta["bindings"]
    smoothed = f"smoothed_last_{meta['smooth_steps']}"
    path = root / "results.csv"
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(
            ["rank", "trial", *bindings, "status", "steps", "final", "best", smoothed, "error"]
        )
        for i, t in enumerate(trials, 1):
            values = [t["bindings"].get(b, "") for b in bindings]
            row = [t["final"], t["best"], t["smoothed"]]
            w.writerow([i, t["dir"], *values, t["status"], t["steps"], *row, t.get("error", "")])
    best = next((t for t in trials if not math.isnan(t["smoothed"])), None)
    if best is not None and (root / best["dir"] / "operative_config.gin").exists():
        shutil.copyfile(
            root / best["dir"] / "operative_config.gin", root / "best_operative_config.gin"
        )
    _plot(root, trials, meta["metric"], best)
    return path


def _plot(root: Path, trials: Sequence[dict], metric: str, best: dict | None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for t in trials:
        metrics = root / t["dir"] / "metrics.jsonl"
        rows = read_jsonl(metrics) if metrics.exists() else []
        points = [(r["step"], r[metric]) for r in rows if metric in r]
        if points:
            xs, ys = zip(*points)
            width = 2.5 if best is not None and t["dir"] == best["dir"] else 1.0
            ax.plot(xs, ys, lw=width, label=f"{t['dir']} ({t['status']})")
    ax.set_xlabel("step")
    ax.set_ylabel(metric)
    ax.set_title(f"{root.name}: {metric} per trial (thick: best)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(root / "curves.png", dpi=100)
    plt.close(fig)


def report(root: str | Path) -> str:
    """The ranked table of a sweep directory (``polyrl report SWEEP_DIR``)."""
    root = Path(root)
    meta = json.loads((root / "sweep.json").read_text())
    trials = _trials(root)
    out = io.StringIO()
    k = meta["smooth_steps"]
    out.write(
        f"sweep {root}: {len(trials)} trials, ranked by {meta['metric']} "
        f"({meta['mode']}, mean of the last {k} steps)\n"
    )
    out.write(
        f"{'rank':>4}  {'smoothed':>9} {'best':>9} {'final':>9} {'steps':>5}  status   trial\n"
    )
    for i, t in enumerate(trials, 1):
        out.write(
            f"{i:>4}  {t['smoothed']:9.4f} {t['best']:9.4f} {t['final']:9.4f} {t['steps']:>5}  "
            f"{t['status']:<8} {t['dir']}\n"
        )
        if t.get("error"):
            out.write(f"{'':>6}error: {t['error']}\n")
    return out.getvalue()


# ---------------------------------------------------------------- the Tune side
def _key(binding: str) -> str:
    # Tune (and Optuna through it) split config keys on "/": keep bindings flat.
    return binding.replace("/", "|")


def _binding(key: str) -> str:
    return key.replace("|", "/")


def search_space(bindings: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """SweepConfig.bindings -> Tune's param_space."""
    from ray import tune

    make = {
        "grid": lambda a: tune.grid_search(list(a)),
        "choice": lambda a: tune.choice(list(a)),
        "uniform": lambda a: tune.uniform(*a),
        "loguniform": lambda a: tune.loguniform(*a),
        "randint": lambda a: tune.randint(*a),
    }
    space = {}
    for binding, spec in bindings.items():
        ((kind, args),) = spec.items()
        space[_key(binding)] = make[kind](args)
    return space


def _pdeathsig() -> None:
    """In the trial's run process: get SIGTERM when the trial process dies (Tune kills
    a stopped trial's actor), so the run ends and frees its workers."""
    import ctypes

    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _write_json(path: Path, obj: Any) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj, indent=1, default=str))
    os.replace(tmp, path)


def _trial(
    params: dict,
    gin_files: Sequence[str],
    gin_params: Sequence[str],
    root: str,
    imports: Sequence[str],
    cwd: str,
) -> None:
    """One Ray Tune trial: ``polyrl train --resume-or-start`` with the trial's bindings (a
    restarted trial continues from its checkpoint), reporting each metrics line."""
    import ray
    from ray import tune

    bindings = {_binding(k): v for k, v in params.items()}
    ctx = tune.get_context()
    run_dir = Path(root, Path(ctx.get_trial_dir()).name)
    run_dir.mkdir(parents=True, exist_ok=True)
    info = {"bindings": bindings, "status": "running", "started": time.time()}
    _write_json(run_dir / "trial.json", info)
    cmd = [sys.executable, "-m", "polyrl.cli", "train", "--resume-or-start"]
    cmd += [a for f in gin_files for a in ("--gin_file", f)]
    for b in (*gin_params, *(f"{k} = {v!r}" for k, v in bindings.items())):
        cmd += ["--gin_param", b]
    cmd += ["--gin_param", f"polyrl.RunConfig.run_dir = {str(run_dir)!r}"]
    cmd += [a for m in imports for a in ("--import", m)]
    group = ray.util.get_current_placement_group()
    env = {**os.environ, "RAY_ADDRESS": ray.get_runtime_context().gcs_address}
    if group is not None:
        env[TRIAL_PG_ENV] = f"{group.id.hex()}:1"
    with (run_dir / "train.log").open("a") as log:
        proc = subprocess.Popen(
            cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=cwd, preexec_fn=_pdeathsig
        )
    reported, latest = 0, {}
    try:
        while True:
            done = proc.poll() is not None
            path = run_dir / "metrics.jsonl"
            rows = read_jsonl(path) if path.exists() else []
            for row in rows[reported:]:  # the latest value of every metric (val/ is sparse)
                latest |= row
                tune.report(dict(latest))
            reported = len(rows)
            if done:
                break
            time.sleep(0.5)
        if proc.returncode:
            info |= {"status": "error", "error": _last_error(run_dir / "train.log")}
            raise RuntimeError(f"trial {run_dir.name}: {info['error']} (see {run_dir}/train.log)")
        info["status"] = "done"
    finally:
        if proc.poll() is None:  # stopped by the scheduler: end the run cleanly
            info["status"] = "stopped"
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
        _write_json(run_dir / "trial.json", {**info, "ended": time.time()})


def _last_error(log: Path) -> str:
    """The run's error in one line: its first ``ERROR`` problem line (validation), else
    its last ``polyrl train:`` or ``...Error:`` line (with the next line when it ends
    with a colon)."""
    lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    problems = [ln for ln in lines if ln.startswith("ERROR ")]
    if problems:
        return problems[0][len("ERROR ") :][:500]
    for i in range(len(lines) - 1, -1, -1):
        line = lines[i]
        if line.startswith("polyrl train:") or re.search(r"\w(Error|Exception):", line):
            if line.endswith(":") and i + 1 < len(lines):
                line = f"{line} {lines[i + 1]}"
            return line[:500]
    return lines[-1][:500] if lines else "no output"


def _resources(cfg: Any) -> Any:
    """The trial's placement group: the driver's bundle + the bundles of its run's pools."""
    from ray import tune

    from polyrl.cluster.placement import pool_bundles
    from polyrl.cluster.roles import build_roles
    from polyrl.configure.launch import prepare

    cfg, spec = prepare(cfg)
    bundles, _ = pool_bundles(cfg.pools, {r.pool for r in build_roles(cfg, spec).values()})
    return tune.PlacementGroupFactory([DRIVER_BUNDLE, *bundles], strategy="PACK")


def _precheck(
    gin_files: Sequence[str], gin_params: Sequence[str], imports: Sequence[str], bindings: Mapping
) -> Any:
    """Fail the whole sweep before any trial when a swept binding names nothing (a typo);
    a bad *value* fails only its trial, which records the error. Returns the base RunConfig."""
    from polyrl.configure.launch import parse_config
    from polyrl.configure.validate import ConfigError

    # Problems that mean the binding's name is wrong (polyrl.configure.bindings' messages).
    naming = ("no configurable named", "has no parameter", "is never used", "gin syntax error")
    base, _ = parse_config(gin_files, gin_params, imports=imports)
    for binding, spec in bindings.items():
        ((_, args),) = spec.items()
        try:
            parse_config(gin_files, [*gin_params, f"{binding} = {args[0]!r}"])
        except ConfigError as e:
            named = [p for p in e.problems if any(n in p for n in naming)]
            if named:
                raise ConfigError(
                    [f"SweepConfig: swept binding {binding!r}: {p}" for p in named]
                ) from None
    return base


def _progress_callback(metric: str) -> Any:
    """Tune callback: one line per started and finished trial (Tune's tables are off)."""
    from ray.tune import Callback

    def line(trial: Any, what: str) -> None:
        result = trial.last_result or {}
        last = result.get(metric)
        shown = f", last {metric} {last:.4g}" if isinstance(last, float) else ""
        steps = result.get("training_iteration", 0)
        print(f"[sweep] {_dirname(trial)}: {what} after {steps} steps{shown}", flush=True)

    class Lines(Callback):
        def on_trial_start(self, iteration, trials, trial, **info):
            print(f"[sweep] {_dirname(trial)}: started", flush=True)

        def on_trial_complete(self, iteration, trials, trial, **info):
            line(trial, "ended")

        def on_trial_error(self, iteration, trials, trial, **info):
            line(trial, "FAILED")

    return Lines()


def run_sweep(
    gin_files: Sequence[str],
    gin_params: Sequence[str] = (),
    imports: Sequence[str] = (),
    resume: bool = False,
) -> Path:
    """``polyrl sweep``; returns the sweep directory (results.csv, curves.png, ...)."""
    import ray
    from ray import tune

    from polyrl.cluster.ray_session import init_ray
    from polyrl.configure.launch import find_gin, parse_config

    cwd = os.getcwd()
    gin_files = [str(find_gin(f)) for f in gin_files]
    sweep_cfg, _ = parse_config(gin_files, gin_params, root="polyrl.SweepConfig", imports=imports)
    bindings = sweep_cfg.bindings
    if not bindings:
        raise ValueError(
            "SweepConfig.space and SweepConfig.grid are empty: bind e.g. "
            "polyrl.SweepConfig.space = {'actor/polyrl.OptimConfig.lr': {'loguniform': [1e-4, 1e-2]}}"
        )
    base = _precheck(gin_files, gin_params, imports, bindings)
    tune_config = _tune_config(sweep_cfg)  # before Ray starts: its errors are the user's
    imports = list(base.imports)
    root = Path(base.run_dir).resolve()
    root.mkdir(parents=True, exist_ok=True)
    meta = {
        "bindings": list(bindings),
        "space": bindings,
        "metric": sweep_cfg.metric,
        "mode": sweep_cfg.mode,
        "smooth_steps": sweep_cfg.smooth_steps,
        "gin_files": gin_files,
        "gin_params": list(gin_params),
        "cwd": cwd,
    }
    _write_json(root / "sweep.json", meta)
    # Tune's own status tables and timing warnings: off (one line per trial instead).
    os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")
    logging.getLogger("ray.tune").setLevel(logging.ERROR)
    if not ray.is_initialized():
        # The machine's CPUs (or RunConfig.ray_num_cpus) for the trials' pools, plus one
        # logical CPU for the trial drivers' 0.01-CPU bundles (local Ray only).
        init_ray(
            root,
            math.ceil(base.ray_num_cpus or os.cpu_count()) + 1,
            imports,
            cache_dir=base.cache_dir,
        )
    trainable = functools.partial(
        _trial,
        gin_files=gin_files,
        gin_params=list(gin_params),
        root=str(root),
        imports=imports,
        cwd=cwd,
    )
    trainable = tune.with_resources(trainable, _resources(base))
    storage = root / "tune"
    if resume:
        if not tune.Tuner.can_restore(str(storage / "sweep")):
            raise FileNotFoundError(f"--resume: no interrupted sweep under {storage / 'sweep'}")
        tuner = tune.Tuner.restore(str(storage / "sweep"), trainable, resume_errored=False)
    else:
        tuner = tune.Tuner(
            trainable,
            param_space=search_space(bindings),
            tune_config=tune_config,
            run_config=tune.RunConfig(
                name="sweep",
                storage_path=str(storage),
                verbose=0,
                callbacks=[_progress_callback(sweep_cfg.metric)],
            ),
        )
    tuner.fit()
    _finalize(root)
    return root


def _tune_config(sweep_cfg: Any) -> Any:
    from ray import tune

    search = None
    if sweep_cfg.search == "optuna":
        import importlib.util

        if importlib.util.find_spec("optuna") is None:
            raise ValueError(
                "SweepConfig.search = 'optuna' needs the optuna package, which the CPU lock "
                "does not install: pip install optuna, or use SweepConfig.search = 'random'"
            )
        from ray.tune.search.optuna import OptunaSearch

        search = OptunaSearch()
    scheduler = None
    if sweep_cfg.scheduler == "asha":
        from ray.tune.schedulers import ASHAScheduler

        # max_t beyond any run: a trial that survives every rung ends with its run
        # (so its run finishes its summary), not by the scheduler at the last step.
        scheduler = ASHAScheduler(
            max_t=10**6,
            grace_period=sweep_cfg.grace_period,
            reduction_factor=sweep_cfg.reduction_factor,
        )
    return tune.TuneConfig(
        metric=sweep_cfg.metric,
        mode=sweep_cfg.mode,
        search_alg=search,
        scheduler=scheduler,
        num_samples=sweep_cfg.num_samples,
        max_concurrent_trials=sweep_cfg.max_concurrent_trials or None,
        trial_dirname_creator=_dirname,
    )


def _dirname(trial: Any) -> str:
    index = int(trial.trial_id.rsplit("_", 1)[-1]) if "_" in trial.trial_id else 0
    return trial_name(index, {_binding(k): v for k, v in trial.config.items()})


def _finalize(root: Path) -> None:
    """Trials the scheduler stopped while their process was killed stay "running" in
    trial.json: mark them stopped; then write the table, plot and best config."""
    for info_path in root.glob("*/trial.json"):
        info = json.loads(info_path.read_text())
        if info["status"] == "running":
            _write_json(info_path, {**info, "status": "stopped"})
    write_results(root)
