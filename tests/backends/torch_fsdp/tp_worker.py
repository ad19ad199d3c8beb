"""What one gloo rank of the tensor-parallel tests computes (importable by spawn children).

Every rank holds its own quarter/half of ``random_batch(8)`` (callers split over all
ranks, tensor parallel or not) and runs, under one mesh:

* the actor (2-row micro-batches, LM head in chunks of 3 tokens): log-probs and entropy
  at temperature 0.7, one train step, then a non-finite step (skipped), offload/reload,
  a DCP checkpoint, and a load of the 1-rank checkpoint ``ckpt_one``;
* the actor with a token budget and packed sequences: log-probs;
* the critic (value head): values, one train step on a squared error;
* the frozen reference: log-probs;
* a tiny random Qwen3 (per-head ``q_norm``/``k_norm``) actor: log-probs, one train step.

Each rank saves ``rank{r}.pt``: its own output rows and (identical on every rank) the
gathered weights and metrics.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import torch
from torch_fsdp_helpers import actor, full_weights, join_group, nll_loss, random_batch

from polyrl.backends.hf_dir import TOKENIZER_FILES

MESHES = {
    "tp2": {"tensor": 2},
    "tp2_nccl": {"tensor": 2},  # the gpu-marked run: the same mesh over 2 GPUs
    "fsdp2_tp2": {"fsdp": 2, "tensor": 2},
    "hsdp2_tp2": {"data": 2, "tensor": 2},
}
BATCH = 8  # rows of random_batch over all ranks
CHUNK = {"logits_chunk_tokens": 3}
PACKED = {"max_tokens_per_micro_batch": 24, "pack_sequences": True}


def build_tiny_qwen3(tiny_dir: str, out: str) -> str:
    """The tiny Qwen2's shape and tokenizer as a random Qwen3 (per-head q/k norms, made
    non-uniform so that their gradients matter)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    fields = json.loads(Path(tiny_dir, "config.json").read_text())
    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers")
    keys += ("num_attention_heads", "num_key_value_heads", "tie_word_embeddings")
    config = Qwen3Config(**{k: fields[k] for k in keys}, head_dim=32, dtype="float32")
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                p.uniform_(0.5, 1.5)
    model.save_pretrained(out)
    for name in TOKENIZER_FILES:
        if Path(tiny_dir, name).is_file():
            shutil.copy(Path(tiny_dir, name), Path(out, name))
    return out


def qwen3_results(model_dir: str, batch, micro: int, mesh=None) -> dict:
    engine = actor(model_dir, micro, mesh=mesh)
    res = {"log_probs": engine.forward(batch)["log_probs"]}
    res["metrics"] = engine.train_step(batch, nll_loss)
    res["weights"] = full_weights(engine)
    return res


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


def tp_worker(
    rank: int, world: int, port: int, model_dir: str, out_dir: str, name: str, qwen3_dir: str
) -> None:
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
    res["qwen3"] = qwen3_results(qwen3_dir, shard, 2, mesh)
    torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))
    torch.distributed.destroy_process_group()


def one_rank_results(model_dir: str, out_dir: str, qwen3_dir: str) -> dict:
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
    res["qwen3"] = qwen3_results(qwen3_dir, batch, 4)
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
