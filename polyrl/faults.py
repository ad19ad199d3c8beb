"""Fault injection for the reliability tests (docs/reliability.md). Off by default.

Nothing here is a user knob: only tests set ``POLYRL_FAULTS``, and with it unset every
call below is a no-op. It is an environment variable (not gin, not DebugConfig) so that it
reaches every process of a run -- Ray workers and killed-then-restarted drivers -- without
touching the configuration a checkpoint records. Format: ``;``-separated faults, each
``point@key=v1,v2`` or ``point@v1,v2`` (no key), e.g.::

    POLYRL_FAULTS="nan_loss@actor=1,2;kill_in_save@4"

Points and where they fire:

* ``nan_loss@<role>=<updates>``: the engine's loss (and so its gradients) become NaN in
  the listed optimizer updates (the engine's own 0-based update counter);
* ``nan_grad@<role>=<updates>``: only the gradients become NaN (the loss stays finite);
* ``kill_in_save@<step>``: the driver SIGKILLs itself in the middle of writing the
  checkpoint of trainer step ``step`` (after the engines wrote theirs, before the
  checkpoint is complete);
* ``kill_worker@<role>=<updates>``: the worker hosting ``role`` SIGKILLs itself at the
  start of the listed optimizer updates (every rank of the role; ``<role>:<rank>``, e.g.
  ``kill_worker@actor:1=2``: that rank only);
* ``kill_in_forward@<role>[:<rank>]=<calls>``: the same at the start of the worker's
  listed (0-based) forward calls (roles that do not train: the reference);
* ``kill_in_push@rollout:<i>=<version>``: rollout server ``i`` SIGKILLs itself before
  loading the 3rd bucket of the weight push that brings it ``version``;
* ``kill_in_generate@rollout:<i>=<calls>``: rollout server ``i`` SIGKILLs itself as its
  listed (0-based) generate calls arrive, with the requests of its other calls in flight
  (only in its first life: not again after Ray restarts it);
* ``hold_in_generate@rollout:<i>=<calls>``: with ``RolloutConfig.continue_in_place``,
  rollout server ``i`` pauses its listed (0-based) generate calls once each of their
  requests has sampled a token, until the next weight update finishes (it lands
  mid-request for sure);
* ``fail_write@run_dir=0`` / ``disk_full@run_dir=0``: the start-up probe of the run dir
  fails with ``ENOSPC`` / sees 0 bytes free;
* ``temperature_scale@<backend>=<percent>``: every forward of that backend's engines
  scores at ``percent``/100 x the asked temperature (a wrong temperature on one side of
  the three-way check, ``polyrl.observe.shadow``); ``temperature_scale@rollout=<percent>``: the
  rollout servers sample (and report log-probs) at that temperature;
* ``broken_mask@<backend>=1``: every forward of that backend's engines hides each row's
  first real token from attention (its attention mask 0 there: an off-by-one mask);
* ``fail_write@metrics=<N>`` / ``fail_write@checkpoint=<N>``: writing the metrics row
  / the checkpoint after ``N`` steps raises ``OSError(ENOSPC)``, as a full
  disk does;
* ``hang_in_startup@<phase>=<entries>``: the process (a run's driver, a session's host)
  stops forever as it enters start-up phase ``<phase>`` (``polyrl.loop.metrics.StartupLog``,
  e.g. ``rollout servers``) for the listed (0-based) time, as a start that never ends.
"""

from __future__ import annotations

import errno
import os
import signal
import threading

__all__ = ["active", "values", "kill_self", "hang", "raise_disk_full", "ENV"]

ENV = "POLYRL_FAULTS"


def _parse(spec: str) -> dict[tuple[str, str], set[int]]:
    out: dict[tuple[str, str], set[int]] = {}
    for entry in filter(None, (e.strip() for e in spec.split(";"))):
        point, _, rest = entry.partition("@")
        key, _, values = rest.rpartition("=")
        try:
            out[(point.strip(), key.strip())] = {int(v) for v in values.split(",") if v.strip()}
        except ValueError:
            raise ValueError(
                f"{ENV}={spec!r}: bad entry {entry!r}; write point@key=1,2 or point@1,2"
            ) from None
    return out


def active(point: str, at: int, key: str = "") -> bool:
    """Whether fault ``point`` (for ``key``, e.g. a role) is asked for at ``at``."""
    spec = os.environ.get(ENV)
    if not spec:
        return False
    return at in _parse(spec).get((point, key), ())


def values(point: str, key: str = "") -> set[int] | None:
    """The values fault ``point`` is asked for with (for ``key``); None when it is not."""
    spec = os.environ.get(ENV)
    return _parse(spec).get((point, key)) if spec else None


def kill_self() -> None:
    """Die as ``kill -9`` does: no cleanup, no exception handlers, no atexit."""
    os.kill(os.getpid(), signal.SIGKILL)


def hang() -> None:
    """Wait forever (a signal still ends the process as it would)."""
    threading.Event().wait()


def raise_disk_full(what: str) -> None:
    raise OSError(errno.ENOSPC, f"No space left on device (injected by {ENV})", what)
