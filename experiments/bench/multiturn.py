"""Multi-turn episodes per second, and polyrl's overhead per turn. Not a test; a table on
stdout and ``--json``.

    python experiments/bench/multiturn.py                     # tiny model, CPU
    python experiments/bench/multiturn.py --model DIR --prompts 64 --n 8 --max-tokens 64

Runs the guessing game (``polyrl/guess``) through ``EpisodeRunner`` on one rollout server
and one env worker, ``--batches`` times after one warm-up batch. Every episode runs its
own turns concurrently (rollout calls and env calls of different episodes overlap), so a
batch's wall time does not split into parts; polyrl's own work is the driver process's
CPU time during the batch (the episodes' asyncio loop, Ray calls, the chat template for
each observation, the drift check, the batch), and that divided by the turns is the
overhead per turn. Compared with one single-turn ``RolloutPool.generate`` of the same
prompts and turn length (``--max-tokens``).

``--agent`` plays the same game as an agent written against the ``openai`` client
(``polyrl.envs.register_agent``) through polyrl's OpenAI endpoint: the driver's time then
holds the endpoint's HTTP round trips, chat template and recording, and the agent's own
code.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path


async def guess_agent(row, client):
    """The guessing game through the openai client: a hint after each wrong guess."""
    messages, secret = list(row["prompt"]), str(row["ground_truth"])
    for k in range(4):
        reply = await client.chat.completions.create(model="policy", messages=messages)
        text = (reply.choices[0].message.content or "").strip()
        if text == secret:
            return 1.0 - 0.25 * k
        hint = ("+" if int(text) < int(secret) else "-") if text.isdigit() else "try"
        messages += [reply.choices[0].message, {"role": "user", "content": hint}]
    return 0.0


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="HF model directory (default: the tiny model)")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=3, help="per turn")
    p.add_argument("--max-turns", type=int, default=4)
    p.add_argument("--episode-tokens", type=int, default=64)
    p.add_argument("--batches", type=int, default=5)
    p.add_argument("--json", help="write the results here")
    p.add_argument("--agent", action="store_true", help="play it as an OpenAI-client agent")
    args = p.parse_args(argv)

    import ray
    from transformers import AutoTokenizer

    from polyrl.data.loader import PromptSource
    from polyrl.data.tiny import ensure_tiny_model
    from polyrl.envs import EpisodeConfig, register_agent
    from polyrl.envs.workers import EnvPool
    from polyrl.rollout import RolloutConfig, RolloutPool, SamplingSpec
    from polyrl.rollout.episodes import EpisodeRunner

    register_agent("bench/guess_agent")(guess_agent)
    model = args.model or str(ensure_tiny_model(Path(tempfile.gettempdir()) / "polyrl-bench"))
    tokenizer = AutoTokenizer.from_pretrained(model)
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    episodes_per_batch = args.prompts * args.n
    pool = RolloutPool(
        RolloutConfig(
            model_path=model,
            dtype="float32",
            max_model_len=args.episode_tokens + 16,
            kv_cache_gib=0.5,
        )
    )
    config = EpisodeConfig(
        max_turns=args.max_turns, max_episode_tokens=args.episode_tokens, env_workers=1
    )
    envs = EnvPool(1, config.env_timeout_s)
    runner = EpisodeRunner(pool, envs, tokenizer, config)
    source = PromptSource.from_task("guess", 1024, tokenizer)
    spec = SamplingSpec(n=args.n, max_tokens=args.max_tokens, seed=0)
    rows = []
    try:
        for k in range(args.batches + 1):
            prompts = source.batch(k, args.prompts)
            if args.agent:
                sources = ["bench/guess_agent"] * len(prompts)
                prompts = prompts.with_columns(meta={"data_source": sources})
            t0, cpu0 = time.perf_counter(), time.process_time()
            batch = runner.generate(prompts, spec)
            wall, driver = time.perf_counter() - t0, time.process_time() - cpu0
            turns = int(batch["num_turns"].sum())
            t1 = time.perf_counter()
            single = pool.generate(prompts, spec)
            single_wall = time.perf_counter() - t1
            rows.append(
                {
                    "wall_s": wall,
                    "episodes_per_s": len(batch) / wall,
                    "turns": turns,
                    "driver_cpu_s": driver,
                    "overhead_per_turn_ms": 1e3 * driver / max(turns, 1),
                    "single_turn_generate_s": single_wall,
                    "sampled_tokens": int(batch["response_mask"].sum()),
                    "single_turn_tokens": int(single["response_mask"].sum()),
                }
            )
        limits = pool.limits  # the engine's scheduler limits, read back
    finally:
        runner.shutdown()
        pool.shutdown()
        ray.shutdown()
    warm = rows[1:]
    out = {
        "model": model,
        "episodes_per_batch": episodes_per_batch,
        "rollout_limits": limits,
        "batches": warm,
        "median": {k: statistics.median(r[k] for r in warm) for k in warm[0]},
    }
    med = out["median"]
    kind = "agent (openai client)" if args.agent else "env"
    print(
        f"{episodes_per_batch} guess episodes ({kind}) a batch, median of {len(warm)} warm batches:"
    )
    print(
        f"  wall {med['wall_s']:.3f} s  = {med['episodes_per_s']:.1f} episodes/s "
        f"(scheduler limits {limits})"
    )
    print(
        f"  polyrl in the driver {med['driver_cpu_s']:.3f} CPU s over {med['turns']:.0f} "
        f"turns = {med['overhead_per_turn_ms']:.3f} ms a turn"
    )
    print(
        f"  one single-turn generate of the same prompts: {med['single_turn_generate_s']:.3f} s "
        f"({med['single_turn_tokens']:.0f} tokens vs {med['sampled_tokens']:.0f} sampled "
        f"over the episodes)"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1, default=float))
    return out


if __name__ == "__main__":
    main()
