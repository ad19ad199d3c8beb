"""The main job until the RL trainer lands: build the tiny model and tasks, sample with
vLLM (CPU build), score with the rule-based rewards.

    make demo        # or: .venv/bin/python experiments/tiny_generate.py --out runs/demo

Prints one line per task (prompts, samples, mean reward, tokens/s) and writes
``<out>/samples.jsonl``. A random model scores near 0 on addition and ~0.1 or less on
copy: the RL trainer's job is to raise these.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/demo")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=4, help="samples per prompt")
    parser.add_argument("--max-tokens", type=int, default=8)
    args = parser.parse_args()

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    from polyrl.data.prompts import encode_prompts
    from polyrl.data.schema import validate_rows
    from polyrl.data.tasks import make_rows
    from polyrl.data.tiny import ensure_tiny_model
    from polyrl.rewards import get_reward_fn

    out = Path(args.out)
    model = ensure_tiny_model(out / "models")
    tokenizer = AutoTokenizer.from_pretrained(model)
    print(f"[demo] tiny model: {model}")
    t0 = time.perf_counter()
    llm = LLM(str(model), dtype="float32", enforce_eager=True, max_model_len=128, seed=0)
    print(f"[demo] vLLM started in {time.perf_counter() - t0:.1f} s")
    # The embedding is padded past the tokenizer's vocabulary: never sample those rows.
    params = SamplingParams(
        n=args.n, temperature=1.0, max_tokens=args.max_tokens, seed=0,
        allowed_token_ids=list(range(len(tokenizer))),
    )
    records = []
    for task in ("copy", "addition"):
        rows = make_rows(task, args.prompts, seed=0, split="demo")
        report = validate_rows(rows, tokenizer=tokenizer)
        prompts = encode_prompts(tokenizer, rows)
        t0 = time.perf_counter()
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        seconds = time.perf_counter() - t0
        reward = get_reward_fn(rows[0]["data_source"])
        scores, n_tokens = [], 0
        for row, output in zip(rows, outputs):
            for sample in output.outputs:
                score = reward(sample.text, row["ground_truth"], row.get("extra_info"))
                scores.append(score)
                n_tokens += len(sample.token_ids)
                records.append({"task": task, "prompt": row["prompt"][0]["content"],
                                "response": sample.text, "reward": score})
        print(
            f"[demo] {task:<8} {report.n_rows} prompts x {args.n} samples: mean reward "
            f"{sum(scores) / len(scores):.3f}, {n_tokens / seconds:.0f} generated tok/s"
        )
    with (out / "samples.jsonl").open("w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    print(f"[demo] samples written to {out / 'samples.jsonl'}")


if __name__ == "__main__":
    main()
