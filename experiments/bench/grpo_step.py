"""Benchmark: GRPO step time with its phase breakdown, from a real ``polyrl train`` run.

Runs ``polyrl train`` on ``--gin`` (plus any ``--gin_param``) in a subprocess, reads the
run's ``metrics.jsonl`` and prints, per phase, the mean seconds over the steps after the
first ``--skip`` (warm-up: compilation, CUDA graphs, first allocations), the step time
and the framework overhead (``time/overhead``: the step time outside every compute phase
of ``polyrl.loop.trainer.COMPUTE_PHASES``: generation, forward passes, training), each beside
its goal (issue 11: overhead <= 2% of the step; step <= 15 s for the shipped experiment
on one H200), and the actor update's MFU (:func:`update_flops`). The limits to read the compute phases against are measured by
``train_step.py`` (training alone) and ``rollout.py`` (vLLM alone on the same rollout);
writes everything to ``--json``. ``--profile DIR`` keeps the run's ``timeline.json``
(every phase of every role as spans; ui.perfetto.dev) in DIR and prints each phase's share
of the measured steps; it also runs one step more, recorded by each trainer worker's
framework profiler (``RunConfig.profile_steps``) and left out of the means (the profiler
slows a host-bound step): the traces go to ``DIR/ops/``, each worker's top ops and the
profiled step's time are printed. A run past ``--timeout`` is stopped, measured over the
steps it finished, and its driver's thread stacks at the stop (Python's fault handler)
end its log, whose tail goes to stderr: where a run that hangs waits.

    python experiments/bench/grpo_step.py --steps 4                        # tiny, CPU
    python experiments/bench/grpo_step.py --gin gin/experiments/gpu_grpo_0p5b.gin \\
        --gin_param "polyrl.RunConfig.model_path = '/tmp/models/qwen2-0.5b-random'" \\
        --backend jax_pjit --json grpo_jax.json --profile prof/          # one GPU
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from polyrl.loop.trainer import COMPUTE_PHASES

sys.path.insert(0, str(Path(__file__).resolve().parent))
from profiling import format_top, phase_table  # noqa: E402
from train_step import PEAK_TFLOPS, train_flops  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gin", default="gin/experiments/tiny_grpo.gin")
    p.add_argument("--gin_param", action="append", default=[], help="extra gin binding")
    p.add_argument("--backend", choices=["torch_fsdp", "jax_pjit"], help="swap the backend")
    p.add_argument("--steps", type=int, default=4, help="timed steps, the --skip ones included")
    p.add_argument("--skip", type=int, default=1, help="warm-up steps left out of the means")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--log", help="write the training run's output here")
    p.add_argument("--json", help="write the result here")
    p.add_argument("--profile", metavar="DIR", help="keep the timeline here; profile one more step")
    return p.parse_args(argv)


# Issue 11's goals for the shipped GRPO experiment (gin/experiments/gpu_grpo_0p5b.gin).
GOALS = {"overhead_fraction": 0.02, "step_s": 15.0}


def summarise(rows: list[dict], skip: int) -> dict:
    """Mean seconds per phase and per step over ``rows[skip:]``, the overhead, and
    whether each goal is met."""
    timed = [r for r in rows if "time/step" in r][skip:]
    if not timed:
        raise SystemExit(f"no step after the first {skip} in metrics.jsonl; raise --steps")
    totals = {"step", "overhead"}
    names = sorted({k[5:] for r in timed for k in r if k.startswith("time/")} - totals)
    phases = {n: statistics.mean(r.get(f"time/{n}", 0.0) for r in timed) for n in names}
    step = statistics.mean(r["time/step"] for r in timed)
    if all("time/overhead" in r for r in timed):
        overhead = statistics.mean(r["time/overhead"] for r in timed)
    else:  # a run from before time/overhead: its phases never overlapped
        overhead = step - sum(t for n, t in phases.items() if n in COMPUTE_PHASES)
    return {
        "steps_averaged": len(timed),
        "step_s": step,
        "phases_s": phases,
        "overhead_s": overhead,
        "overhead_fraction": overhead / step,
        "goals": GOALS,
        "meets": {
            "overhead_fraction": overhead / step <= GOALS["overhead_fraction"],
            "step_s": step <= GOALS["step_s"],
        },
    }


def rollout_limits(first_row: dict) -> dict[str, int]:
    """The scheduler limits the run's rollout engines ran at (step 1's row: read back from
    the servers), ``max_num_seqs`` and ``max_num_batched_tokens``; empty without a rollout."""
    keys = ("max_num_seqs", "max_num_batched_tokens")
    return {k: int(first_row[f"rollout/{k}"]) for k in keys if f"rollout/{k}" in first_row}


def update_flops(model_config: dict, tokens: float, rows: int, lora: bool) -> float:
    """The actor update's FLOPs for one pass over a step's ``rows`` rows of ``tokens``
    real tokens in all (the ``batch/tokens`` metric): ``train_step.train_flops``, i.e.
    6 x parameters x tokens for the matmuls (forward 2, backward 4: the activations' and
    the weights' gradients), 4 x with LoRA (the frozen base gets no weight gradients but
    the activations' gradients still flow through it; the adapters' own FLOPs, under 1%
    at rank 16, are left out), plus 12 x layers x hidden x length^2 per row for
    attention. Recomputation under activation checkpointing is not counted (MFU, not
    HFU). The rows are taken as equally long (the mean): exact where they are, as every
    response and episode of a random model run to their limits; else a lower bound of
    the attention term."""
    import numpy as np

    lengths = np.full(rows, tokens / rows)
    return train_flops(model_config, lengths, frozen_base=lora)


def update_mfu(cfg, model_config: dict, rows: list[dict], update_s: float) -> dict:
    """The update's tokens, TFLOP/s and MFU over the timed ``rows`` (metrics.jsonl),
    the run's ``RunConfig.epochs`` passes each, against the dense bf16 peak of the GPU
    nvidia-smi names (``train_step.PEAK_TFLOPS``) times the actor's devices; no MFU
    without a known GPU."""
    import statistics

    tokens = statistics.mean(r["batch/tokens"] for r in rows)
    n_rows = cfg.prompts_per_step * cfg.sampling.n
    flops = cfg.epochs * update_flops(model_config, tokens, n_rows, cfg.lora is not None)
    name, peak = gpu_peak()
    world = cfg.actor.parallel.world_size
    return {
        "tokens": tokens,
        "flops": flops,
        "flops_per_token": "4 x params (LoRA)" if cfg.lora is not None else "6 x params",
        "tflops_per_s": flops / update_s / 1e12,
        "device": name,
        "devices": world,
        "mfu": flops / update_s / (peak * 1e12 * world) if peak else None,
    }


def gpu_peak() -> tuple[str | None, float | None]:
    """(the first GPU's name, its dense bf16 peak TFLOP/s); (None, None) without one."""
    try:
        found = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None, None
    name = found.stdout.strip().splitlines()[0] if found.returncode == 0 and found.stdout else None
    if name is None:
        return None, None
    return name, next((v for k, v in PEAK_TFLOPS.items() if k in name), None)


def step_rows(metrics: Path) -> list[dict]:
    """The step rows of a run's metrics.jsonl (none where it is missing); a last line cut
    off by a stopped run is left out."""
    rows = []
    for line in metrics.read_text().splitlines() if metrics.exists() else []:
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return [r for r in rows if "time/step" in r]


def run_model(gin_files: list[str], params: list[str], run_dir: Path) -> tuple:
    """The run's RunConfig (parsed again here) and its model's config.json (the embedded
    tiny model's under ``run_dir`` when ``model_path`` is None)."""
    from polyrl.configure.launch import parse_config
    from polyrl.data.tiny import ensure_tiny_model

    cfg, _ = parse_config(gin_files, params)
    path = cfg.model_path or ensure_tiny_model(run_dir / "models", cfg.tiny_model)
    return cfg, json.loads((Path(path) / "config.json").read_text())


def table(summary: dict) -> str:
    step, meets = summary["step_s"], summary["meets"]
    verdict = {True: "met", False: "MISSED"}
    lines = [f"{'phase':<18} {'s/step':>8} {'share':>7}  goal"]
    for name, t in sorted(summary["phases_s"].items(), key=lambda kv: -kv[1]):
        lines.append(f"{name:<18} {t:>8.2f} {100 * t / step:>6.1f}%")
    lines.append(
        f"{'overhead':<18} {summary['overhead_s']:>8.2f} {100 * summary['overhead_fraction']:>6.1f}%"
        f"  <= {100 * GOALS['overhead_fraction']:g}%: {verdict[meets['overhead_fraction']]}"
    )
    lines.append(
        f"{'step':<18} {step:>8.2f} {'':>7}  <= {GOALS['step_s']:g} s (0.5B, one H200): "
        f"{verdict[meets['step_s']]}   (mean of {summary['steps_averaged']} steps)"
    )
    return "\n".join(lines)


def _worker_ops(step_dir: Path, out: Path) -> dict[str, dict]:
    """The profiled step's traces (``<run_dir>/profile/step_<k>``) copied to ``out/ops``;
    each worker's summary, its trace path made the copy's."""
    shutil.copytree(step_dir, out / "ops", dirs_exist_ok=True)
    found = json.loads((step_dir / "summary.json").read_text())
    for worker in found.values():
        worker["trace"] = str(out / "ops" / Path(worker["trace"]).relative_to(step_dir))
    return found


STOPPED = "its driver's threads at the stop end its log (its last 6000 characters: stderr)"


def run_logged(cmd: list[str], log: Path, timeout: float) -> tuple[int | None, bool]:
    """Run ``cmd`` with its output going to ``log`` as it comes; (its return code, whether
    it was stopped at ``timeout`` s). A run past ``timeout`` is stopped with SIGABRT under
    Python's fault handler, which first writes every thread's stack to the log (where a
    run that hangs waits, or where a slow one was: no py-spy needed on the machine; no
    core file is written), then killed if it has not ended 30 s later."""
    import resource
    import signal

    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1"}

    def no_core() -> None:
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

    with log.open("w") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=env, preexec_fn=no_core
        )
        try:
            return proc.wait(timeout=timeout), False
        except subprocess.TimeoutExpired:  # the steps it finished are still measured
            proc.send_signal(signal.SIGABRT)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            return None, True


def main(argv=None) -> None:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        profiled = args.steps + 1 if args.profile else None  # the step under the profiler
        params = [
            *args.gin_param,
            *([f"polyrl.RunConfig.profile_steps = [{profiled}]"] if profiled else []),
            f"polyrl.RunConfig.run_dir = '{run_dir}'",
            f"polyrl.RunConfig.total_steps = {profiled or args.steps}",
        ]
        gin_files = [args.gin] + ([f"gin/backends/{args.backend}.gin"] if args.backend else [])
        cmd = [sys.executable, "-m", "polyrl.cli", "train"]
        for f in gin_files:
            cmd += ["--gin_file", f]
        for b in params:
            cmd += ["--gin_param", b]
        # the run's output goes to the log as it comes: a run past --timeout (or a bench
        # stopped from outside) leaves what it printed up to then
        log = Path(args.log or Path(tmp) / "train.log")
        rc, stopped = run_logged(cmd, log, args.timeout)
        rows = step_rows(run_dir / "metrics.jsonl")
        if stopped or rc or len(rows) <= args.skip:
            sys.stderr.write(log.read_text()[-6000:])
        if rc or len(rows) <= args.skip:
            why = f"stopped at --timeout {args.timeout:g} s: {STOPPED}" if stopped else f"rc={rc}"
            raise SystemExit(
                f"polyrl train failed ({why}, {len(rows)} step(s) done): {' '.join(cmd)}"
            )
        limits = rollout_limits(rows[0])
        cfg, model_config = run_model(gin_files, params, run_dir)
        profile, ops = None, {}
        if profiled and len(rows) == profiled:
            profile = phase_table(run_dir / "timeline.json", args.profile, args.skip, args.steps)
            ops = _worker_ops(run_dir / "profile" / f"step_{profiled}", Path(args.profile))
    summary = summarise(rows[: args.steps], args.skip)
    text = table(summary)
    if stopped:
        text += (
            f"\npolyrl train stopped at --timeout {args.timeout:g} s after {len(rows)} of "
            f"{profiled or args.steps} steps: the means are over the steps it finished; "
            f"{STOPPED}"
        )
    update = None
    if "update_actor" in summary["phases_s"]:
        timed = [r for r in rows[: args.steps] if "time/step" in r][args.skip :]
        update = update_mfu(cfg, model_config, timed, summary["phases_s"]["update_actor"])
        mfu = f"MFU {update['mfu']:.1%}" if update["mfu"] is not None else "no MFU (no known GPU)"
        text += (
            f"\nupdate_actor: {update['tokens']:,.0f} tokens x {cfg.epochs} epoch(s), "
            f"{update['flops_per_token']} a token + attention: {update['tflops_per_s']:.1f} "
            f"TFLOP/s, {mfu} ({update['device'] or 'CPU'} x {update['devices']})"
        )
    if profile is not None:
        text += "\n" + "\n".join(format_top(profile, "phase or worker call (all tracks)"))
    if profile is not None:
        phases = ", ".join(
            f"{k[5:]} {v:.2f}" for k, v in rows[-1].items() if k.startswith("time/") and v >= 0.01
        )
        text += f"\nprofiled step {profiled} (not in the means): {phases}"
    for name, worker in ops.items():
        text += "\n" + "\n".join(format_top(worker, f"{name} op, step {profiled}"))
    if limits:
        text += "\nrollout limits: " + ", ".join(f"{k} {v}" for k, v in limits.items())
    print(text)
    result = {
        "gin": gin_files,
        "gin_params": params[:-2],
        **summary,
        "rollout_limits": limits,
        "stopped_at_timeout": stopped,
        "update": update,
        "table": text.splitlines(),
        **({"profile": profile, "worker_ops": ops} if profile else {}),
        "last_metrics": rows[-1],
    }
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
