"""How a run reacts to faults (docs/reliability.md): non-finite steps, dead workers,
unwritable or full disks. Framework-free; the trainer and the launcher call it.

Each fault that ends a run raises :class:`RunStopped`, whose message says what happened,
where the last good checkpoint is and how to continue (``polyrl train ... --resume``).
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from polyrl import faults
from polyrl.checkpoints import latest_checkpoint
from polyrl.role_table import TRAINED_ROLES

__all__ = [
    "RunStopped",
    "Interrupted",
    "interrupt_message",
    "WorkerDied",
    "NonFiniteGuard",
    "check_run_dir",
    "check_fresh_run_dir",
    "clear_run_outputs",
    "RunDirInUse",
    "RUN_OUTPUTS",
    "check_free_space",
    "stop_message",
    "WriteFailed",
    "writing",
    "is_fault",
]

# Room a run needs beyond its checkpoints (metrics, TensorBoard, the plot, logs).
RUN_DIR_SLACK = 64 * 2**20
_FIX = "set polyrl.RunConfig.run_dir to a writable directory with free space"


class RunStopped(RuntimeError):
    """The run stopped on a fault; the message says why and how to resume."""


class Interrupted(KeyboardInterrupt):
    """Ctrl-C (or SIGTERM) ended the run; the message says where it stands and how to
    continue (:func:`interrupt_message`)."""


@contextlib.contextmanager
def interrupt_message(run_dir: str | Path) -> Iterator[None]:
    """A Ctrl-C inside leaves as :class:`Interrupted`, saying how to continue: ``--resume``
    from the last good checkpoint, or ``--resume-or-start`` when there is none yet."""
    try:
        yield
    except KeyboardInterrupt as e:
        if isinstance(e, Interrupted):
            raise
        what = "interrupted: metrics.jsonl and the logs are in the run directory"
        raise Interrupted(stop_message(what, run_dir, latest_checkpoint(run_dir))) from None


class WorkerDied(RuntimeError):
    """A role's Ray worker died (killed, out of memory, crashed). ``where``: its node and
    process, when known (``polyrl.cluster.groups.WorkerGroup.died``)."""

    def __init__(self, role: str, rank: int, cause: str, where: str = ""):
        at = f" on {where}" if where else ""
        super().__init__(
            f"role {role!r} worker (rank {rank}) died{at}: {cause}. Check its output for a "
            f"traceback (worker-*-<pid>.err in the run's logs/ directory, or in Ray's session "
            f"logs on that node, /tmp/ray/session_latest/logs) and the node's memory (Ray's "
            f"OOM killer reports its kills in that node's raylet.out)"
        )
        self.role, self.rank, self.where = role, rank, where


def stop_message(what: str, run_dir: str | Path, checkpoint: Path | None) -> str:
    """``what`` happened + the last good checkpoint + how to resume."""
    if checkpoint is None:
        where, flag = (
            "there is no checkpoint yet (polyrl.RunConfig.save_every); --resume-or-start "
            "starts it again at step 0",
            "--resume-or-start",
        )
    else:
        where, flag = (
            f"the last good checkpoint is {checkpoint}; --resume continues from it",
            "--resume",
        )
    return (
        f"{what}. The run stopped; {where}: polyrl train <same --gin_file/--gin_param> {flag} "
        f"(run dir {run_dir})"
    )


class NonFiniteGuard:
    """Counts consecutive steps in which some update was skipped for a non-finite loss
    or gradient (the engines skip it; ``<role>/nonfinite_skipped`` > 0 in the step's
    metrics) and reports each such step; ``limit`` in a row (0: never) ends the run."""

    def __init__(self, limit: int, roles: tuple[str, ...] = TRAINED_ROLES):
        self.limit, self.roles, self.streak = limit, roles, 0

    def observe(self, step: int, metrics: dict[str, float]) -> bool:
        """Report step ``step``'s skipped updates; True when the run must stop."""
        bad = [r for r in self.roles if metrics.get(f"{r}/nonfinite_skipped", 0.0) > 0]
        for role in bad:
            print(
                f"[nonfinite] step {step}: {role} update skipped "
                f"({metrics[f'{role}/nonfinite_skipped']:.0%} of its updates; loss "
                f"{metrics.get(f'{role}/loss', float('nan')):.4g}, grad_norm "
                f"{metrics.get(f'{role}/grad_norm', float('nan')):.4g}); weights and "
                "optimizer state unchanged",
                flush=True,
            )
        self.streak = self.streak + 1 if bad else 0
        return bool(self.limit) and self.streak >= self.limit


def check_run_dir(run_dir: str | Path) -> None:
    """Before anything is written or started: ``run_dir`` can be created and written.
    Raises ``OSError`` with a message naming the binding to fix."""
    run_dir = Path(run_dir)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / ".polyrl_write_probe"
        if faults.active("fail_write", 0, "run_dir"):
            faults.raise_disk_full(str(probe))
        with probe.open("wb") as f:
            f.write(b"\0" * 4096)
            f.flush()
            os.fsync(f.fileno())
        probe.unlink()
    except OSError as e:
        raise OSError(
            e.errno, f"polyrl.RunConfig.run_dir={str(run_dir)!r} is not writable ({e}); {_FIX}"
        ) from None


# What a run writes into its run_dir (``--overwrite`` deletes exactly these; the tiny
# model under models/ is a cache, not an output, and anything else is the user's).
RUN_OUTPUTS = (
    "metrics.jsonl",
    "checkpoints",
    "tensorboard",
    "summary.png",
    "timeline.json",
    "rollouts.jsonl",
    "val_samples",
    "profile",
    "logs",
    "wandb",
    "operative_config.gin",
)


class RunDirInUse(FileExistsError):
    """``run_dir`` holds another run's metrics or checkpoints (neither --resume nor
    --overwrite was given)."""


def check_fresh_run_dir(run_dir: str | Path, resume: bool, overwrite: bool) -> None:
    """Before anything is written: a run without ``--resume`` starts in a run_dir that
    holds no metrics and no checkpoints (it would append to them), unless ``--overwrite``."""
    if resume and overwrite:
        raise ValueError("--resume and --overwrite contradict each other: pass one of them")
    run_dir = Path(run_dir)
    metrics = run_dir / "metrics.jsonl"
    rows = metrics.read_text().count("\n") if metrics.is_file() else 0
    checkpoint = latest_checkpoint(run_dir)
    if resume or overwrite or not (rows or checkpoint):
        return
    held = [f"metrics.jsonl with {rows} row(s)"] if rows else []
    held += [f"checkpoint {checkpoint.name}"] if checkpoint else []
    raise RunDirInUse(
        f"polyrl.RunConfig.run_dir={str(run_dir)!r} already holds a run ({', '.join(held)}): "
        f"continue it with --resume, choose another run_dir (--gin_param "
        f"'polyrl.RunConfig.run_dir = \"{run_dir}_2\"'), or pass --overwrite to delete its "
        f"outputs ({', '.join(RUN_OUTPUTS[:3])}, ...) and start again"
    )


def clear_run_outputs(run_dir: str | Path) -> list[str]:
    """``--overwrite``: delete what a previous run wrote into ``run_dir`` (RUN_OUTPUTS,
    nothing else); returns the names deleted."""
    gone = []
    for name in RUN_OUTPUTS:
        path = Path(run_dir, name)
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists() or path.is_symlink():
            path.unlink()
        else:
            continue
        gone.append(name)
    return gone


def check_free_space(cfg: Any, spec: Any) -> None:
    """Before any worker starts: the run dir's disk holds ``keep_checkpoints + 1``
    checkpoints (fp32 weights + two Adam moments per trained role) and the metrics."""
    weights = sum(f.stat().st_size for f in Path(cfg.model_path).glob("*.safetensors"))
    roles = 2 if spec.needs_critic else 1
    need = RUN_DIR_SLACK
    if cfg.save_every:
        need += 3 * weights * roles * (cfg.keep_checkpoints + 1)
    exports = cfg.total_steps // cfg.export_every if cfg.export_every else 0
    need += weights * (exports + cfg.export_final)  # HF exports (RunConfig.export_every/final)
    free = shutil.disk_usage(cfg.run_dir).free
    if faults.active("disk_full", 0, "run_dir"):
        free = 0
    if free < need:
        raise OSError(
            errno.ENOSPC,
            f"polyrl.RunConfig.run_dir={cfg.run_dir!r}: {free / 2**20:.0f} MiB free, the run "
            f"needs about {need / 2**20:.0f} MiB (keep_checkpoints + 1 checkpoints and the "
            f"metrics); {_FIX}, or lower polyrl.RunConfig.keep_checkpoints",
        )


class WriteFailed(RuntimeError):
    """Writing the run directory (metrics, a checkpoint) failed: disk full, I/O error."""


@contextlib.contextmanager
def writing(what: str) -> Iterator[None]:
    """Turn an ``OSError`` while writing ``what`` into :class:`WriteFailed`."""
    try:
        yield
    except OSError as e:
        raise WriteFailed(f"writing {what} failed: {e}") from e


def is_fault(error: BaseException) -> bool:
    """Faults the run stops on with a resume hint (the rest are bugs: traceback)."""
    return isinstance(error, WorkerDied | WriteFailed)
