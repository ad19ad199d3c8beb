"""Benchmark: the GSM8K + Python-tool experiment's step against single-turn GRPO.

Writes synthetic GSM8K-format rows (verl's schema, made-up word problems: no download),
then runs ``polyrl train`` on ``gin/experiments/gsm8k_grpo.gin`` (single turn) and on
``gin/experiments/gsm8k_tool.gin`` (episodes of up to 4 turns with the Python tool) on the
same model and rows, each through ``grpo_step.py``, and prints side by side: the step
time, the generate and update phases, the sampled tokens per second of the rollout
(sampled tokens of the batch / generate seconds; observation tokens are not counted), the
update's tokens and MFU (grpo_step.py), turns and tool calls per episode and the
observation-token share.

A random-weight model (what the GPU machine has) never writes a ``<tool_call>``, so by
default the multi-turn run plays its rows with ``bench/gsm8k_every_turn``
(gsm8k_every_turn.py, imported into the run): the GSM8K env whose every turn is run as a Python program in the sandbox (a random text fails to parse:
an error observation), so each episode pays a sandbox run, an observation and a
continued prefix per turn up to ``max_turns`` or ``max_episode_tokens``: the path's full
cost at this shape. ``--real-calls`` uses the built-in env instead (a trained chat
model's own calls).

    python experiments/bench/gsm8k_tool.py --model /tmp/models/qwen2-0.5b-random-4k \\
        --json gsm8k_tool.json                                  # one GPU
    python experiments/bench/gsm8k_tool.py --model "$(polyrl make-tiny /tmp/tiny)" --cpu \\
        --steps 2 --skip 0                                      # a CPU smoke run

``--only tool`` runs the multi-turn run alone, and ``--tool-gin`` swaps its gin file: the
7B shape with LoRA on one GPU (gpu_run.sh's ``gsm8k_tool_7b`` section) is

    python experiments/bench/gsm8k_tool.py --model /tmp/models/qwen2-7b-random-8k --only tool \\
        --tool-gin gin/experiments/gsm8k_tool_7b_lora.gin --steps 3 --skip 1
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
TOOL_GIN = "gin/experiments/gsm8k_tool.gin"
ONLY = {"single": "single_turn", "tool": "multi_turn_tool"}  # --only's names of the runs
TITLES = {"single_turn": "single-turn", "multi_turn_tool": "multi-turn+tool"}
EVERY_TURN = "bench/gsm8k_every_turn"  # gsm8k_every_turn.py's env
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'


def gsm8k_rows(n: int, split: str, data_source: str = "openai/gsm8k") -> list[dict]:
    """Rows as verl's examples/data_preprocess/gsm8k.py writes them, with made-up word
    problems (GSM8K's own text would be a download)."""
    rng = random.Random(split)
    rows = []
    for i in range(n):
        a, b = rng.randint(2, 60), rng.randint(2, 60)
        question = f"Tom has {a} apples and buys {b} more. How many apples does he have?"
        rows.append(
            {
                "data_source": data_source,
                "prompt": [{"role": "user", "content": f"{question} {INSTRUCTION}"}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": str(a + b)},
                "extra_info": {"split": split, "index": i, "question": question},
            }
        )
    return rows


def _cpu_bindings() -> list[str]:
    return [
        'polyrl.RunConfig.pools = {"gpu": {"CPU": 2, "GPU": 0}}',
        'polyrl.RunConfig.weight_transport = "object_store"',  # no GPU to share
        'polyrl.RunConfig.model_dtype = "float32"',
        "polyrl.RunConfig.gradient_checkpointing = False",
        'polyrl.RolloutConfig.dtype = "float32"',
        "polyrl.RunConfig.prompts_per_step = 8",
        "polyrl.RunConfig.mini_batch_prompts = 8",
        "polyrl.SamplingSpec.n = 4",
        "polyrl.SamplingSpec.max_tokens = 16",
        "polyrl.RolloutConfig.max_model_len = 256",
        "polyrl.RolloutConfig.max_prompt_len = 128",
    ]


def summary(result: dict, rows: int) -> dict:
    """The numbers to compare, from grpo_step.py's result."""
    last = result["last_metrics"]
    generate = result["phases_s"].get("generate", float("nan"))
    sampled = last["response/length_mean"] * rows
    update = result.get("update") or {}
    return {
        "step_s": result["step_s"],
        "generate_s": generate,
        "update_actor_s": result["phases_s"].get("update_actor", float("nan")),
        "update_tokens": update.get("tokens"),
        "update_mfu": update.get("mfu"),
        "phases_s": result["phases_s"],
        "sampled_tokens": sampled,
        "rollout_tokens_per_s": sampled / generate,
        "rollout_limits": result["rollout_limits"],
        "turns_mean": last.get("episode/turns_mean", 1.0),
        "tool_calls_mean": last.get("episode/tool_calls_mean", 0.0),
        "observation_token_share": last.get("episode/observation_token_share", 0.0),
        "reward_mean": last["reward/mean"],
    }


def main(argv=None) -> dict:
    sys.path.insert(0, str(HERE))
    import grpo_step

    from polyrl.data.formats import write_dataset

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="HF model directory (positions >= 2048)")
    p.add_argument("--steps", type=int, default=4, help="timed steps, the --skip ones included")
    p.add_argument("--skip", type=int, default=1, help="warm-up steps left out of the means")
    p.add_argument("--rows", type=int, default=512, help="synthetic training rows")
    p.add_argument("--real-calls", action="store_true", help="the built-in env (module doc)")
    p.add_argument("--cpu", action="store_true", help="CPU pools and small shapes (a smoke run)")
    p.add_argument(
        "--only", choices=sorted(ONLY), help="one of the two runs: single (turn) or tool"
    )
    p.add_argument("--tool-gin", default=TOOL_GIN, help="the multi-turn run's gin file")
    p.add_argument("--gin_param", action="append", default=[], help="extra gin binding, both runs")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--json", help="write the result here")
    p.add_argument("--log-dir", help="write each run's training log here (default: dropped)")
    args = p.parse_args(argv)
    # the multi-turn run imports gsm8k_every_turn (its env) in the driver and the workers
    os.environ["PYTHONPATH"] = os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])
    out: dict = {"model": args.model, "every_turn_calls": not args.real_calls}
    if args.log_dir:
        Path(args.log_dir).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        runs = {
            "single_turn": ("gin/experiments/gsm8k_grpo.gin", "openai/gsm8k", []),
            "multi_turn_tool": (
                args.tool_gin,
                "openai/gsm8k" if args.real_calls else EVERY_TURN,
                [] if args.real_calls else ["polyrl.RunConfig.imports = ('gsm8k_every_turn',)"],
            ),
        }
        if args.cpu:  # episodes within the tiny model's 256 positions (the prompt with the
            # env's system message is ~200 tokens: two turns of 16 fit)
            runs["multi_turn_tool"][2].append("polyrl.EpisodeConfig.max_episode_tokens = 256")
        if args.only:
            runs = {ONLY[args.only]: runs[ONLY[args.only]]}
        for name, (gin, source, extra) in runs.items():
            train = write_dataset(
                gsm8k_rows(args.rows, "train", source), f"{tmp}/{name}/train.parquet"
            )
            val = write_dataset(gsm8k_rows(8, "test", source), f"{tmp}/{name}/test.parquet")
            params = [
                f"MODEL_PATH = {args.model!r}",
                f"TRAIN_FILES = {str(train)!r}",
                f"VAL_FILES = {str(val)!r}",
                "polyrl.RunConfig.eval_every = 0",
                "polyrl.RunConfig.save_every = 0",
                # no HF export after the last step (the 7B model's merged weights: 15 GB)
                "polyrl.RunConfig.export_final = False",
                "polyrl.RunConfig.tensorboard = False",
                # a random model would stop at random: every turn runs to max_tokens
                "polyrl.SamplingSpec.ignore_eos = True",
                *(_cpu_bindings() if args.cpu else []),
                *extra,
                *args.gin_param,
            ]
            argv_step = ["--gin", gin, "--steps", str(args.steps), "--skip", str(args.skip)]
            argv_step += ["--timeout", str(args.timeout), "--json", f"{tmp}/{name}.json"]
            argv_step += ["--log", f"{args.log_dir or tmp}/{name}.log"]
            for b in params:
                argv_step += ["--gin_param", b]
            print(f"=== {name}: {gin}", flush=True)
            grpo_step.main(argv_step)
            result = json.loads(Path(f"{tmp}/{name}.json").read_text())
            out[name] = summary(result, _batch_rows(params, gin))
    ran = [(TITLES[name], out[name]) for name in TITLES if name in out]
    print(f"{'':<30}" + "".join(f" {title:>16}" for title, _ in ran))
    for key, fmt in (
        ("step_s", "{:.2f}"),
        ("generate_s", "{:.2f}"),
        ("update_actor_s", "{:.2f}"),
        ("sampled_tokens", "{:.0f}"),
        ("rollout_tokens_per_s", "{:.0f}"),
        ("update_tokens", "{:.0f}"),
        ("update_mfu", "{:.1%}"),
        ("turns_mean", "{:.2f}"),
        ("tool_calls_mean", "{:.2f}"),
        ("observation_token_share", "{:.3f}"),
    ):
        cells = ("-" if run[key] is None else fmt.format(run[key]) for _, run in ran)
        print(f"{key:<30}" + "".join(f" {c:>16}" for c in cells))
    for name in ("max_num_seqs", "max_num_batched_tokens"):  # the engines' scheduler limits
        cells = (run["rollout_limits"].get(name, "-") for _, run in ran)
        print(f"{'rollout ' + name:<30}" + "".join(f" {c:>16}" for c in cells))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return out


def _batch_rows(params: list[str], gin: str) -> int:
    """prompts_per_step x n of the run (the parsed config)."""
    from polyrl.configure.launch import parse_config

    cfg, _ = parse_config([gin], params)
    return cfg.prompts_per_step * cfg.sampling.n


if __name__ == "__main__":
    main()
