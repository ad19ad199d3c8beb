"""Tensor parallelism (DTensor) on gloo ranks equals one process (tp_worker.py).

Default tier: mesh tensor=2 (2 ranks). Slow tier: fsdp=2 x tensor=2 and HSDP data=2 x
tensor=2 (4 ranks). Each mesh runs the actor (chunked LM head, train step with gradient
clipping, non-finite skip, offload/reload, DCP save and load across layouts), the actor
with a token budget and packed sequences, the critic (value head), the frozen reference
and a Qwen3 actor (per-head norms), and must match the same work done by a world of one.
On a CUDA machine the ranks run on NCCL, one GPU each (the engine picks the device):
``pytest -m gpu tests/backends/torch_fsdp/test_tensor_parallel.py`` runs tensor=2 over
2 GPUs against one GPU.

Tolerances (measured on the tiny model, fp32, CPU): log-probs differ by <= 5e-7 (1e-5
asserted); loss and grad norm by ~1e-7 relative (1e-5 asserted); weights after one Adam
step (PARITY_EPS) by ~2e-7 absolute (1e-6 asserted, <= 1e-3 of the ~1e-3 step). On GPU,
where kernels reduce in other orders, 10x looser (not measured here). A checkpoint
reloads bit-exactly across layouts.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn
from torch_fsdp_helpers import actor, full_weights, spawn
from tp_worker import MESHES, build_tiny_qwen3, concat_rows, one_rank_results, tp_worker

from polyrl.backends.torch_fsdp import tensor_parallel

ON_GPU = torch.cuda.is_available()
RTOL, ATOL_W, ATOL_OUT = (1e-4, 1e-5, 1e-4) if ON_GPU else (1e-5, 1e-6, 1e-5)
METRICS = ("loss", "grad_norm", "nll", "tokens", "global_tokens", "global_seqs")


@pytest.fixture(scope="module")
def qwen3_dir(tiny_model_dir, tmp_path_factory):
    return build_tiny_qwen3(str(tiny_model_dir), str(tmp_path_factory.mktemp("qwen3")))


@pytest.fixture(scope="module")
def one_rank(tiny_model_dir, qwen3_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("tp")
    return one_rank_results(str(tiny_model_dir), str(out), qwen3_dir), out


@pytest.fixture(
    scope="module",
    params=[
        "tp2",
        pytest.param("fsdp2_tp2", marks=pytest.mark.slow),
        pytest.param("hsdp2_tp2", marks=pytest.mark.slow),
        pytest.param("tp2_nccl", marks=pytest.mark.gpu),
    ],
)
def ranks(request, tiny_model_dir, qwen3_dir):
    """(mesh name, per-rank results) of the mesh's gloo ranks."""
    name = request.param
    world = int(np.prod(list(MESHES[name].values())))
    if ON_GPU and torch.cuda.device_count() < world:
        pytest.skip(f"{world} NCCL ranks need {world} GPUs (one each)")
    _, out = request.getfixturevalue("one_rank")  # written first: ranks load its checkpoint
    spawn(tp_worker, world, str(tiny_model_dir), str(out), name, qwen3_dir)
    return name, [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world)]


def close_weights(got: dict, want: dict, atol: float = ATOL_W) -> None:
    assert got.keys() == want.keys()
    for name, w in want.items():
        torch.testing.assert_close(got[name], w, rtol=RTOL if atol else 0, atol=atol)


def close_metrics(got: dict, want: dict, keys) -> None:
    for key in keys:
        assert got[key] == pytest.approx(want[key], rel=RTOL), key


def test_actor_forward_and_train_step_equal_one_rank(ranks, one_rank):
    _, parts = ranks
    one = one_rank[0]["actor"]
    got = concat_rows(parts, "actor", "forward")
    for key in ("log_probs", "entropy"):
        np.testing.assert_allclose(got[key], one["forward"][key], atol=ATOL_OUT, rtol=0)
    # Clipping to OptimConfig.grad_clip=1.0 is exercised: it scales the split layers'
    # gradients (on the data x tensor mesh) and the others (data mesh) by one global norm.
    assert one["metrics"]["grad_norm"] > 1.0
    for part in parts:  # every rank reports the global metrics and gathers full weights
        close_metrics(part["actor"]["metrics"], one["metrics"], METRICS)
        close_weights(part["actor"]["weights"], one["weights"])


def test_nonfinite_step_is_skipped_and_offload_reload(ranks, one_rank):
    _, parts = ranks
    for part in parts:
        res = part["actor"]
        assert res["skipped"]["nonfinite_skipped"] == 1.0
        close_weights(res["weights_after_skip"], res["weights"], atol=0)
        assert "offloaded; call reload() first" in res["offloaded_forward"]
    got = concat_rows(parts, "actor", "reloaded")
    np.testing.assert_allclose(got, one_rank[0]["actor"]["reloaded"], atol=ATOL_OUT, rtol=0)


def test_token_budget_with_packed_sequences(ranks, one_rank):
    _, parts = ranks
    got = concat_rows(parts, "packed")
    np.testing.assert_allclose(got, one_rank[0]["packed"], atol=ATOL_OUT, rtol=0)
    # and the same log-probs as the padded, fixed-size micro-batches
    np.testing.assert_allclose(got, one_rank[0]["actor"]["forward"]["log_probs"], atol=ATOL_OUT)


def test_critic_and_reference_equal_one_rank(ranks, one_rank):
    _, parts = ranks
    one = one_rank[0]
    np.testing.assert_allclose(concat_rows(parts, "reference"), one["reference"], atol=ATOL_OUT)
    values = concat_rows(parts, "critic", "values")
    assert np.abs(values).max() > 1e-3  # the zero-initialised head moved
    np.testing.assert_allclose(values, one["critic"]["values"], atol=ATOL_OUT, rtol=0)
    for part in parts:
        close_metrics(part["critic"]["metrics"], one["critic"]["metrics"], ("loss", "vf"))
        close_weights(part["critic"]["weights"], one["critic"]["weights"])


def test_qwen3_per_head_norms(ranks, one_rank):
    """Qwen3's q_norm/k_norm see only the local heads: their gradients are summed over the
    tensor group, so the updated norm weights equal one rank's."""
    _, parts = ranks
    one = one_rank[0]["qwen3"]
    got = concat_rows(parts, "qwen3", "log_probs")
    np.testing.assert_allclose(got, one["log_probs"], atol=ATOL_OUT, rtol=0)
    for part in parts:
        close_metrics(part["qwen3"]["metrics"], one["metrics"], METRICS)
        close_weights(part["qwen3"]["weights"], one["weights"])
    assert any(k.endswith("q_norm.weight") for k in one["weights"])


def test_checkpoints_load_across_layouts(ranks, one_rank, tiny_model_dir):
    """DCP reshards: the 1-rank checkpoint loads under tensor parallelism and back."""
    name, parts = ranks
    (one, out) = one_rank
    for part in parts:
        assert part["loaded_one"]["step"] == 2  # a step and a skipped step
        close_weights(part["loaded_one"]["weights"], one["actor"]["weights"], atol=0)
    engine = actor(tiny_model_dir)
    engine.load(str(out / f"ckpt_{name}"))
    assert engine.step == 2
    close_weights(full_weights(engine), parts[0]["actor"]["weights"], atol=0)


def test_unknown_layer_layout_is_refused():
    layer = nn.ModuleDict({"self_attn": nn.ModuleDict({"qkv_proj": nn.Linear(4, 12)})})
    with pytest.raises(ValueError, match=r"has no \['mlp.down_proj'.*set ParallelConfig.mesh"):
        tensor_parallel.layer_plan(layer)
