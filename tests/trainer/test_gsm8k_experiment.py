"""gin/experiments/gsm8k_grpo.gin on a synthetic GSM8K-format file (verl schema, made
here) and the tiny model: the config validates, a missing macro is named, and (slow) a
short run trains and validates with the math reward."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from polyrl.data.formats import write_dataset
from polyrl.data.schema import validate_file
from polyrl.launch import parse_config
from polyrl.validate import check_run

GSM8K = "gin/experiments/gsm8k_grpo.gin"
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'


def gsm8k_rows(n: int, split: str) -> list[dict]:
    """Rows as verl's examples/data_preprocess/gsm8k.py writes them, with made-up word
    problems (GSM8K's own text would be a download)."""
    rng = random.Random(split)
    rows = []
    for i in range(n):
        a, b = rng.randint(2, 60), rng.randint(2, 60)
        question = f"Tom has {a} apples and buys {b} more. How many apples does he have?"
        rows.append(
            {
                "data_source": "openai/gsm8k",
                "prompt": [{"role": "user", "content": f"{question} {INSTRUCTION}"}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": str(a + b)},
                "extra_info": {"split": split, "index": i, "question": question},
            }
        )
    return rows


def _bindings(tmp_path: Path, model: Path) -> list[str]:
    train = write_dataset(gsm8k_rows(32, "train"), tmp_path / "gsm8k" / "train.parquet")
    test = write_dataset(gsm8k_rows(8, "test"), tmp_path / "gsm8k" / "test.parquet")
    cpu = "{'shared': {'CPU': 2.0, 'GPU': 0.0}}"
    roles = "{'actor': 'shared', 'reference': 'shared', 'rollout': 'shared'}"
    return [
        f"MODEL_PATH = {str(model)!r}",
        f"TRAIN_FILES = {str(train)!r}",
        f"VAL_FILES = {str(test)!r}",
        # the tiny model on CPU instead of a real one on a GPU
        f"polyrl.RunConfig.run_dir = {str(tmp_path / 'run')!r}",
        f"polyrl.RunConfig.pools = {cpu}",
        f"polyrl.RunConfig.role_pools = {roles}",
        "polyrl.RunConfig.model_dtype = 'float32'",
        "polyrl.RunConfig.gradient_checkpointing = False",
        "polyrl.RunConfig.tensorboard = False",
        "polyrl.RunConfig.save_every = 0",
        "polyrl.RunConfig.total_steps = 2",
        "polyrl.RunConfig.eval_every = 1",
        "polyrl.RunConfig.prompts_per_step = 4",
        "polyrl.RunConfig.mini_batch_prompts = 4",
        "polyrl.SamplingSpec.n = 2",
        "polyrl.SamplingSpec.max_tokens = 16",
        "polyrl.RolloutConfig.dtype = 'float32'",
        "polyrl.RolloutConfig.max_model_len = 256",
        "polyrl.RolloutConfig.max_prompt_len = 128",
        "polyrl.RolloutConfig.gpu_memory_utilization = 0.9",
    ]


def test_gsm8k_experiment_validates(tmp_path, tiny_model_dir):
    from polyrl.algos import get_algorithm

    cfg, _ = parse_config([GSM8K], _bindings(tmp_path, tiny_model_dir))
    assert cfg.model_path == str(tiny_model_dir) and cfg.eval_every == 1
    assert check_run(cfg, get_algorithm("grpo"), cluster=False) == []
    report = validate_file(cfg.train_files[0])
    assert report.schema == "verl" and report.data_sources == {"openai/gsm8k": 32}


def test_missing_macro_is_named(tmp_path):
    from polyrl.validate import ConfigError

    with pytest.raises(
        ConfigError, match=r"gin macro MODEL_PATH is not bound.*--gin_param .MODEL_PATH = "
    ):
        parse_config([GSM8K], [f"polyrl.RunConfig.run_dir = {str(tmp_path)!r}"])


@pytest.mark.slow
def test_gsm8k_experiment_runs_with_validation(tmp_path, tiny_model_dir):
    import ray

    from polyrl.launch import train
    from polyrl.metrics import read_jsonl

    if not ray.is_initialized():
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    train([GSM8K], _bindings(tmp_path, tiny_model_dir))
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2]
    for row in rows:
        assert 0.0 <= row["val/openai/gsm8k/pass@1"] <= 1.0
    assert (tmp_path / "run" / "val_samples" / "step_2.jsonl").exists()
