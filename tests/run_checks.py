"""What the tests that train the same steps twice compare (a resumed or restarted run,
a run attached to a warm session against a fresh one): the two runs' metrics, step by
step, equal to float rounding."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

# The metrics a resumed run's steps are compared on.
KEYS = ("reward/mean", "actor/loss", "actor/grad_norm", "actor/kl_loss")
# What differs between two runs of the same seed: wall-clock times (and the health flag
# that reads them), the start-up phases.
TIMED = ("time/", "startup/", "sync/seconds", "health/phase_slow")


def assert_same_steps(
    found: Sequence[dict],
    want: Sequence[dict],
    keys: Sequence[str] | None = KEYS,
    rel: float = 1e-6,
    abs: float = 1e-7,
) -> None:
    """``found``'s metrics rows equal ``want``'s, row by row (the same steps), on ``keys``
    (None: every metric that is not timed, and the same ones in both) within ``rel`` or
    ``abs``. Same seeds, data and weights on fp32 CPU kernels give the same numbers up
    to the reduction-order noise of another process (README.md's Quickstart: not
    always bitwise); a run that diverged (other data, weights or seeds) differs by far
    more."""
    assert [r["step"] for r in found] == [r["step"] for r in want]
    for a, b in zip(found, want):
        names = keys
        if names is None:
            names = [k for k in a if not k.startswith(TIMED)]
            assert set(names) == {k for k in b if not k.startswith(TIMED)}, a["step"]
        for key in names:
            assert a[key] == pytest.approx(b[key], rel=rel, abs=abs), (a["step"], key)
