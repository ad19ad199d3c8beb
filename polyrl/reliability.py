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

__all__ = [
    "RunStopped",
    "WorkerDied",
    "NonFiniteGuard",
    "check_run_dir",
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


class WorkerDied(RuntimeError):
    """A role's Ray worker died (killed, out of memory, crashed)."""

    def __init__(self, role: str, rank: int, cause: str):
        super().__init__(f"role {role!r} worker (rank {rank}) died: {cause}")
        self.role, self.rank = role, rank


def stop_message(what: str, run_dir: str | Path, checkpoint: Path | None) -> str:
    """``what`` happened + the last good checkpoint + how to resume."""
    if checkpoint is None:
        where = (
            "there is no checkpoint yet (polyrl.RunConfig.save_every), so --resume starts at step 0"
        )
    else:
        where = f"the last good checkpoint is {checkpoint}; --resume continues from it"
    return (
        f"{what}. The run stopped; {where}: polyrl train <same --gin_file/--gin_param> --resume "
        f"(run dir {run_dir})"
    )


class NonFiniteGuard:
    """Counts consecutive steps in which some update was skipped for a non-finite loss
    or gradient (the engines skip it; ``<role>/nonfinite_skipped`` > 0 in the step's
    metrics) and reports each such step; ``limit`` in a row (0: never) ends the run."""

    def __init__(self, limit: int, roles: tuple[str, ...] = ("actor", "critic")):
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
