"""vLLM's synchronous ``LLM.generate`` against the asynchronous engine (``AsyncLLM``) on
polyrl's rollout shape, and single-turn against multi-turn episodes on the rollout server.
Not a test; a table on stdout and ``--json``.

    python experiments/bench/async_engine.py                       # tiny model, CPU
    python experiments/bench/async_engine.py --shape cpu-13m       # a bigger CPU shape
    python experiments/bench/async_engine.py --model /tmp/models/qwen2-0.5b-random \\
        --prompts 64 --n 8 --prompt-len 64 --new-tokens 512 --repeats 3 --json a.json

Part ``engine`` (vLLM alone, token ids in, one seeded sample per request as the rollout
server builds them, ``ignore_eos``): each mode runs in a fresh process, the modes
alternate, ``--repeats`` rounds, medians reported (two processes running the same call
differ by several percent on a shared host: compare medians of interleaved runs).

* ``llm``: ``vllm.LLM.generate`` with the engine core in the calling process (polyrl's
  ``RolloutConfig(engine="sync")`` server).
* ``llm_mp``: the same with the engine core in its own process
  (``VLLM_ENABLE_V1_MULTIPROCESSING=1``): the process hop alone.
* ``async``: ``AsyncLLM`` (its engine core always has its own process), every request
  its own ``generate`` coroutine, all gathered at once, ``RequestOutputKind.FINAL_ONLY``.

``--allowed-ids N`` gives every request of the engine part ``allowed_token_ids`` of the
first N ids, as a rollout server sends them when the model's vocabulary is larger than its
tokenizer's (151,665 ids with Qwen2.5's tokenizer on its 151,936-row models; the random
models here carry the 58-token tiny tokenizer, so their servers send 58).

Part ``server`` (``--server``): polyrl's ``RolloutServer``, one process per engine
(``sync``: in-process engine core, the synchronous default; ``sync_mp``: its engine core
in its own process; ``async``). Single-turn: one ``generate`` call of all requests (a
GRPO step's rollout: all submitted at once). Multi-turn: episodes of ``--turns`` turns
(``--new-tokens / --turns`` tokens each), each turn continuing the episode's exact ids
plus ``--obs-len`` observation ids: on ``async`` every episode runs its own turn loop
(``generate_async`` per turn, all in flight), on ``sync`` the turns are batched (one
``generate`` call per turn, every episode's turn k together).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULT = "RESULT "  # the child's result line (vLLM prints to stdout too)

SHAPES = {
    "tiny": {},
    # ~13M parameters with the tiny vocabulary: the CPU shape where compute, not Python
    # per token, dominates a decode step.
    "cpu-13m": dict(
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=4,
        num_attention_heads=16,
        num_key_value_heads=4,
        max_position_embeddings=1024,
    ),
}


def model_dir(args) -> str:
    if args.model:
        return args.model
    from polyrl.data.tiny import TinyModelSpec, ensure_tiny_model

    root = Path(tempfile.gettempdir()) / "polyrl-bench-models" / args.shape
    return str(ensure_tiny_model(root, TinyModelSpec(**SHAPES[args.shape])))


def rollout_config(args, engine: str):
    from polyrl.rollout.sampling import RolloutConfig

    return RolloutConfig(
        model_path=model_dir(args),
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        kv_cache_gib=args.kv_cache_gib,
        gpu_memory_utilization=args.gpu_memory_utilization,
        engine=engine,
    )


def requests(args) -> list[tuple[int, list[int]]]:
    import numpy as np

    rng = np.random.default_rng(0)
    prompts = rng.integers(5, 50, size=(args.prompts, args.prompt_len)).tolist()
    return [(i * args.n + j, p) for i, p in enumerate(prompts) for j in range(args.n)]


def spec(args, max_tokens: int | None = None):
    from polyrl.rollout.sampling import SamplingSpec

    return SamplingSpec(
        max_tokens=max_tokens or args.new_tokens, ignore_eos=True, detokenize=False, seed=0
    )


# ------------------------------------------------------------------ engine part
def run_engine_mode(args) -> dict:
    """One mode in this process (the child of ``engine_part``)."""
    import asyncio

    if args.child.startswith("server:"):
        return run_server_mode(args)

    from polyrl.rollout.engines import scheduler_limits
    from polyrl.rollout.server import engine_kwargs, vllm_requests

    mode = args.child
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if mode == "llm" else "1"
    config = rollout_config(args, "sync" if mode != "async" else "async")
    kwargs = engine_kwargs(config, on_gpu=_on_gpu())
    reqs = requests(args)
    # --allowed-ids: every request restricted to the first N ids, as a server restricts
    # sampling to its tokenizer's ids (RolloutConfig.restrict_to_tokenizer; Qwen2.5's
    # tokenizer: 151,665 of the model's 151,936): what that list costs per request
    mask = {"allowed_token_ids": list(range(args.allowed_ids))} if args.allowed_ids else {}
    prompts, params = vllm_requests(reqs, spec(args), mask)
    times, limits = [], {}  # limits: the engine's scheduler's, read back
    if mode == "async":
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.sampling_params import RequestOutputKind
        from vllm.v1.engine.async_llm import AsyncLLM

        for p in params:
            p.output_kind = RequestOutputKind.FINAL_ONLY

        async def main() -> list:
            engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs))
            limits.update(scheduler_limits(engine.vllm_config))

            async def one(k: int, rid: str) -> int:
                async for out in engine.generate(prompts[k], params[k], rid):
                    final = out
                return len(final.outputs[0].token_ids)

            for r in range(args.calls + 1):
                t0 = time.perf_counter()
                counts = await asyncio.gather(*(one(k, f"{r}-{k}") for k in range(len(reqs))))
                times.append((time.perf_counter() - t0, sum(counts)))
            engine.shutdown()
            return times

        asyncio.run(main())
    else:
        from vllm import LLM

        llm = LLM(**kwargs)
        limits.update(scheduler_limits(llm.llm_engine.vllm_config))
        for _ in range(args.calls + 1):
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            times.append((time.perf_counter() - t0, sum(len(o.outputs[0].token_ids) for o in outs)))
    steady = times[1:]  # the first call warms the engine up
    seconds = statistics.median(t for t, _ in steady)
    tokens = steady[0][1]
    return {"mode": mode, "step_s": seconds, "tok_s": tokens / seconds, **limits}


def _on_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def _child(args, mode: str) -> dict:
    cmd = [sys.executable, __file__, "--child", mode, *sys.argv[1:]]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode:
        sys.stderr.write(out.stderr[-4000:])
        raise RuntimeError(f"mode {mode} failed (rc {out.returncode})")
    lines = [x for x in out.stdout.splitlines() if x.startswith(RESULT)]
    if not lines:
        sys.stderr.write(out.stdout[-2000:] + out.stderr[-4000:])
        raise RuntimeError(f"mode {mode} printed no result")
    return json.loads(lines[-1][len(RESULT) :])


def interleaved(args, modes: list[str]) -> dict:
    """Each mode ``--repeats`` times, in a fresh process each, the modes alternating."""
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    for _ in range(args.repeats):
        for m in modes:
            runs[m].append(_child(args, m))
    out = {}
    for m, rs in runs.items():
        out[m] = {k: statistics.median(r[k] for r in rs) for k in rs[0] if k != "mode"}
        out[m]["tok_s_runs"] = [round(r["tok_s"], 1) for r in rs]
    first = out[modes[0]]["tok_s"]
    for m in out:
        out[m][f"vs_{modes[0]}"] = out[m]["tok_s"] / first
    return out


# ------------------------------------------------------------------ server part
def _multi_turn_batched(server, reqs, args, turn_spec, obs) -> None:
    """Every episode's turn k in one ``generate`` call (the synchronous engine's way)."""
    ids = [list(p) for _, p in reqs]
    for k in range(args.turns):
        res = server.generate([(i * args.turns + k, ids[i]) for i in range(len(reqs))], turn_spec)
        for i, r in enumerate(res):
            ids[i] += list(map(int, r["token_ids"])) + obs


async def _multi_turn_concurrent(server, reqs, args, turn_spec, obs) -> None:
    """Each episode its own turn loop, all in flight together (``generate_async``)."""
    import asyncio

    async def episode(i: int) -> None:
        ids = list(reqs[i][1])
        for k in range(args.turns):
            (r,) = await server.generate_async([(i * args.turns + k, ids)], turn_spec)
            ids = ids + list(map(int, r["token_ids"])) + obs

    await asyncio.gather(*(episode(i) for i in range(len(reqs))))


def run_server_mode(args) -> dict:
    """polyrl's RolloutServer of one engine in this process (the child of
    ``server_part``): ``sync`` (in-process engine core, the former default), ``sync_mp``
    (``in_process_engine=False``) or ``async``."""
    import asyncio
    import dataclasses

    from polyrl.rollout.server import RolloutServer

    engine = args.child.split(":")[1]
    config = rollout_config(args, "async" if engine == "async" else "sync")
    config = dataclasses.replace(config, in_process_engine=engine == "sync")
    t0 = time.perf_counter()
    server = RolloutServer(config)
    start_s = time.perf_counter() - t0
    reqs, s = requests(args), spec(args)
    server.generate(reqs[:4], s)  # warm-up
    single = []
    for _ in range(args.calls):
        t0 = time.perf_counter()
        res = server.generate(reqs, s)
        single.append((time.perf_counter() - t0, sum(len(r["token_ids"]) for r in res)))
    turn_spec = spec(args, args.new_tokens // args.turns)
    obs = list(range(5, 5 + args.obs_len))
    multi = []
    for _ in range(args.calls):
        t0 = time.perf_counter()
        if engine == "async":
            asyncio.run(_multi_turn_concurrent(server, reqs, args, turn_spec, obs))
        else:
            _multi_turn_batched(server, reqs, args, turn_spec, obs)
        multi.append(time.perf_counter() - t0)
    limits = {k: server.info()[k] for k in ("max_num_seqs", "max_num_batched_tokens")}
    server.shutdown()
    t_single, t_multi = statistics.median(t for t, _ in single), statistics.median(multi)
    return {
        "mode": args.child,
        "start_s": start_s,
        "single_turn_step_s": t_single,
        "tok_s": single[0][1] / t_single,
        "multi_turn_step_s": t_multi,
        "multi_turn_episodes_s": len(reqs) / t_multi,
        **limits,
    }


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="HF model directory (default: --shape, built locally)")
    p.add_argument("--shape", default="tiny", choices=sorted(SHAPES))
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--turns", type=int, default=3, help="turns of a multi-turn episode")
    p.add_argument("--obs-len", type=int, default=8, help="observation ids between turns")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--max-model-len", type=int, default=256)
    p.add_argument("--kv-cache-gib", type=float, default=0.5, help="CPU")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.35, help="GPU")
    p.add_argument("--calls", type=int, default=3, help="timed calls per process")
    p.add_argument("--repeats", type=int, default=3, help="processes per engine mode")
    p.add_argument("--modes", default="llm,llm_mp,async")
    p.add_argument(
        "--allowed-ids",
        type=int,
        default=0,
        help="engine part: allowed_token_ids of the first N ids on every request (151665: "
        "Qwen2.5's tokenizer; the model needs more rows)",
    )
    p.add_argument("--server", action="store_true", help="also the RolloutServer part")
    p.add_argument("--server-engines", default="sync,sync_mp,async")
    p.add_argument("--no-engine", action="store_true", help="skip the engine part")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(RESULT + json.dumps(run_engine_mode(args)), flush=True)
        return {}
    result: dict = {"args": {k: v for k, v in vars(args).items() if k != "child"}}
    if not args.no_engine:
        result["engine"] = interleaved(args, args.modes.split(","))
        print(
            f"{'vLLM alone':<10} {'step s':>7} {'tok/s':>9} {'vs llm':>7} {'seqs':>5} "
            f"{'batched':>7}  tok/s of each run"
        )
        for m, r in result["engine"].items():
            print(
                f"{m:<10} {r['step_s']:>7.3f} {r['tok_s']:>9.1f} {r['vs_llm']:>7.3f} "
                f"{r['max_num_seqs']:>5.0f} {r['max_num_batched_tokens']:>7.0f}  {r['tok_s_runs']}"
            )
    if args.server:
        modes = [f"server:{e}" for e in args.server_engines.split(",")]
        result["server"] = interleaved(args, modes)
        print(
            f"{'RolloutServer':<15} {'start s':>8} {'1-turn s':>9} {'tok/s':>9} {'vs sync':>8} "
            f"{'multi-turn s':>13} {'episodes/s':>11} {'seqs':>5} {'batched':>7}"
        )
        for m, r in result["server"].items():
            print(
                f"{m:<15} {r['start_s']:>8.1f} {r['single_turn_step_s']:>9.3f} {r['tok_s']:>9.1f} "
                f"{r[f'vs_{modes[0]}']:>8.3f} {r['multi_turn_step_s']:>13.3f} "
                f"{r['multi_turn_episodes_s']:>11.1f} {r['max_num_seqs']:>5.0f} "
                f"{r['max_num_batched_tokens']:>7.0f}"
            )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
