"""``polyrl report RUN_DIR``: what a run directory holds, as text.

Read only from the files the run wrote: metrics.jsonl (curves, phase times, start-up,
``health/*``, staleness), ``checkpoints/step_N``, ``shadow/step_N.json`` (the three-way
check), and the paths of the timeline, rollout dumps and profiles. Writes summary.png.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from polyrl.checkpoints import STATE
from polyrl.loop.metrics import (
    PLOTTED,
    latest_metrics,
    phase_summary,
    plot_run,
    resume_steps,
)

__all__ = ["run_report"]

_STEP_FILE = re.compile(r"step_(\d+)(\.json)?")


def run_report(run_dir: str | Path, rows: list[dict[str, Any]]) -> str:
    """The report of ``run_dir`` whose metrics.jsonl holds ``rows`` (not empty)."""
    from polyrl.loop.trainer import COMPUTE_PHASES

    run_dir = Path(run_dir)
    last = latest_metrics(rows)
    lines = [f"run {run_dir}: {sum('time/step' in r for r in rows)} steps"]
    for key, _ in PLOTTED:
        if key in last:  # first: the first row that has it (row 0 may be validation only)
            first = next(r[key] for r in rows if key in r)
            lines.append(f"  {key:<24} first {first:9.4f}  last {last[key]:9.4f}")
    lines.append(phase_summary(rows, COMPUTE_PHASES))
    lines += _health(rows)
    saved = sorted(
        int(m.group(1))
        for p in run_dir.glob(f"checkpoints/step_*/{STATE}")
        if (m := _STEP_FILE.fullmatch(p.parent.name))
    )
    where = f" in {run_dir / 'checkpoints'}" if saved else ""
    lines.append(f"checkpoints: {', '.join(f'step_{s}' for s in saved) or 'none'}{where}")
    resumes = resume_steps(rows)
    lines.append(
        f"resumes: {len(resumes)}, from the checkpoint{'s' * (len(resumes) > 1)} of "
        f"step{'s' * (len(resumes) > 1)} {_steps(resumes)} (dotted lines in summary.png)"
        if resumes
        else "resumes: none"
    )
    lines += _staleness(rows)
    lines += _shadow(run_dir)
    lines.append(f"plot: {plot_run(run_dir / 'metrics.jsonl', run_dir / 'summary.png')}")
    for name, what in (
        ("timeline.json", "open in https://ui.perfetto.dev"),
        ("rollouts.jsonl", ""),
    ):
        if (run_dir / name).exists():
            lines.append(f"{name.split('.')[0]}: {run_dir / name} {what}".rstrip())
    profiled = run_dir.glob("profile/step_*/summary.json")
    for summary in sorted(profiled, key=lambda p: int(p.parent.name.removeprefix("step_"))):
        workers = ", ".join(json.loads(summary.read_text()))
        lines.append(f"profile: {summary.parent} ({workers}; top ops in summary.json)")
    return "\n".join(lines) + "\n"


def _steps(steps: list[int]) -> str:
    """``1-3, 5, 7``: runs of consecutive steps as ranges; the middle elided past 8."""
    parts: list[str] = []
    for s in steps:
        if parts and s == int(parts[-1].split("-")[-1]) + 1:
            parts[-1] = f"{parts[-1].split('-')[0]}-{s}"
        else:
            parts.append(str(s))
    return ", ".join(parts if len(parts) <= 8 else parts[:4] + ["..."] + parts[-3:])


def _health(rows: list[dict[str, Any]]) -> list[str]:
    """The health warnings (``health/<name>`` = 1 on each step it fired)."""
    names = sorted({k for r in rows for k in r if k.startswith("health/")})
    if not names:
        return []
    fired = {n[7:]: [r["step"] for r in rows if r.get(n) == 1.0] for n in names}
    shown = [f"{name} at step{'s' * (len(s) > 1)} {_steps(s)}" for name, s in fired.items() if s]
    if not shown:
        return [f"health: no warning ({len(names)} checks)"]
    return [f'health: {"; ".join(shown)} (what to check: docs/debugging.md "Health warnings")']


def _staleness(rows: list[dict[str, Any]]) -> list[str]:
    """Async and streaming runs (``async/*`` metrics): how old the trained rollouts were."""
    means = [r["rollout/staleness_mean"] for r in rows if "rollout/staleness_mean" in r]
    high = max((r.get("rollout/staleness_max", 0.0) for r in rows), default=0.0)
    if not means or not (high or any(k.startswith("async/") for r in rows for k in r)):
        return []
    stale = sum(r.get("rollout/stale_rows", 0.0) for r in rows)
    dropped = sum(r.get("rollout/stale_dropped", 0.0) for r in rows)
    return [
        f"staleness (policy versions): mean {sum(means) / len(means):.2f}, max {high:g}; "
        f"{stale:g} rows beyond the bound, {dropped:g} dropped"
    ]


def _shadow(run_dir: Path) -> list[str]:
    """The three-way check's records (``RunConfig.shadow_every``): the largest gaps and
    each step whose check named a side."""
    from polyrl.observe.shadow import PAIRS

    found = [
        (int(m.group(1)), p)
        for p in run_dir.glob("shadow/step_*.json")
        if (m := _STEP_FILE.fullmatch(p.name))
    ]
    if not found:
        return []
    records = [(step, path, json.loads(path.read_text())) for step, path in sorted(found)]
    largest = []
    for a, b in PAIRS:
        key = f"shadow/gap_mean/{a}_{b}"
        gap, step = max((doc["metrics"].get(key, 0.0), step) for step, _, doc in records)
        largest.append(f"{a}-{b} {gap:.3g} (step {step})")
    lines = [
        f"shadow check: {len(records)} checks (steps {_steps([s for s, _, _ in records])}); "
        f"largest mean gaps per token: {', '.join(largest)}"
    ]
    for step, path, doc in records:
        side = doc.get("odd_side")
        if side is None:
            continue
        what = (
            "the three sides disagree with each other"
            if side == "all"
            else f"the {side} side ({doc['sides'].get(side, side)}) disagrees with the two others"
        )
        lines.append(f"  step {step}: {what}: {path}, polyrl diagnose {run_dir} --step {step}")
    if len(lines) == 1:
        lines.append("  no check named a side: the three agree within RunConfig.shadow_tolerance")
    return lines
