"""A dataset whose every prompt is over the prompt limit: ``polyrl train`` stops before
anything starts with one message naming RolloutConfig.max_prompt_len, its value, the
shortest prompt and the fix (no traceback, exit code 1), and leaves the run dir as it was.

Copy-task prompts are 13 tokens after the tiny model's chat template
(``<|im_start|>user:copy 123<|im_end|><|im_start|>assistant:``), so a limit of 12 rejects
every one of them."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest

from polyrl.cli import main
from polyrl.data.formats import write_dataset
from polyrl.data.tasks import make_rows

ROOT = Path(__file__).resolve().parents[2]


def _train(run_dir: Path, model: Path, *params: str) -> list[str]:
    args = ["train", "--gin_file", str(ROOT / "gin/experiments/tiny_grpo.gin")]
    binds = [
        f"polyrl.RunConfig.run_dir = {str(run_dir)!r}",
        f"polyrl.RunConfig.model_path = {str(model)!r}",
    ]
    for p in (*binds, *params):
        args += ["--gin_param", p]
    return args


EXPECTED = {
    "error": "ERROR RunConfig.task: task copy (train): every prompt (1024 rows) is over "
    "RolloutConfig.max_prompt_len=12 tokens (the shortest is 13 tokens after the chat "
    "template), so nothing can be trained: raise RolloutConfig.max_prompt_len to at least 13",
    "drop": "ERROR every one of the 1024 training prompts (RunConfig.task='copy') is over "
    "RolloutConfig.max_prompt_len=12 tokens, and RolloutConfig.overlong_prompt='drop' leaves "
    "none to train on: raise RolloutConfig.max_prompt_len (the longest prompt is 13 tokens)",
}


@pytest.mark.parametrize("policy", ["error", "drop"])
def test_task_whose_every_prompt_is_too_long(tmp_path, tiny_model_dir, capsys, policy):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    earlier = run_dir / "metrics.jsonl"  # what an earlier run left: kept as it was
    earlier.write_text('{"step": 1, "reward/mean": 0.5}\n')
    # --overwrite deletes a run's outputs only once every check has passed
    args = _train(
        run_dir,
        tiny_model_dir,
        "polyrl.RolloutConfig.max_prompt_len = 12",
        f"polyrl.RolloutConfig.overlong_prompt = {policy!r}",
    ) + ["--overwrite"]
    assert main(args) == 1
    err = capsys.readouterr().err
    assert EXPECTED[policy] in err, err
    assert err.count("ERROR") == 1 and "Traceback" not in err
    assert earlier.read_text() == '{"step": 1, "reward/mean": 0.5}\n'
    assert [p.name for p in run_dir.iterdir()] == ["metrics.jsonl"]


def test_file_whose_every_prompt_is_too_long_through_the_cli(tmp_path, tiny_model_dir):
    data = write_dataset(make_rows("copy", 40), tmp_path / "long.jsonl")
    digest = hashlib.sha256(data.read_bytes()).hexdigest()
    args = _train(
        tmp_path / "run",
        tiny_model_dir,
        f"polyrl.RunConfig.train_files = [{str(data)!r}]",
        "polyrl.RolloutConfig.max_prompt_len = 12",
    )
    out = subprocess.run(
        [sys.executable, "-m", "polyrl.cli", *args], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 1
    assert out.stderr.count("INVALID ") == out.stderr.count("ERROR") == 1, out.stderr
    assert (
        f"ERROR RunConfig.train_files: {data}: every prompt (40 rows) is over "
        "RolloutConfig.max_prompt_len=12 tokens (the shortest is 13 tokens"
    ) in out.stderr
    assert "Traceback" not in out.stderr + out.stdout
    assert hashlib.sha256(data.read_bytes()).hexdigest() == digest
