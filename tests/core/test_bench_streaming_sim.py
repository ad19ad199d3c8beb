"""experiments/bench/streaming_sim.py runs every scheduler it documents on the real
producers (``Rollouts``, ``Stream``), fast (1 ms of wall time per simulated second): the
synchronous loop, bounded staleness, the stream with whole and partial requests, and the
stream of multi-turn episodes; each keeps its staleness bound. The multi-turn stream
broke when episodes began closing out as they end (``EpisodeRunner.ended``), unseen: no
test ran it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "experiments" / "bench"))
import streaming_sim  # noqa: E402

FAST = ["--steps", "3", "--skip", "1", "--batch", "64", "--ms_per_s", "1", "--stream"]


# (more flags, the max_staleness values, the --stream chunk sizes)
CASES = {
    "single-turn": (["--no_snapshot"], [0, 1, 2], [0, 32]),
    "copies": (["--copy_push_s", "2"], [2], [0]),  # staleness 2 with slow pushed copies
    "multi-turn": (["--turns", "3", "--env_s", "0.5", "--median_len", "60"], [0, 2], [0]),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_every_scheduler_runs_within_its_staleness_bound(case, capsys):
    flags, staleness, chunks = case
    result = streaming_sim.main(
        FAST + flags + ["--staleness", *map(str, staleness), "--chunks", *map(str, chunks)]
    )
    assert [r["max_staleness"] for r in result["settings"]] == staleness
    slow_copies = "--copy_push_s" in flags
    assert result["model"]["copy_push_s"] == (2.0 if slow_copies else 0.5)  # default: --sync_s
    streamed = [(r["max_staleness"], r["chunk_tokens"]) for r in result["streaming"]]
    assert streamed == [(n, c) for n in staleness for c in chunks]
    for r in result["settings"] + result["streaming"]:
        assert r["step_s"] > 0
        assert r["staleness_max"] <= r["max_staleness"], r
    assert "streaming" in capsys.readouterr().out
