"""`polyrl train --import`: an own task and reward (experiments/own_task/min_digit.py)
train from the user's directory, and the module is imported in every Ray worker."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from polyrl.loop.metrics import read_jsonl

ROOT = Path(__file__).resolve().parents[2]

# Imports the example and leaves one file per process that imported it.
PROBE = "import os\nimport min_digit  # noqa: F401\nopen(f'imported.{os.getpid()}', 'w').close()\n"


# slow: the default tier has what workers get (tests/core/test_user_code.py) and a run
# with --import (test_multiturn.py::test_openai_client_agent_trains_through_polyrl_train)
@pytest.mark.slow
def test_train_with_an_own_task_imports_it_in_driver_and_workers(tmp_path):
    shutil.copy(ROOT / "experiments" / "own_task" / "min_digit.py", tmp_path)
    (tmp_path / "probe.py").write_text(PROBE)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "RAY_ADDRESS")}
    cmd = [sys.executable, "-m", "polyrl.cli", "train", "--import", "probe"]
    cmd += ["--gin_file", "gin/experiments/tiny_grpo.gin"]
    for binding in (
        'polyrl.RunConfig.task = "min"',
        "polyrl.RunConfig.total_steps = 3",
        'polyrl.RunConfig.run_dir = "run"',  # relative: resolved in the user's directory
        "polyrl.RunConfig.tensorboard = False",
        "polyrl.RunConfig.dump_every = 1",
        "polyrl.RunConfig.dump_samples = 32",
    ):
        cmd += ["--gin_param", binding]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert len(rows) == 3
    # The task and reward as min_digit.py's docstrings define them, recomputed here from
    # the dumped samples' text: the prompt "min 374" asks for 3; 1 for exactly it, 0.2 for
    # another answer that starts with a digit, else 0.
    samples = read_jsonl(tmp_path / "run" / "rollouts.jsonl")
    assert sorted({s["step"] for s in samples}) == [1, 2, 3] and len(samples) == 3 * 32
    for s in samples:
        (digits,) = re.findall(r"min (\d{3})", s["prompt"])
        answer = s["response"].strip()
        want = 1.0 if answer == min(digits) else 0.2 if answer[:1].isdigit() else 0.0
        assert (s["data_source"], s["ground_truth"]) == ("my/min_digit", min(digits)), s
        assert s["reward"] == pytest.approx(want), s
    pids = {int(p.suffix[1:]) for p in tmp_path.glob("imported.*")}
    # The driver, the actor, the reference and the rollout server each imported it.
    assert len(pids) >= 4, pids
