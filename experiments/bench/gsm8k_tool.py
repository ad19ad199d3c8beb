"""Benchmark: the GSM8K + Python-tool experiment's step against single-turn GRPO.

Writes synthetic GSM8K-format rows (verl's schema, made-up word problems: no download),
then runs ``polyrl train`` on the same model and rows, each run through ``grpo_step.py``
(``--only``'s short names):

- ``single``: ``gin/experiments/gsm8k_grpo.gin`` (single turn) on vLLM's synchronous
  engine (``RolloutConfig.engine = "sync"``, bound), for the engines' comparison;
- ``single_async``: the same as users get it, on the asynchronous engine, the one every
  run takes (the comparison issue 46's goal is set on);
- ``tool``: ``gin/experiments/gsm8k_tool.gin`` (episodes of up to 4 turns with the
  Python tool);
- ``tool_nosandbox``: the same episodes without the sandbox (below);

and prints side by side: the step time, the generate and update phases, the sampled
tokens per second of the rollout (sampled tokens of the batch / generate seconds;
observation tokens are not counted), the update's tokens and MFU (grpo_step.py), turns
and tool calls per episode, the observation-token share and the last step's episode
metrics (a tool call's seconds, the share of calls that failed, of a continued turn's
prompt the prefix cache held, of turns cut at their limit). Under the table: the
multi-turn run's sampled tokens/s over ``single_async``'s (goal >= 0.9), the same for
the no-sandbox run, and the sandbox's seconds of the multi-turn generate phase (``tool``'s
generate time less ``tool_nosandbox``'s) and their share of it.

A random-weight model (what the GPU machine has) never writes a ``<tool_call>``, so by
default the multi-turn run plays its rows with ``bench/gsm8k_every_turn``
(gsm8k_every_turn.py, imported into the run): the GSM8K env whose every turn is run as a
Python program in the sandbox (a random text fails to parse: an error observation), so
each episode pays a sandbox run, an observation and a continued prefix per turn up to
``max_turns`` or ``max_episode_tokens``: the path's full cost at this shape. The
no-sandbox run plays them with ``bench/gsm8k_every_turn_nosandbox``: the same tool
through the same env workers, whose function compiles the text in the worker's process
instead of starting the sandbox, and returns the sandbox's observation for a text that
does not compile (the same text, so the same observation tokens; a text that compiles
gets an empty program's output). ``--real-calls`` plays the multi-turn run with the
built-in env instead (a trained chat model's own calls; no no-sandbox run then).

    python experiments/bench/gsm8k_tool.py --model /tmp/models/qwen2-0.5b-random-4k \\
        --json gsm8k_tool.json                                  # one GPU, all four runs
    polyrl make-tiny /tmp/tiny && python experiments/bench/gsm8k_tool.py \\
        --model /tmp/tiny/models/tiny-qwen2-* --cpu --steps 2 --skip 0   # a CPU smoke run

Each GPU run takes ~2-2.5 minutes (start-up and 3 steps on the 0.5B shape): runs split
over calls (``--only single_async,tool`` then ``--only tool_nosandbox,single``, each with
its ``--json``) are put in one table, with the comparisons, by ``--table A.json B.json``.

``--only tool`` runs the multi-turn run alone, and ``--tool-gin`` swaps the multi-turn
runs' gin file: the 7B shape with LoRA on one GPU (gpu_run.sh's ``gsm8k_tool_7b``
section) is

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
# --only's short name: (the run's name, its title in the table), in the table's order
RUNS = {
    "single": ("single_turn", "single-turn"),
    "single_async": ("single_turn_async", "single-turn (async)"),
    "tool": ("multi_turn_tool", "multi-turn+tool"),
    "tool_nosandbox": ("multi_turn_nosandbox", "multi-turn, no sandbox"),
}
EVERY_TURN = "bench/gsm8k_every_turn"  # gsm8k_every_turn.py's envs
NO_SANDBOX = "bench/gsm8k_every_turn_nosandbox"
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


# the episode metrics the table shows (the run's last step): seconds a tool call took (a
# sandbox run: in the env worker, beside the other episodes' turns), the share of calls
# that failed, of a continued turn's prompt tokens the engine's prefix cache held, of
# turns cut at their token limit, how many episodes had a turn at the rollout server
# and in an env step on average over the play (of the batch's episodes: a single-turn
# batch holds all of them at the server until its requests end), the play's seconds, and
# the generate call's seconds outside it: before (the envs' resets, the prompts' tokens),
# from the last answer to the loop's end (the close-out of the episodes that ended last),
# after (closing envs) and the batch (docs/agents.md "Metrics")
EPISODE_METRICS = (
    "tool_latency_s",
    "tool_error_share",
    "prefix_cache_share",
    "turn_cut_share",
    "sampling_in_flight_mean",
    "env_in_flight_mean",
    "play_s",
    "start_s",
    "close_out_s",
    "finish_s",
    "assemble_s",
)


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
        # the last step's episode metrics (polyrl/rollout/episodes.py); None: single-turn
        **{key: last.get(f"episode/{key}") for key in EPISODE_METRICS},
        "reward_mean": last["reward/mean"],
    }


def only_runs(text: str) -> list[str]:
    """``--only``'s comma-separated short names (:data:`RUNS`) as run names, in the
    table's order."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in RUNS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"{text!r} names {'no run' if not names else f'unknown run(s) {unknown}'}; "
            f"give a comma-separated list of {', '.join(RUNS)}"
        )
    return [run for short, (run, _) in RUNS.items() if short in names]


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="HF model directory (positions >= 2048)")
    p.add_argument("--steps", type=int, default=4, help="timed steps, the --skip ones included")
    p.add_argument("--skip", type=int, default=1, help="warm-up steps left out of the means")
    p.add_argument("--rows", type=int, default=512, help="synthetic training rows")
    p.add_argument("--real-calls", action="store_true", help="the built-in env (module doc)")
    p.add_argument("--cpu", action="store_true", help="CPU pools and small shapes (a smoke run)")
    p.add_argument(
        "--only",
        type=only_runs,
        help=f"the runs, comma-separated, of {', '.join(RUNS)} (default: all)",
    )
    p.add_argument("--tool-gin", default=TOOL_GIN, help="the multi-turn runs' gin file")
    p.add_argument("--gin_param", action="append", default=[], help="extra gin binding, all runs")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--json", help="write the result here (after each run, and at the end)")
    p.add_argument("--log-dir", help="write each run's training log here (default: dropped)")
    p.add_argument(
        "--table",
        nargs="+",
        metavar="JSON",
        help="run nothing: print the table of these files' runs (this bench's --json, e.g. of "
        "two GPU calls; a run in several files: the last file's)",
    )
    args = p.parse_args(argv)
    if args.table:
        out = merged(args.table)
    elif args.model is None:
        p.error("--model is required (or --table, to print saved results)")
    else:
        out = run_bench(args, p)
    out["comparisons"] = report(out)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return out


def run_bench(args: argparse.Namespace, p: argparse.ArgumentParser) -> dict:
    """Run the chosen runs, each through grpo_step.py; their summaries by run name."""
    sys.path.insert(0, str(HERE))
    import grpo_step

    from polyrl.data.formats import write_dataset

    names = args.only or [name for name, _ in RUNS.values()]
    if args.real_calls and "multi_turn_nosandbox" in names:
        if args.only:
            p.error(
                "--only tool_nosandbox: the no-sandbox run plays the every-turn env and "
                "--real-calls the built-in one; drop one of them"
            )
        names.remove("multi_turn_nosandbox")
    # the multi-turn runs import gsm8k_every_turn (their envs) in the driver and the workers
    os.environ["PYTHONPATH"] = os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])
    out: dict = {"model": args.model, "every_turn_calls": not args.real_calls}
    if args.log_dir:
        Path(args.log_dir).mkdir(parents=True, exist_ok=True)
    imports = ["polyrl.RunConfig.imports = ('gsm8k_every_turn',)"]
    # on CPU, episodes within the tiny model's 256 positions (the prompt with the env's
    # system message is ~200 tokens: a turn of 16 fits, its observation mostly not, and
    # the episode ends there at max_episode_tokens)
    fit = ["polyrl.EpisodeConfig.max_episode_tokens = 256"] if args.cpu else []
    runs = {
        "single_turn": (
            "gin/experiments/gsm8k_grpo.gin",
            "openai/gsm8k",
            ["polyrl.RolloutConfig.engine = 'sync'"],
        ),
        "single_turn_async": ("gin/experiments/gsm8k_grpo.gin", "openai/gsm8k", []),
        "multi_turn_tool": (
            args.tool_gin,
            "openai/gsm8k" if args.real_calls else EVERY_TURN,
            ([] if args.real_calls else imports) + fit,
        ),
        "multi_turn_nosandbox": (args.tool_gin, NO_SANDBOX, imports + fit),
    }
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            gin, source, extra = runs[name]
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
            if args.json:  # a run stopped later (a device call's limit) keeps these
                Path(args.json).write_text(json.dumps(out, indent=1))
    return out


def merged(files: list[str]) -> dict:
    """The runs of several of this bench's JSON files, by run name (the last file's where
    two have one); says so where the files' models differ."""
    out: dict = {}
    models = set()
    for f in files:
        data = json.loads(Path(f).read_text())
        models.add(data.get("model"))
        out |= {name: data[name] for name, _ in RUNS.values() if name in data}
    if len(models) > 1:
        print(f"note: these runs are of different models: {sorted(map(str, models))}")
    return out | {"model": models.pop() if len(models) == 1 else sorted(map(str, models))}


ROWS = (
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
    *((key, "{:.3f}") for key in EPISODE_METRICS),
)


def report(out: dict) -> dict:
    """Print the table of the runs in ``out`` (a column a run, '-' where a run has no
    such figure) and :func:`comparisons` under it; returns those."""
    ran = [(title, out[name]) for name, title in RUNS.values() if name in out]
    print(f"{'':<30}" + "".join(f" {title:>22}" for title, _ in ran))
    for key, fmt in ROWS:
        cells = ("-" if run.get(key) is None else fmt.format(run[key]) for _, run in ran)
        print(f"{key:<30}" + "".join(f" {c:>22}" for c in cells))
    for name in ("max_num_seqs", "max_num_batched_tokens"):  # the engines' scheduler limits
        cells = (run.get("rollout_limits", {}).get(name, "-") for _, run in ran)
        print(f"{'rollout ' + name:<30}" + "".join(f" {c:>22}" for c in cells))
    found = comparisons(out)
    if "tool_over_single_async" in found:
        print(
            "multi-turn / single-turn, same engine: "
            f"{found['tool_over_single_async']:.2f}x (goal >= 0.9)"
        )
    if "nosandbox_over_single_async" in found:
        print(
            "multi-turn without the sandbox / single-turn, same engine: "
            f"{found['nosandbox_over_single_async']:.2f}x"
        )
    if "sandbox_s" in found:
        tool, bare = out["multi_turn_tool"]["generate_s"], out["multi_turn_nosandbox"]["generate_s"]
        print(
            f"sandbox's share of generate: ({tool:.2f} - {bare:.2f}) s = "
            f"{found['sandbox_share_of_generate']:.1%}"
        )
    return found


def comparisons(out: dict) -> dict:
    """Issue 46's figures from the runs in ``out``, where both runs of one are there: the
    multi-turn run's sampled tokens/s over the single-turn run's on the same
    (asynchronous) engine, with the sandbox and without, and the sandbox's seconds of the
    multi-turn generate phase (its generate time less the no-sandbox run's) and their
    share of it."""
    single, tool, bare = (
        out.get(name) for name in ("single_turn_async", "multi_turn_tool", "multi_turn_nosandbox")
    )
    found = {}
    if single and tool:
        found["tool_over_single_async"] = (
            tool["rollout_tokens_per_s"] / single["rollout_tokens_per_s"]
        )
    if single and bare:
        found["nosandbox_over_single_async"] = (
            bare["rollout_tokens_per_s"] / single["rollout_tokens_per_s"]
        )
    if tool and bare:
        found["sandbox_s"] = tool["generate_s"] - bare["generate_s"]
        found["sandbox_share_of_generate"] = found["sandbox_s"] / tool["generate_s"]
    return found


def _batch_rows(params: list[str], gin: str) -> int:
    """prompts_per_step x n of the run (the parsed config)."""
    from polyrl.configure.launch import parse_config

    cfg, _ = parse_config([gin], params)
    return cfg.prompts_per_step * cfg.sampling.n


if __name__ == "__main__":
    main()
