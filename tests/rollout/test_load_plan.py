"""Planned weight loads (polyrl.rollout.load_plan) against vLLM's own ``load_weights``.

Two copies of vLLM's Qwen2 model class with its real weight loaders (stacked q/k/v into
``qkv_proj``, gate/up into ``gate_up_proj``, vocab-padded embedding, tied ``lm_head``),
built on the CPU outside an engine (vLLM-CPU only packs weights after loading, which the
planner never sees): one loads every bucket with ``load_weights``, the other through a
``LoadPlanner``. After every push the two must be bit-identical, parameter by parameter.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from polyrl.rollout.load_plan import LoadPlanner, bare_vllm_model, vllm_parallel
from polyrl.weight_sync import iter_buckets, pack_flat, unpack_flat

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def parallel():
    with vllm_parallel():
        yield


@pytest.fixture(scope="module")
def hf_weights(tiny_model_dir):
    """The HF state dict (with the tied ``lm_head.weight``, as trainers export it)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    items = [(k, v.detach().clone()) for k, v in model.state_dict().items()]
    assert any(k == "lm_head.weight" for k, _ in items)
    # vLLM 0.32's loader refuses a call holding the tied lm_head.weight without
    # embed_tokens, so keep them in one bucket (first and second).
    items.insert(1, items.pop([k for k, _ in items].index("lm_head.weight")))
    return items


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8)


def _assert_identical(a: torch.nn.Module, b: torch.nn.Module) -> None:
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert pa.keys() == pb.keys()
    differ = [n for n in pa if not torch.equal(_bits(pa[n]), _bits(pb[n]))]
    assert not differ, f"planned load differs from load_weights in {differ}"


def _pushes(weights, steps, dtype, bucket_bytes, seed=0):
    """``steps`` pushes of new weights (each moved by a random step), as (weights, flat,
    metas) buckets: the CUDA IPC / NCCL form, views of one flat buffer per bucket."""
    gen = torch.Generator().manual_seed(seed)
    for step in range(steps):
        moved = [
            (n, (w + 0.05 * step * torch.randn(w.shape, generator=gen)).to(dtype))
            for n, w in weights
        ]
        buckets = []
        for bucket in iter_buckets(moved, bucket_bytes):
            flat, metas = pack_flat(bucket)
            buckets.append((unpack_flat(flat, metas), flat, metas))
        yield buckets


class _Counted:
    """A model's load function that counts the tensors it is given."""

    def __init__(self, load):
        self.load, self.tensors = load, 0

    def __call__(self, weights):
        self.tensors += len(weights)
        self.load(weights)


def _pair(model_dir, dtype):
    ref, ref_load = bare_vllm_model(model_dir, dtype)
    planned, load = bare_vllm_model(model_dir, dtype)
    counted = _Counted(load)
    return ref, ref_load, planned, counted, LoadPlanner(planned, counted)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_planned_load_is_bit_identical_to_load_weights(parallel, tiny_model_dir, hf_weights, dtype):
    ref, ref_load, planned, counted, planner = _pair(tiny_model_dir, dtype)
    n_buckets = 0
    for push, buckets in enumerate(_pushes(hf_weights, 3, getattr(torch, dtype), 96 * 1024)):
        n_buckets = len(buckets)
        for weights, flat, metas in buckets:
            ref_load(weights)
            planner.load(weights, flat, metas)
        _assert_identical(ref, planned)
        if push == 0:
            learned = counted.tensors
    # Only the first push ran load_weights: every tensor, stacked and tied ones included,
    # was planned (nothing fell back), and later pushes were copies alone.
    assert learned == len(hf_weights) and counted.tensors == learned
    assert planner.stats == {
        "learned": n_buckets,
        "planned": 2 * n_buckets,
        "graphed": 0,  # (CUDA graphs: persistent CUDA buffers only)
        "fallback_tensors": 0,
        "refused": 0,
    }
    # vLLM pads the vocabulary to a multiple of 64 rows and zero-fills the padding on
    # every load: the plan replays that fill too.
    rows = dict(planned.named_parameters())["model.embed_tokens.weight"].shape[0]
    assert rows % 64 == 0 and rows > dict(hf_weights)["model.embed_tokens.weight"].shape[0]
    assert sum(len(p.fills) for p in planner.plans.values()) == 1


def test_adjacent_tensors_merge_into_one_copy(parallel, tiny_model_dir, hf_weights):
    """q/k/v weights next to each other in the bucket land next to each other in
    ``qkv_proj``: one byte-range copy; gate/up likewise into ``gate_up_proj``."""
    ref, ref_load, planned, counted, planner = _pair(tiny_model_dir, "float32")
    w = dict(hf_weights)
    prefix = "model.layers.1."
    names = [f"{prefix}self_attn.{p}_proj.weight" for p in "qkv"]
    names += [f"{prefix}mlp.{p}_proj.weight" for p in ("gate", "up")]
    for step in range(2):
        bucket = [(n, w[n] + step) for n in names]
        flat, metas = pack_flat(bucket)
        weights = unpack_flat(flat, metas)
        ref_load(weights)
        planner.load(weights, flat, metas)
    (plan,) = planner.plans.values()
    assert plan.copies == 2 and not plan.fallback and not plan.typed_src
    p = dict(planned.named_parameters())
    for name in ("self_attn.qkv_proj.weight", "mlp.gate_up_proj.weight"):
        q = p[prefix + name]
        assert torch.equal(q, dict(ref.named_parameters())[prefix + name])
    assert torch.equal(
        p[prefix + "self_attn.qkv_proj.weight"][: w[names[0]].shape[0]], w[names[0]] + 1
    )


def test_layout_change_relearns_and_moved_parameters_invalidate(
    parallel, tiny_model_dir, hf_weights
):
    ref, ref_load, planned, counted, planner = _pair(tiny_model_dir, "float32")
    sizes = [96 * 1024, 200 * 1024]  # a new bucket size: new layouts, new plans
    for seed, size in enumerate(sizes):
        for buckets in _pushes(hf_weights, 2, torch.float32, size, seed=seed):
            for weights, flat, metas in buckets:
                ref_load(weights)
                planner.load(weights, flat, metas)
            _assert_identical(ref, planned)
    first = planner.stats["learned"]
    assert len(planner.plans) == first  # one plan per layout of both sizes
    # A parameter that moves (its storage replaced) makes the plans stale: relearned.
    norm = dict(planned.named_parameters())["model.norm.weight"]
    norm.data = norm.data.clone()
    for buckets in _pushes(hf_weights, 1, torch.float32, sizes[-1], seed=7):
        for weights, flat, metas in buckets:
            ref_load(weights)
            planner.load(weights, flat, metas)
    _assert_identical(ref, planned)
    assert planner.stats["learned"] > first


def test_metadata_through_the_async_engines_serializer_reuses_the_plan(
    parallel, tiny_model_dir, hf_weights
):
    """vLLM's async engine hands a bucket's metadata to its engine-core process through
    msgpack, which turns every tuple (a shape too) into a list: the planner must still key
    its plans by them and replay the plan learned from the first push."""
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    encoder, decoder = MsgpackEncoder(), MsgpackDecoder()
    ref, ref_load, planned, counted, planner = _pair(tiny_model_dir, "float32")
    for buckets in _pushes(hf_weights, 3, torch.float32, 96 * 1024):
        for weights, flat, metas in buckets:
            sent = decoder.decode(encoder.encode(metas))
            assert isinstance(sent[0][2], list)  # what the engine core receives
            ref_load(weights)
            planner.load(unpack_flat(flat, sent), flat, sent)
        _assert_identical(ref, planned)
    assert planner.stats["learned"] == len(buckets)  # learned on the first push only
    assert planner.stats["planned"] == 2 * len(buckets)


def test_loaders_it_cannot_plan_fall_back(parallel, tiny_model_dir, hf_weights):
    """A loader that computes (here: scales) keeps load_weights for its tensor; one that
    rebinds ``param.data`` (invisible to the recorder) refuses the whole layout; a
    dtype-converting copy (fp32 buckets into a bf16 model) is planned. All stay exact."""
    ref, ref_load, planned, counted, planner = _pair(tiny_model_dir, "bfloat16")

    def scaled(param, w):
        param.data.copy_(w * 2)

    def rebinding(param, w):
        param.data = w.to(param.dtype).clone()

    for model in (ref, planned):
        p = dict(model.named_parameters())
        p["model.norm.weight"].weight_loader = scaled
        p["model.layers.0.input_layernorm.weight"].weight_loader = rebinding
    for buckets in _pushes(hf_weights, 3, torch.float32, 96 * 1024):
        for weights, flat, metas in buckets:
            ref_load(weights)
            planner.load(weights, flat, metas)
        _assert_identical(ref, planned)
    plans = [p for p in planner.plans.values() if p is not None]
    assert planner.stats["refused"] == 1 and len(plans) == len(planner.plans) - 1
    assert sum(len(p.fallback) for p in plans) == 1  # model.norm.weight alone
    assert any(p.typed_src for p in plans)  # fp32 -> bf16 copies, planned


def test_tensor_parallel_ranks_plan_their_own_shards(tiny_model_dir, tmp_path):
    """Two TP ranks (gloo, two processes): each rank's planned load equals its own
    load_weights (row- and column-parallel narrowing)."""
    script = Path(__file__).with_name("load_plan_tp_rank.py")
    port = _free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(tiny_model_dir), str(rank), str(port)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(2)
    ]
    outs = [p.communicate(timeout=240)[0] for p in procs]
    for rank, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"rank {rank} failed:\n{out[-3000:]}"
        assert f"rank {rank}: identical" in out


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
