"""The sweep's naming, smoothing, ranking, table, plot and report, on hand-made trial
directories (no Ray); the search-space and pool-bundle translations."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest

from polyrl.cli import main
from polyrl.cluster.placement import pool_bundles
from polyrl.config import SweepConfig
from polyrl.configure.sweep import rank, report, search_space, summarize, trial_name, write_results

LR = "actor/polyrl.OptimConfig.lr"


def test_trial_names_come_from_the_bindings():
    assert trial_name(3, {LR: 0.003, "polyrl.RunConfig.backend": "jax_pjit"}) == (
        "03_actor.lr=0.003_backend=jax_pjit"
    )
    assert trial_name(12, {"polyrl.SamplingSpec.n": 8}) == "12_n=8"
    # odd characters cannot make a path: "/" and spaces become "-"
    assert trial_name(0, {"polyrl.RunConfig.task": "a/b c"}) == "00_task=a-b-c"


def test_summary_smooths_the_last_k_steps():
    rows = [{"step": i, "m": v} for i, v in enumerate([0.1, 0.5, 0.2, 0.4])]
    s = summarize(rows, "m", "max", k=2)
    assert s == {"steps": 4, "final": 0.4, "best": 0.5, "smoothed": pytest.approx(0.3)}
    assert summarize(rows, "m", "min", k=10)["best"] == 0.1
    assert summarize(rows, "m", "min", k=10)["smoothed"] == pytest.approx(0.3)
    assert math.isnan(summarize([{"step": 0}], "m", "max", k=2)["final"])


def test_ranking_uses_the_smoothed_value_not_one_noisy_final_step():
    lucky = {"dir": "lucky", "final": 0.9, "smoothed": 0.2}  # one good last step
    steady = {"dir": "steady", "final": 0.5, "smoothed": 0.5}
    failed = {"dir": "failed", "final": math.nan, "smoothed": math.nan}
    assert [t["dir"] for t in rank([failed, lucky, steady], "max")] == ["steady", "lucky", "failed"]
    assert [t["dir"] for t in rank([failed, lucky, steady], "min")] == ["lucky", "steady", "failed"]


def _trial(root: Path, name: str, lr: float, values: list[float], status: str, error: str = ""):
    d = root / name
    d.mkdir(parents=True)
    info = {"bindings": {LR: lr}, "status": status} | ({"error": error} if error else {})
    (d / "trial.json").write_text(json.dumps(info))
    (d / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": i, "reward/mean": v}) + "\n" for i, v in enumerate(values))
    )
    (d / "operative_config.gin").write_text(f"actor/polyrl.OptimConfig.lr = {lr}\n")


@pytest.fixture
def sweep_dir(tmp_path: Path) -> Path:
    meta = {"bindings": [LR], "metric": "reward/mean", "mode": "max", "smooth_steps": 2}
    (tmp_path / "sweep.json").write_text(json.dumps(meta))
    _trial(tmp_path, "00_actor.lr=0.0003", 3e-4, [0.1, 0.1, 0.1, 0.7], "done")  # smoothed 0.4
    _trial(tmp_path, "01_actor.lr=0.001", 1e-3, [0.2, 0.4, 0.5, 0.5], "done")  # smoothed 0.5
    _trial(tmp_path, "02_actor.lr=0.003", 3e-3, [0.1, 0.0], "stopped")  # smoothed 0.05
    _trial(tmp_path, "03_actor.lr=0.01", 1e-2, [], "error", "INVALID RunConfig.x")
    return tmp_path


def test_results_table_plot_and_best_config(sweep_dir):
    rows = list(csv.DictReader((write_results(sweep_dir)).open()))
    assert [r["trial"] for r in rows] == [
        "01_actor.lr=0.001",
        "00_actor.lr=0.0003",
        "02_actor.lr=0.003",
        "03_actor.lr=0.01",
    ]
    first = rows[0]
    assert first["rank"] == "1" and first[LR] == "0.001" and first["status"] == "done"
    assert float(first["smoothed_last_2"]) == pytest.approx(0.5) and float(first["best"]) == 0.5
    assert rows[2]["status"] == "stopped" and rows[2]["steps"] == "2"
    assert rows[3]["status"] == "error" and rows[3]["error"] == "INVALID RunConfig.x"
    best = (sweep_dir / "best_operative_config.gin").read_text()
    assert best == "actor/polyrl.OptimConfig.lr = 0.001\n"
    assert (sweep_dir / "curves.png").read_bytes()[:4] == b"\x89PNG"


def test_report_prints_the_ranked_table(sweep_dir, capsys):
    assert main(["report", str(sweep_dir)]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert "ranked by reward/mean (max, mean of the last 2 steps)" in lines[0]
    ranked = [line.split()[-1] for line in lines[2:] if not line.strip().startswith("error")]
    assert ranked[0] == "01_actor.lr=0.001" and ranked[-1] == "03_actor.lr=0.01"
    assert "error: INVALID RunConfig.x" in out
    assert report(sweep_dir) == out


def test_search_space_kinds_become_tune_domains():
    from ray.tune.search.sample import Categorical, Float, Integer

    cfg = SweepConfig(
        grid={"polyrl.SamplingSpec.n": [4, 8]},
        space={
            LR: {"loguniform": [1e-4, 1e-2]},
            "polyrl.RunConfig.backend": {"choice": ["torch_fsdp", "jax_pjit"]},
            "polyrl.RunConfig.seed": {"randint": [0, 10]},
        },
    )
    space = search_space(cfg.bindings)
    assert space["polyrl.SamplingSpec.n"] == {"grid_search": [4, 8]}
    lr = space["actor|polyrl.OptimConfig.lr"]  # "/" would nest the key in Tune
    assert isinstance(lr, Float) and (lr.lower, lr.upper) == (1e-4, 1e-2)
    assert isinstance(space["polyrl.RunConfig.backend"], Categorical)
    assert isinstance(space["polyrl.RunConfig.seed"], Integer)


@pytest.mark.parametrize(
    "kwargs, names",
    [
        ({"space": {LR: {"logunif": [1, 2]}}}, "SweepConfig.space['actor/polyrl.OptimConfig.lr']"),
        ({"space": {LR: {"loguniform": [0, 1]}}}, "lo > 0"),
        ({"grid": {LR: []}}, "SweepConfig.grid["),
        ({"scheduler": "hyperband"}, "SweepConfig.scheduler='hyperband'"),
        ({"search": "optuna", "grid": {LR: [1, 2]}}, "use choice instead of grid"),
    ],
)
def test_bad_sweep_config_names_the_field(kwargs, names):
    with pytest.raises(ValueError, match=None) as e:
        SweepConfig(**kwargs)
    assert names in str(e.value)


def test_pool_bundles_match_the_pools():
    pools = {
        "train": {"nodes": 2, "CPU": 8, "GPU": 4},  # per node
        "gen": {"CPU": 1, "GPU": 0},
        "idle": {"CPU": 8},
    }
    bundles, first = pool_bundles(pools, {"train", "gen"})
    assert bundles == [{"CPU": 8.0, "GPU": 4.0}, {"CPU": 8.0, "GPU": 4.0}, {"CPU": 1.0}]
    assert first == {"train": 0, "gen": 2}


def test_report_into_a_closed_pipe_ends_quietly(tmp_path):
    import subprocess
    import sys

    meta = {"bindings": [LR], "metric": "reward/mean", "mode": "max", "smooth_steps": 2}
    (tmp_path / "sweep.json").write_text(json.dumps(meta))
    for i in range(1200):  # ~100 KB of table: more than a pipe holds, so head closes it early
        _trial(tmp_path, f"{i:04d}_actor.lr={i}", float(i), [0.1, 0.2], "done")
    cmd = f"{sys.executable} -m polyrl.cli report {tmp_path} | head -n 3"
    out = subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=120)
    assert len(out.stdout.splitlines()) == 3 and out.stderr == "", out.stderr


def test_optuna_search_or_a_clear_message_without_it():
    import importlib.util

    from polyrl.configure.sweep import _tune_config

    cfg = SweepConfig(search="optuna", space={LR: {"loguniform": [1e-4, 1e-2]}})
    if importlib.util.find_spec("optuna") is None:
        with pytest.raises(ValueError, match="SweepConfig.search = 'optuna' needs the optuna"):
            _tune_config(cfg)
    else:
        from ray.tune.search.optuna import OptunaSearch

        assert isinstance(_tune_config(cfg).search_alg, OptunaSearch)


def test_the_shipped_sweep_file_binds():
    from polyrl.configure.launch import parse_config

    sweep, _ = parse_config(["gin/sweeps/tiny_grpo_lr.gin"], root="polyrl.SweepConfig")
    assert sweep.scheduler == "asha" and list(sweep.bindings) == [LR]
    run, _ = parse_config(["gin/sweeps/tiny_grpo_lr.gin"])
    assert run.total_steps == 16 and run.pools["shared"]["CPU"] == 1.0


def test_a_misspelt_swept_binding_fails_the_sweep_before_any_trial(tmp_path, capsys):
    from polyrl.cli import main

    bad = "polyrl.SweepConfig.space = {'actor/polyrl.OptimConfig.lrr': {'grid': [1e-3]}}"
    run_dir = f"polyrl.RunConfig.run_dir = {str(tmp_path)!r}"
    args = ["sweep", "--gin_file", "gin/sweeps/tiny_grpo_lr.gin"]
    assert main([*args, "--gin_param", bad, "--gin_param", run_dir]) == 1
    err = capsys.readouterr().err
    assert "swept binding 'actor/polyrl.OptimConfig.lrr'" in err
    assert "did you mean 'lr'" in err and not (tmp_path / "tune").exists()
