"""One tensor-parallel rank of test_load_plan's TP test (run as a script, two at once):
``python load_plan_tp_rank.py MODEL_DIR RANK PORT``. Loads three pushes of moved weights
into two copies of the rank's shard, one with load_weights and one through a
LoadPlanner, and prints "rank R: identical" when every parameter matches bit for bit."""

from __future__ import annotations

import sys

import torch
from transformers import AutoModelForCausalLM

from polyrl.rollout.load_plan import LoadPlanner, bare_vllm_model, vllm_parallel
from polyrl.weight_sync import iter_buckets, pack_flat, unpack_flat


def main(model_dir: str, rank: int, port: int) -> None:
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    names = [n for n in hf.state_dict() if n != "lm_head.weight"]  # tied: vLLM skips it
    with vllm_parallel(2, rank, f"tcp://127.0.0.1:{port}"):
        ref, ref_load = bare_vllm_model(model_dir, "float32")
        planned, load = bare_vllm_model(model_dir, "float32")
        planner = LoadPlanner(planned, load)
        for step in range(3):
            sd = hf.state_dict()
            moved = [(n, sd[n] + 0.1 * step) for n in names]
            for bucket in iter_buckets(moved, 64 * 1024):
                flat, metas = pack_flat(bucket)
                weights = unpack_flat(flat, metas)
                ref_load(weights)
                planner.load(weights, flat, metas)
    pa, pb = dict(ref.named_parameters()), dict(planned.named_parameters())
    differ = [n for n in pa if not torch.equal(pa[n], pb[n])]
    narrowed = sum(len(p.typed_src) for p in planner.plans.values() if p is not None)
    stats = planner.stats
    ok = (
        not differ
        and narrowed
        and stats["planned"] == 2 * stats["learned"]
        and not stats["refused"]
    )
    print(f"rank {rank}: {'identical' if ok else 'DIFFERENT'} {differ} narrowed={narrowed} {stats}")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
