"""Shared pieces of the torch_fsdp tests: batches, a reference loss, engine builders and
the 2-rank gloo worker (importable by ``torch.multiprocessing`` spawn children)."""

from __future__ import annotations

import os
import socket

import numpy as np
import torch

from polyrl.batch import Batch, from_token_lists
from polyrl.config import ModelConfig, OptimConfig, ParallelConfig

VOCAB = 58  # real tokens of the tiny tokenizer (the embedding is padded to 64)


def random_batch(
    n: int, seed: int = 0, prompt_len: int | None = None, response_len: int | None = None
) -> Batch:
    """``n`` random samples of ragged prompt (1-6) and response (1-5) lengths."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(4, VOCAB, rng.integers(1, 7)).tolist() for _ in range(n)]
    responses = [rng.integers(4, VOCAB, rng.integers(1, 6)).tolist() for _ in range(n)]
    return from_token_lists(
        prompts, responses, pad_id=0, prompt_len=prompt_len, response_len=response_len
    )


def nll_loss(outputs, batch, ctx):
    """Token-mean NLL following the contract: this micro-batch's share of
    ``-sum(log p * mask) / global_tokens``; metric ``tokens`` sums to the global count."""
    mask = batch["response_mask"]
    loss = -(outputs["log_probs"] * mask).sum() / ctx.global_tokens
    return loss, {"nll": loss.detach(), "tokens": mask.sum()}


# Adam's first update is lr * g / (|g| + eps) ~ lr * sign(g): it amplifies the fp32
# summation-order noise (~1e-9) of near-zero gradient entries by up to 1/eps. With the
# usual eps=1e-8 two correct but differently ordered computations then differ by ~1e-4
# in a few weights; eps=1e-4 bounds that at ~1e-7, so parity tests can compare weights.
PARITY_EPS = 1e-4


def actor(
    path,
    micro_batch_size: int = 8,
    lr: float = 1e-3,
    mesh=None,
    role: str = "actor",
    parallel: dict | None = None,
    **optim,
):
    """An engine of ``role`` (frozen roles get no optimizer) on the tiny model; ``optim``
    overrides OptimConfig fields, ``parallel`` other ParallelConfig fields."""
    from polyrl.backends import get_engine

    optim.setdefault("eps", PARITY_EPS)
    model = ModelConfig(str(path), role=role)
    engine = get_engine("torch_fsdp")()
    engine.init(
        model,
        OptimConfig(lr=lr, **optim) if model.trainable else None,
        ParallelConfig(
            mesh=mesh or {"data": 1, "fsdp": 1, "tensor": 1},
            micro_batch_size=micro_batch_size,
            **(parallel or {}),
        ),
    )
    return engine


def graphs_before_compiling() -> int:
    """Empty dynamo's caches and return how many graphs it has compiled so far, for a test
    to check that its own engines compiled: the caches live on the code objects, shared
    with earlier tests' engines, whose graphs would otherwise serve these unseen."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    return counters["stats"]["unique_graphs"]


def full_weights(engine) -> dict[str, torch.Tensor]:
    """The engine's exported weights as host tensors."""
    return {n: t.cpu().clone() for bucket in engine.export_weights(1 << 20) for n, t in bucket}


def assert_same_calls(got, expected, got_weights, expected_weights) -> None:
    """A ``(forward output, train_step metrics)`` pair and the weights after it equal
    another engine's bit for bit (either backend: weights as tensors or arrays)."""
    for key in ("log_probs", "entropy"):
        np.testing.assert_array_equal(got[0][key], expected[0][key])
    assert got[1] == expected[1]
    assert got_weights.keys() == expected_weights.keys()
    for name, weight in expected_weights.items():
        np.testing.assert_array_equal(np.asarray(got_weights[name]), np.asarray(weight), name)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(fn, nprocs: int, *args) -> None:
    """Run ``fn(rank, nprocs, free port, *args)`` in ``nprocs`` spawned processes (gloo
    ranks), one OpenMP thread each (children read OMP_NUM_THREADS at start-up)."""
    threads = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        torch.multiprocessing.start_processes(
            fn, args=(nprocs, free_port(), *args), nprocs=nprocs, join=True, start_method="spawn"
        )
    finally:
        if threads is None:
            os.environ.pop("OMP_NUM_THREADS")
        else:
            os.environ["OMP_NUM_THREADS"] = threads


def join_group(rank: int, world: int, port: int) -> None:
    """The torch.distributed environment of one gloo rank (torchrun's variables)."""
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)


def two_rank_worker(rank: int, world: int, port: int, model_dir: str, out_dir: str) -> None:
    """One gloo rank: a train step on its half of ``random_batch(8)`` under mesh fsdp=2
    and under data=2 (HSDP), saving metrics/weights (rank 0) and a DCP checkpoint."""
    join_group(rank, world, port)
    shard = random_batch(8).split(world)[rank]
    results = {}
    for name, mesh in (("fsdp", {"fsdp": 2}), ("hsdp", {"data": 2})):
        engine = actor(model_dir, micro_batch_size=2, mesh=mesh)
        metrics = engine.train_step(shard, nll_loss)
        results[name] = {"metrics": metrics, "weights": full_weights(engine)}
        if name == "fsdp":
            engine.save(os.path.join(out_dir, "ckpt"))
    if rank == 0:
        torch.save(results, os.path.join(out_dir, "results.pt"))
    torch.distributed.destroy_process_group()


def one_rank_with_its_port_taken(rank: int, world: int, port: int) -> None:
    """A world of one whose MASTER_PORT another socket holds: it meets no one, so it needs
    no port (a tiny CPU run's actor failed at start so: EADDRINUSE, 1 start in 5)."""
    import torch.distributed as dist

    from polyrl.backends.torch_fsdp.sharding import init_distributed

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port))
        taken.listen()
        join_group(rank, world, port)
        env = init_distributed()
        assert (env.rank, env.world_size) == (0, 1)
        t = torch.ones(3)
        dist.all_reduce(t)
        assert t.tolist() == [1.0, 1.0, 1.0]
