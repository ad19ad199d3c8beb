"""Timers, metric trackers (JSONL, TensorBoard, optional W&B) and the end-of-run plot.

Every phase of a step is timed with :class:`PhaseTimer` and logged as
``[phase] step N: X s``; the step's metrics (including ``time/<phase>``) go to every
tracker of a :class:`Tracker`.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from polyrl import faults
from polyrl.observe.shadow import PAIRS as SHADOW_PAIRS

__all__ = [
    "PhaseTimer",
    "StartupLog",
    "Tracker",
    "read_jsonl",
    "drop_steps_after",
    "latest_metrics",
    "plot_run",
    "summary_figure",
    "phase_colour",
    "resume_steps",
    "CHECK_PHASES",
    "phase_summary",
]


# Phases of the checks a run was asked for (the three-way log-prob check,
# RunConfig.shadow_every): timed and shown like any phase, never framework overhead.
CHECK_PHASES = ("shadow",)


class PhaseTimer:
    """Wall-clock time per named phase of the current step (steps count from 1, as in
    the progress line, metrics.jsonl and checkpoints/step_N). ``echo``: print each phase;
    None: only with ``--verbose``.

    Phases may overlap (forwards of roles on different GPUs run at once: :meth:`record`
    takes a span measured by the caller), so the step's framework overhead is the step
    time outside the *union* of its compute phases' spans, not step time minus their sum.

    Inside :meth:`watching` (a run's first step), a phase still running after ``wait_s``
    prints one ``[start-up] step 1 waiting for update_actor (5 s so far ...)`` line, so
    the first step's compiles and warm-ups are never silent and say where the time goes.
    """

    def __init__(self, echo: bool | None = None):
        from polyrl.cluster.ray_session import verbose

        self.echo = verbose() if echo is None else echo
        self.times: dict[str, float] = {}
        self.spans: list[tuple[str, float, float]] = []  # (phase, start, end) of this step
        self.step, self.t0 = 0, time.perf_counter()
        # Called as listener(phase, start perf_counter, seconds, step), e.g. Timeline.add.
        self.listeners: list[Callable[[str, float, float, int], Any]] = []
        self.wait_s: float | None = None  # set by watching()
        self.waits: dict[str, threading.Timer] = {}  # phase -> its pending waiting line

    def start_step(self, step: int) -> None:
        self.step, self.times, self.spans = step, {}, []
        self.t0 = time.perf_counter()

    def begin(self, name: str) -> float:
        """Phase ``name`` starts now (its :meth:`record` ends it); returns its start."""
        if self.wait_s is not None and name not in self.waits:
            line = (
                f"[start-up] step {self.step} waiting for {name} ({self.wait_s:g} s so far: "
                "a first call compiles or warms up)"
            )
            self.waits[name] = timer = threading.Timer(self.wait_s, print, (line,), {"flush": True})
            timer.daemon = True
            timer.start()
        return time.perf_counter()

    def record(self, name: str, t0: float, dt: float) -> None:
        """A span of phase ``name`` that began at ``time.perf_counter()`` value ``t0``."""
        if (timer := self.waits.pop(name, None)) is not None:
            timer.cancel()
        self.times[name] = self.times.get(name, 0.0) + dt
        self.spans.append((name, t0, t0 + dt))
        for listener in self.listeners:
            listener(name, t0, dt, self.step)
        if self.echo:
            print(f"[{name}] step {self.step}: {dt:.2f} s", flush=True)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        t0 = self.begin(name)
        try:
            yield
        finally:
            self.record(name, t0, time.perf_counter() - t0)

    @contextlib.contextmanager
    def watching(self, wait_s: float, when: bool = True) -> Iterator[None]:
        """Phases begun inside print a waiting line once they run past ``wait_s``
        (``when=False``: nothing)."""
        self.wait_s = wait_s if when else None
        try:
            yield
        finally:
            self.wait_s = None
            for timer in self.waits.values():
                timer.cancel()
            self.waits.clear()

    def metrics(self, compute: tuple[str, ...] = ()) -> dict[str, float]:
        """``time/<phase>`` for every phase so far, ``time/step`` (since
        :meth:`start_step`) and ``time/overhead``: the step's time outside every span of
        the ``compute`` phases and of the :data:`CHECK_PHASES` (reloads, offloads, sleeps,
        weight sync, rewards, the controller's own work)."""
        step = time.perf_counter() - self.t0
        busy = covered([(a, b) for name, a, b in self.spans if name in compute + CHECK_PHASES])
        return {f"time/{k}": v for k, v in self.times.items()} | {
            "time/step": step,
            "time/overhead": max(step - busy, 0.0),
        }


class StartupLog:
    """What a run does between ``polyrl train`` and its first step, timed.

    ``with log.phase("rollout servers"):`` times one start-up phase; one still running
    after ``wait_s`` prints ``[start-up] waiting for rollout servers (5 s so far)`` once,
    so a long start is never silent. :meth:`watch` does only that (the initial validation).
    :meth:`done` prints one line with the total and every phase's time and
    returns them as metrics (``startup/total_s``, ``startup/<phase>_s``) for the first
    step's row, which :func:`phase_summary` reports. ``on_phase(name)``: called as each
    phase begins (a session's host records it: the phase a start that hangs is in).
    """

    def __init__(self, wait_s: float = 5.0, on_phase: Callable[[str], None] | None = None):
        self.t0, self.wait_s, self.on_phase = time.perf_counter(), wait_s, on_phase
        self.times: dict[str, float] = {}
        self.entries: dict[str, int] = {}
        self.details: dict[str, str] = {}  # phase -> what its time was spent on

    @contextlib.contextmanager
    def watch(self, what: str) -> Iterator[None]:
        def waiting() -> None:
            print(f"[start-up] waiting for {what} ({self.wait_s:g} s so far)", flush=True)

        timer = threading.Timer(self.wait_s, waiting)
        timer.daemon = True
        timer.start()
        try:
            yield
        finally:
            timer.cancel()

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        if self.on_phase is not None:
            self.on_phase(name)
        entry = self.entries[name] = self.entries.get(name, -1) + 1
        try:
            with self.watch(name):
                if faults.active("hang_in_startup", entry, name):  # test-only: it never ends
                    faults.hang()
                yield
        finally:
            self.times[name] = self.times.get(name, 0.0) + time.perf_counter() - t0

    def detail(self, name: str, text: str) -> None:
        """Say in the start-up line what phase ``name``'s time went to: ``name 9.0 s (text)``."""
        self.details[name] = text

    def done(self) -> dict[str, float]:
        total = time.perf_counter() - self.t0
        parts = "".join(
            f", {name} {t:.1f} s" + (f" ({self.details[name]})" if name in self.details else "")
            for name, t in self.times.items()
        )
        other = total - sum(self.times.values())
        print(f"[start-up] {total:.1f} s before the first step{parts}, other {other:.1f} s")
        named = {f"startup/{k.replace(' ', '_')}_s": v for k, v in self.times.items()}
        return {"startup/total_s": total} | named


def covered(spans: list[tuple[float, float]]) -> float:
    """Length of the union of ``(start, end)`` intervals."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


class Tracker:
    """Writes scalar metrics to ``metrics.jsonl`` and TensorBoard (and W&B if asked).

    ``step`` counts from 1: line N holds the Nth step, checkpoints/step_N is saved after
    it. Appends on resume from step_N: lines after step N are dropped first, so the file
    holds each step once even after a crash between a step and its checkpoint; TensorBoard's
    events of those steps are purged (``purge_step``).
    """

    def __init__(
        self,
        run_dir: str | Path,
        tensorboard: bool = True,
        wandb_project: str | None = None,
        config: Mapping[str, Any] | None = None,
        resume_step: int | None = None,
    ):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / "metrics.jsonl"
        if resume_step is not None:
            drop_steps_after(self.path, resume_step)
        self._jsonl = self.path.open("a")
        self._tb_start = None
        if tensorboard:
            # A resume from step_N purges the events of steps after N (TensorBoard hides
            # those an earlier attempt wrote), so each step shows once.
            purge = None if resume_step is None else resume_step + 1
            # Made beside the first step: its import of torch (1-2 s in a driver that
            # loaded no torch for its checks) is no part of the start-up (issue 48).
            pool = ThreadPoolExecutor(1, thread_name_prefix="polyrl-tensorboard")
            self._tb_start = pool.submit(_summary_writer, self.run_dir / "tensorboard", purge)
            pool.shutdown(wait=False)
        self._wandb = None
        if wandb_project:
            import wandb  # optional: only when the user asks for it

            self._wandb = wandb.init(
                project=wandb_project, dir=str(self.run_dir), config=dict(config or {})
            )

    @property
    def _tb(self) -> Any:
        """The TensorBoard writer (None: not asked for); its errors are raised here."""
        return None if self._tb_start is None else self._tb_start.result()

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        if faults.active("fail_write", step, "metrics"):
            faults.raise_disk_full(str(self.path))
        clean = {k: float(v) for k, v in metrics.items()}
        self._jsonl.write(json.dumps({"step": step, **clean}) + "\n")
        self._jsonl.flush()
        if self._tb is not None:
            for k, v in clean.items():
                self._tb.add_scalar(k, v, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(clean, step=step)

    def log_text(self, tag: str, text: str, step: int) -> None:
        """Text (the rollout dump's decoded samples) to TensorBoard's text tab."""
        if self._tb is not None:
            self._tb.add_text(tag, f"```\n{text}\n```", step)
            self._tb.flush()

    def close(self) -> None:
        self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def _summary_writer(path: Path, purge_step: int | None) -> Any:
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(str(path), purge_step=purge_step)


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    with Path(path).open() as f:
        return [json.loads(line) for line in f if line.strip()]


def drop_steps_after(path: str | Path, step: int) -> None:
    """Rewrite JSONL file ``path`` (if any) without its rows of steps after ``step``,
    and without a last line a kill cut short (no newline: a torn write)."""
    path = Path(path)
    if path.exists():
        lines = path.read_text().split("\n")[:-1]  # the part after the last newline is torn
        kept = [r for r in map(json.loads, filter(str.strip, lines)) if r["step"] <= step]
        path.write_text("".join(json.dumps(r) + "\n" for r in kept))


def latest_metrics(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The latest logged value of every metric (validation metrics are logged only every
    ``eval_every`` steps, the final weights' on a line of their own)."""
    out: dict[str, Any] = {}
    for row in rows:
        out |= row
    return out


# Panels of the end-of-run plot, in order; those a run did not log are left out.
PLOTTED = (
    ("reward/mean", "mean reward"),
    ("val/reward/mean", "validation reward"),
    ("actor/rewards/margins", "DPO reward margin"),
    ("val/pair_accuracy", "reward model: held-out pair accuracy"),
    ("critic/rewards/margins", "reward model: margin (chosen - rejected)"),
    ("actor/kl_loss", "KL (actor loss term)"),
    ("kl_in_reward/kl", "KL (in reward)"),
    ("actor/entropy", "entropy (old policy)"),
    ("response/length_mean", "response length"),
    ("critic/loss", "critic loss"),
    ("judge/failed", "LLM judge: samples without a score"),
)


# Panels of what is specific to a run, shown whenever it logged them: (title, the run
# logged a key starting with this, its curves as (key, label)).
RUN_PANELS = (
    (  # RunConfig.max_staleness >= 1 or streaming: async/* metrics
        "staleness (policy versions)",
        "async/",
        (("rollout/staleness_mean", "mean"), ("rollout/staleness_max", "max")),
    ),
    (
        "turns and tool calls per episode",
        "episode/turns_mean",
        (
            ("episode/turns_mean", "turns"),
            ("episode/tool_calls_mean", "tool calls"),
            ("episode/tool_errors_mean", "tool errors"),
        ),
    ),
    (  # RunConfig.shadow_every
        "shadow check: mean log-prob gap",
        "shadow/gap_mean/",
        tuple((f"shadow/gap_mean/{a}_{b}", f"{a}-{b}") for a, b in SHADOW_PAIRS),
    ),
)
# Panels that fill a row the panels above leave short, in order, where the run logged them.
SPARE_PANELS = (
    (
        "vLLM vs trainer log-prob gap",
        (("rollout/log_prob_diff_mean", "mean"), ("rollout/log_prob_diff_max", "max")),
    ),
    (
        "responses cut / empty (fraction)",
        (("response/cut_fraction", "cut"), ("response/empty_fraction", "empty")),
    ),
    ("weight push (s)", (("sync/seconds", "push"),)),
)
PHASES_TITLE = "phase time per step (s)"
PLOT_COLUMNS = 3
# Each phase's colour in summary.png, the same in every run (tab20, in this order); a
# phase not named here gets a tab20 colour chosen by its name.
PHASE_ORDER = (
    "generate",
    "reward",
    "dynamic_sampling",
    "reference",
    "teacher_log_probs",
    "old_log_probs",
    "values",
    "advantages",
    "shadow",
    "update_actor",
    "update_critic",
    "sync_weights",
    "snapshot_weights",
    "reload",
    "offload",
    "rollout_sleep",
    "rollout_wake",
    "data",
    "export",
)


def phase_colour(name: str) -> str:
    """The colour of phase ``name`` in every run's summary.png (a hex string)."""
    import zlib

    from matplotlib import colormaps
    from matplotlib.colors import to_hex

    tab20 = colormaps["tab20"].colors
    i = PHASE_ORDER.index(name) if name in PHASE_ORDER else zlib.crc32(name.encode())
    return to_hex(tab20[i % len(tab20)])


def resume_steps(rows: list[dict[str, Any]]) -> list[int]:
    """The checkpoint steps a run resumed from: each start logs its start-up
    (``startup/total_s``) with its first step, so a row N+1 that holds one after step 1
    is a resume from ``checkpoints/step_N``."""
    return [r["step"] - 1 for r in rows if "startup/total_s" in r and r["step"] > 1]


def plot_run(metrics_path: str | Path, out_png: str | Path) -> Path:
    """A PNG of the run's curves over steps (:func:`summary_figure`)."""
    import matplotlib.pyplot as plt

    fig = summary_figure(read_jsonl(metrics_path))
    out_png = Path(out_png)
    fig.savefig(out_png, dpi=100)
    plt.close(fig)
    return out_png


def summary_figure(rows: list[dict[str, Any]]) -> Any:
    """The matplotlib figure of :func:`plot_run` for metrics.jsonl ``rows``: a grid of
    :data:`PLOT_COLUMNS` panels a row, each titled (``ax.get_title()``): the
    :data:`PLOTTED` curves the run logged, the :data:`RUN_PANELS` it has (staleness,
    turns and tool calls, the shadow check's gaps), :data:`SPARE_PANELS` to fill the row,
    and last :data:`PHASES_TITLE`: each phase's seconds a step as a line of
    :func:`phase_colour` (phases may run at once: never stacked), the wall step time
    (black, label ``step (wall)``) and the framework overhead (dashed); a start's first
    step far above the rest is off the scale, its wall time written on the panel. Each resume
    (:func:`resume_steps`) is a dotted vertical line (``gid`` ``"resume"``) in every panel."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = {k for r in rows for k in r}
    panels = [(title, ((key, None),)) for key, title in PLOTTED if key in keys]
    panels += [
        (title, curves) for title, has, curves in RUN_PANELS if any(k.startswith(has) for k in keys)
    ]
    spares = [(title, curves) for title, curves in SPARE_PANELS if curves[0][0] in keys]
    while spares and (len(panels) + 1) % PLOT_COLUMNS:
        panels.append(spares.pop(0))
    cols = min(len(panels) + 1, PLOT_COLUMNS)
    grid = -(-(len(panels) + 1) // cols)
    fig, axes = plt.subplots(grid, cols, figsize=(4 * cols, 3.2 * grid), squeeze=False)
    axes = axes.reshape(-1)
    for ax in axes[len(panels) + 1 :]:
        ax.set_visible(False)

    def curve(ax: Any, key: str, **style: Any) -> None:
        points = [(r["step"], r[key]) for r in rows if key in r]
        if points:
            ax.plot(*zip(*points), marker=".", **style)

    for ax, (title, curves) in zip(axes, panels):
        for key, label in curves:
            curve(ax, key, label=label)
        if len(curves) > 1:
            ax.legend(fontsize=6)
        ax.set_title(title)
    ax = axes[len(panels)]
    # Not phases of a step: its whole, its remainder, and validation (between steps; its
    # first run holds vLLM's warm-up and would dwarf every step: the summary reports it).
    totals = ("time/step", "time/overhead", "time/validate")
    named = {k[5:] for r in rows for k in r if k.startswith("time/") and k not in totals}
    phases = [p for p in PHASE_ORDER if p in named] + sorted(named - set(PHASE_ORDER))
    curve(ax, "time/step", color="black", linewidth=2, label="step (wall)")
    curve(ax, "time/overhead", color="grey", linestyle="--", label="overhead")
    for name in phases:
        curve(ax, f"time/{name}", color=phase_colour(name), linewidth=1, label=name)
    ax.set_title(PHASES_TITLE)
    ax.set_ylim(bottom=0)

    # A start's first step (compiles, warm-ups) may take 30x the others: when over 3x, it
    # goes off the scale, its wall time written at the top, so later steps stay readable.
    def tallest(r: dict[str, Any]) -> float:
        shown = (v for k, v in r.items() if k.startswith("time/") and k != "time/validate")
        return max(shown, default=0.0)

    first = [r for r in rows if "startup/total_s" in r]
    top = 1.1 * max((tallest(r) for r in rows if "startup/total_s" not in r), default=0.0)
    if top and max(map(tallest, first), default=0.0) > 3 * top:
        ax.set_ylim(0, top)
        for r in first:
            if tallest(r) > top:
                wall = r.get("time/step", tallest(r))
                note = f"step {r['step']}: {wall:.1f} s"
                box = {"facecolor": "white", "edgecolor": "none", "alpha": 0.8, "pad": 1}
                ax.text(r["step"], top, note, fontsize=6, ha="center", va="top", bbox=box)
    for ax in axes[: len(panels) + 1]:
        for i, step in enumerate(resume_steps(rows)):
            label = "resumed" if i == 0 and ax is axes[len(panels)] else None
            ax.axvline(step, color="grey", linestyle=":", linewidth=1, gid="resume", label=label)
        ax.set_xlabel("step")
    if phases:
        axes[len(panels)].legend(fontsize=6)
    fig.tight_layout()
    return fig


def phase_summary(rows: list[dict[str, Any]], compute_phases: tuple[str, ...]) -> str:
    """Per-phase share of wall time over the run, and framework overhead: step time
    outside the compute phases (generation, forward passes, training) and the checks
    (:data:`CHECK_PHASES`, on a line of their own); ``time/overhead`` where the rows have
    it (overlapping phases), else step time minus their sum."""
    totals: dict[str, float] = {}
    for r in rows:
        for k, v in r.items():
            if k.startswith("time/"):
                totals[k[5:]] = totals.get(k[5:], 0.0) + v
    step_total = totals.pop("step", sum(totals.values()))
    validate = totals.pop("validate", None)  # runs between steps, outside time/step
    logged = totals.pop("overhead", None)
    steps = sum("time/step" in r for r in rows)
    lines = [f"phase times over {steps} steps ({step_total:.1f} s):"]
    for name, t in sorted(totals.items(), key=lambda kv: -kv[1]):
        lines.append(f"  {name:<16} {t:8.2f} s  {100 * t / max(step_total, 1e-9):5.1f}%")
    compute = sum(t for k, t in totals.items() if k in compute_phases + CHECK_PHASES)
    overhead = step_total - compute if logged is None else logged
    checked = totals.get("shadow")
    outside = "/".join(compute_phases) + (" and the shadow check" if checked is not None else "")
    lines.append(
        f"  framework overhead (step time outside {outside}): {overhead:.2f} s "
        f"({100 * overhead / max(step_total, 1e-9):.1f}%)"
    )
    if checked is not None:
        checks = sum("time/shadow" in r for r in rows)
        lines.append(
            f"  shadow check (RunConfig.shadow_every): {checked:.2f} s in {checks} of {steps} "
            f"steps ({100 * checked / max(step_total, 1e-9):.1f}%), not in the overhead"
        )
    if validate is not None:
        runs = sum("time/validate" in r for r in rows)
        lines.append(
            f"  validation: {runs} runs, {validate:.2f} s between steps "
            f"(+{100 * validate / max(step_total, 1e-9):.1f}% wall time)"
        )
    lines += _startup_lines(rows, step_total + (validate or 0.0))
    ahead = sum(r.get("async/generate_s", 0.0) for r in rows)
    if ahead:  # RunConfig.max_staleness: "generate" above is only the time waited for it
        hidden = ahead - sum(r.get("async/wait_s", 0.0) for r in rows)
        pushed = sum(r.get("async/push_ahead_s", 0.0) for r in rows)
        copies = int(sum(r.get("async/pushed_ahead", 0.0) for r in rows))
        lines.append(
            f"  generation ahead (async): {ahead:.2f} s, {hidden:.2f} s of it "
            f"({100 * hidden / ahead:.1f}%) overlapped with training"
            + (
                f"; {copies} weight copies pushed by the generator, {pushed:.2f} s"
                if copies
                else ""
            )
        )
    return "\n".join(lines)


def _startup_lines(rows: list[dict[str, Any]], after: float) -> list[str]:
    """The start-up line of :func:`phase_summary` (StartupLog's metrics; one set per
    start, so a resumed run sums its starts); ``after``: steps + validation seconds."""
    starts = [r for r in rows if "startup/total_s" in r]
    if not starts:
        return []
    total = sum(r["startup/total_s"] for r in starts)
    parts: dict[str, float] = {}
    for r in starts:
        for k, v in r.items():
            # startup/<phase>_s; startup/<phase>/<part> is a phase's own breakdown
            if k.startswith("startup/") and k != "startup/total_s" and k.count("/") == 1:
                name = k.removeprefix("startup/").removesuffix("_s").replace("_", " ")
                parts[name] = parts.get(name, 0.0) + v
    shown = ", ".join(f"{k} {v:.1f} s" for k, v in sorted(parts.items(), key=lambda kv: -kv[1]))
    n = f" ({len(starts)} starts)" if len(starts) > 1 else ""
    return [
        f"  start-up: {total:.1f} s before the first step{n}: {shown}; "
        f"{100 * total / max(total + after, 1e-9):.1f}% of the run's {total + after:.1f} s "
        f"(start-up + steps + validation)"
    ]
