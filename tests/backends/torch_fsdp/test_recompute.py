"""ModelConfig.checkpoint_policy: what each activation-checkpointing policy keeps for the
backward pass (none > selective > full) and which matmuls run again, eager and compiled,
and that the compiled selective engine gives the eager engine's update (padded and
packed)."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest
import torch
from torch._dynamo.utils import counters
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch_fsdp_helpers import (
    PARITY_EPS,
    full_weights,
    graphs_before_compiling,
    nll_loss,
    random_batch,
)

from polyrl.backends import get_engine
from polyrl.backends.torch_fsdp import models
from polyrl.config import ModelConfig, OptimConfig, ParallelConfig

POLICIES = {"none": {}, "full": {"checkpoint_policy": "full"}}
POLICIES["selective"] = {"checkpoint_policy": "selective"}
# compiled only (the compiler's partitioner): keep at most 30% of what "none" keeps
_POLICIES = POLICIES | {"budget": {"checkpoint_policy": "budget", "activation_memory_budget": 0.3}}
# fp32 on CPU: inductor reorders reductions (log-softmax, RMSNorm); ~1e-6 seen
# (test_compile).
ATOL = 1e-5


MATMULS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.mm.out,  # inductor's extern matmuls
    torch.ops.aten.addmm.default,
    torch.ops.aten.addmm.out,
}


class _Tracker(TorchDispatchMode):
    """Remembers every storage an op creates (:meth:`live_bytes` sums those still alive,
    i.e. what autograd or a checkpoint's cache keeps for the backward pass once the
    forward's own temporaries are gone) and counts the matmuls that run (a selective
    checkpoint's cached results never reach this mode)."""

    @classmethod
    def ignore_compile_internals(cls):  # let dynamo compile underneath, as in training
        return True

    def __init__(self):
        super().__init__()
        self.created: dict[int, tuple[weakref.ref, int]] = {}
        self.matmuls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.matmuls += func in MATMULS
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()  # storages keep their Python object alive
                self.created[st.data_ptr()] = (weakref.ref(st), st.nbytes())
        return out

    def live_bytes(self) -> int:
        gc.collect()
        return sum(n for ref, n in self.created.values() if ref() is not None)


def _measure(path, policy: str, compile: bool) -> tuple[int, int]:
    """(bytes a training forward of the decoder, 4 x 64 tokens, leaves for backward;
    matmuls run by forward + backward)."""
    cfg = ModelConfig(
        str(path), gradient_checkpointing=policy != "none", compile=compile, **_POLICIES[policy]
    )
    backbone = models.load_model(cfg, torch.float32).module.model.train()
    ids = torch.randint(4, 58, (4, 64), generator=torch.Generator().manual_seed(0))
    with _Tracker() as track:
        hidden = backbone(input_ids=ids, use_cache=False).last_hidden_state
        saved = track.live_bytes()
        hidden.sum().backward()  # the kept tensors suffice for the gradients
    assert all(p.grad is not None for p in backbone.layers.parameters())
    return saved, track.matmuls


def test_selective_keeps_less_than_none_more_than_full(tiny_model_dir):
    """Eager: "selective" keeps the matmul and attention outputs that "full" recomputes
    (so its backward runs no matmul twice) and drops the elementwise intermediates that
    no checkpointing keeps."""
    (saved, matmuls) = zip(*(_measure(tiny_model_dir, p, compile=False) for p in POLICIES))
    saved, matmuls = dict(zip(POLICIES, saved)), dict(zip(POLICIES, matmuls))
    print("torch eager saved bytes", saved, "matmuls", matmuls)
    assert saved["none"] > saved["selective"] > saved["full"], saved
    assert matmuls["full"] > matmuls["selective"] == matmuls["none"], matmuls


def test_compiled_layers_keep_what_selective_keeps(tiny_model_dir):
    """Compiled layers take no selective checkpoint (models._wrap_layers): inductor's
    partitioner alone keeps the matmul outputs (no matmul runs twice) and recomputes the
    pointwise work, keeping no more than eager selective checkpointing; "full" keeps
    less and recomputes the matmuls."""
    eager_selective, _ = _measure(tiny_model_dir, "selective", compile=False)
    _measure(tiny_model_dir, "none", compile=True)  # the first compile keeps 1 KB of its own
    (saved, matmuls) = zip(*(_measure(tiny_model_dir, p, compile=True) for p in POLICIES))
    saved, matmuls = dict(zip(POLICIES, saved)), dict(zip(POLICIES, matmuls))
    print("torch compiled saved bytes", saved, "matmuls", matmuls)
    assert eager_selective >= saved["none"] == saved["selective"] > saved["full"], saved
    assert matmuls["full"] > matmuls["selective"] == matmuls["none"], matmuls


def test_a_memory_budget_keeps_between_full_and_none(tiny_model_dir):
    """checkpoint_policy="budget" (compiled layers): the partitioner keeps less than no
    checkpointing (the budget counts what it manages, not the layers' inputs and outputs
    every policy keeps) by recomputing some matmuls, but fewer than "full", which keeps
    least; the update is the one without checkpointing. The budget is read when a graph
    compiles, so each policy compiles its own (dynamo's caches emptied before each)."""
    saved, matmuls = {}, {}
    for policy in ("none", "budget", "full"):
        graphs_before_compiling()
        saved[policy], matmuls[policy] = _measure(tiny_model_dir, policy, compile=True)
    print("torch compiled saved bytes", saved, "matmuls", matmuls)
    assert saved["none"] > saved["budget"] > saved["full"], saved
    assert matmuls["none"] < matmuls["budget"] < matmuls["full"], matmuls
    graphs_before_compiling()
    plain = _engine(tiny_model_dir, False, compile=True)
    budget = _engine(tiny_model_dir, False, compile=True, gradient_checkpointing=True,
                     **_POLICIES["budget"])  # fmt: skip
    batch = random_batch(9, seed=0)
    m_p, m_b = plain.train_step(batch, nll_loss), budget.train_step(batch, nll_loss)
    for key in ("loss", "grad_norm"):
        np.testing.assert_allclose(m_b[key], m_p[key], rtol=ATOL)
    graphs_before_compiling()  # no budget graph serves a later test


def _engine(path, pack: bool, compile: bool, **model):
    engine = get_engine("torch_fsdp")()
    engine.init(
        ModelConfig(
            str(path),
            attn_implementation="polyrl_varlen" if pack else "sdpa",
            compile=compile,
            **model,
        ),
        OptimConfig(lr=1e-3, eps=PARITY_EPS),
        ParallelConfig(micro_batch_size=4, pack_sequences=pack, logits_chunk_tokens=8),
    )
    return engine


@pytest.mark.parametrize("pack", [False, True], ids=["padded", "packed"])
def test_compiled_selective_engine_equals_eager(tiny_model_dir, pack):
    """A compiled engine asked for selective checkpointing (FSDP2 around the layers)
    gives the eager engine's loss, gradient norm and weights, without checkpointing."""
    eager = _engine(tiny_model_dir, pack, compile=False)
    selective = _engine(
        tiny_model_dir, pack, compile=True, gradient_checkpointing=True, **POLICIES["selective"]
    )
    graphs = graphs_before_compiling()
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        for seed in range(2):  # batches of different lengths
            batch = random_batch(9, seed=seed)
            m_e, m_s = eager.train_step(batch, nll_loss), selective.train_step(batch, nll_loss)
            for key in ("loss", "grad_norm"):
                np.testing.assert_allclose(m_s[key], m_e[key], rtol=ATOL)
    assert counters["stats"]["unique_graphs"] > graphs, "nothing was compiled"
    w_e, w_s = full_weights(eager), full_weights(selective)
    for name in w_e:
        torch.testing.assert_close(w_s[name], w_e[name], atol=1e-6, rtol=0)
