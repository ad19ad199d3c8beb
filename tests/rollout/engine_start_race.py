"""The rollout server start of test_gpu_engine_start.py, in a process of its own (the
test's GPU memory is then another process's to vLLM): ``python engine_start_race.py
MODEL_DIR ENGINE RETRIES``. RETRIES "server": a ``RolloutServer`` of
``RolloutConfig(engine=ENGINE)``; a number: its engine started as the server starts it,
with at most that many retries. Then 4 tokens are generated and "generated 4 tokens"
printed."""

from __future__ import annotations

import logging
import os
import sys

from polyrl.rollout import RolloutConfig, RolloutServer, SamplingSpec
from polyrl.rollout.engine_start import free_gpu_memory, start_engine
from polyrl.rollout.engines import make_engine
from polyrl.rollout.server import engine_kwargs, server_env


def main(model_dir: str, engine: str, retries: str) -> None:
    logging.basicConfig(level=logging.WARNING)  # start_engine's retry lines
    config = RolloutConfig(
        model_path=model_dir,
        engine=engine,
        dtype="float32",
        max_model_len=256,
        gpu_memory_utilization=0.2,
    )
    os.environ.update(server_env(config))  # before vLLM reads it, as a server's actor has it
    # A server's Ray actor gets its engine core spawned (vLLM forces it in Ray actors); a
    # plain process would fork it, which fails once this process touched CUDA ("Cannot
    # re-initialize CUDA in forked subprocess", seen on an H100 with the async engine)
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    if retries == "server":
        server = RolloutServer(config)
        out = server.generate([(0, [1, 2, 3])], SamplingSpec(max_tokens=4, ignore_eos=True))
        print(f"generated {len(out[0]['token_ids'])} tokens", flush=True)
        server.shutdown()
        return
    from vllm import SamplingParams

    kwargs = engine_kwargs(config, on_gpu=True)
    llm = start_engine(
        lambda: make_engine(config.asynchronous, kwargs),
        free_gpu_memory,
        "race server",
        retries=int(retries),
    )
    out = llm.generate(
        [{"prompt_token_ids": [1, 2, 3]}], [SamplingParams(max_tokens=4, ignore_eos=True)]
    )
    print(f"generated {len(out[0].outputs[0].token_ids)} tokens", flush=True)
    llm.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:])
