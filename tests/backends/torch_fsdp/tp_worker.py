"""What one gloo rank of the tensor-parallel tests computes (importable by spawn children).

Every rank holds its own quarter/half of ``random_batch(8)`` (callers split over all
ranks, tensor parallel or not) and runs, under one mesh:

* the actor (2-row micro-batches, LM head in chunks of 3 tokens): log-probs and entropy
  at temperature 0.7, one train step, then a non-finite step (skipped), offload/reload,
  a DCP checkpoint, and a load of the 1-rank checkpoint ``ckpt_one``;
* the actor with a token budget and packed sequences: log-probs;
* the critic (value head): values, one train step on a squared error;
* the frozen reference: log-probs.

Each rank saves ``rank{r}.pt``: its own output rows and (identical on every rank) the
gathered weights and metrics.
"""

from __future__ import annotations

import os

import numpy as np
import torch
from torch_fsdp_helpers import actor, full_weights, join_group, nll_loss, random_batch

MESHES = {
    "tp2": {"tensor": 2},
    "fsdp2_tp2": {"fsdp": 2, "tensor": 2},
    "hsdp2_tp2": {"data": 2, "tensor": 2},
}
BATCH = 8  # rows of random_batch over all ranks
CHUNK = {"logits_chunk_tokens": 3}
PACKED = {"max_tokens_per_micro_batch": 24, "pack_sequences": True}


def nan_loss(outputs, batch, ctx):
    """A loss that is NaN (so are its gradients): the step must be skipped."""
    loss, metrics = nll_loss(outputs, batch, ctx)
    return loss * float("nan"), metrics


def value_loss(outputs, batch, ctx):
    """Squared error of the values to 1 per valid token, over the global token count."""
    mask = batch["response_mask"]
    loss = (((outputs["values"] - 1.0) ** 2) * mask).sum() / ctx.global_tokens
    return loss, {"vf": loss.detach()}


def actor_results(engine, batch, out_dir: str, tag: str) -> dict:
    """The actor scenario (module docstring); ``tag`` names this mesh's checkpoint."""
    res = {"forward": engine.forward(batch, temperature=0.7, entropy=True)}
    res["metrics"] = engine.train_step(batch, nll_loss)
    res["weights"] = full_weights(engine)
    res["skipped"] = engine.train_step(batch, nan_loss)
    res["weights_after_skip"] = full_weights(engine)
    engine.offload()
    try:
        engine.forward(batch)
        res["offloaded_forward"] = "ran"
    except RuntimeError as e:
        res["offloaded_forward"] = str(e)
    engine.reload()
    res["reloaded"] = engine.forward(batch, temperature=0.7)["log_probs"]
    engine.save(os.path.join(out_dir, f"ckpt_{tag}"))
    return res


def tp_worker(rank: int, world: int, port: int, model_dir: str, out_dir: str, name: str) -> None:
    join_group(rank, world, port)
    mesh = MESHES[name]
    shard = random_batch(BATCH).split(world)[rank]
    engine = actor(model_dir, micro_batch_size=2, mesh=mesh, parallel=CHUNK)
    res = {"actor": actor_results(engine, shard, out_dir, name)}
    loaded = actor(model_dir, mesh=mesh)
    loaded.load(os.path.join(out_dir, "ckpt_one"))
    res["loaded_one"] = {"step": loaded.step, "weights": full_weights(loaded)}
    packed = actor(model_dir, micro_batch_size=2, mesh=mesh, parallel=PACKED)
    res["packed"] = packed.forward(shard, temperature=0.7)["log_probs"]
    critic = actor(model_dir, micro_batch_size=2, mesh=mesh, role="critic")
    res["critic"] = {
        "metrics": critic.train_step(shard, value_loss),
        "values": critic.forward(shard)["values"],
        "weights": full_weights(critic),
    }
    ref = actor(model_dir, micro_batch_size=2, mesh=mesh, role="reference")
    res["reference"] = ref.forward(shard)["log_probs"]
    torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))
    torch.distributed.destroy_process_group()


def one_rank_results(model_dir: str, out_dir: str) -> dict:
    """The same scenarios in this process as a world of one (the reference values)."""
    batch = random_batch(BATCH)
    res = {"actor": actor_results(actor(model_dir, 4, parallel=CHUNK), batch, out_dir, "one")}
    res["packed"] = actor(model_dir, 4, parallel=PACKED).forward(batch, temperature=0.7)
    res["packed"] = res["packed"]["log_probs"]
    critic = actor(model_dir, 4, role="critic")
    res["critic"] = {
        "metrics": critic.train_step(batch, value_loss),
        "values": critic.forward(batch)["values"],
        "weights": full_weights(critic),
    }
    res["reference"] = actor(model_dir, 4, role="reference").forward(batch)["log_probs"]
    return res


def concat_rows(parts: list[dict], *path: str) -> np.ndarray | dict:
    """The per-rank output rows at ``path`` (e.g. "actor", "forward"), in rank order."""
    values = []
    for part in parts:
        for key in path:
            part = part[key]
        values.append(part)
    if isinstance(values[0], dict):
        return {k: np.concatenate([v[k] for v in values]) for k in values[0]}
    return np.concatenate(values)
