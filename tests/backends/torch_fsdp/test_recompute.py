"""ModelConfig.checkpoint_policy: what each activation-checkpointing policy keeps for the
backward pass (none > selective > full), eager and compiled, and that the compiled
selective engine gives the eager engine's update (padded and packed)."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest
import torch
from torch._dynamo.utils import counters
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch_fsdp_helpers import PARITY_EPS, full_weights, nll_loss, random_batch

from polyrl.backends import get_engine
from polyrl.backends.torch_fsdp import models
from polyrl.config import ModelConfig, OptimConfig, ParallelConfig

POLICIES = {"none": {}, "full": {"checkpoint_policy": "full"}}
POLICIES["selective"] = {"checkpoint_policy": "selective"}
# fp32 on CPU: inductor reorders reductions (log-softmax, RMSNorm); ~1e-6 seen
# (test_compile).
ATOL = 1e-5


class _LiveStorages(TorchDispatchMode):
    """Remembers every storage an op creates; :meth:`live_bytes` sums those still alive,
    i.e. what autograd (or a checkpoint's cache) keeps for the backward pass once the
    forward's own temporaries are gone."""

    @classmethod
    def ignore_compile_internals(cls):  # let dynamo compile underneath, as in training
        return True

    def __init__(self):
        super().__init__()
        self.created: dict[int, tuple[weakref.ref, int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                st = t.untyped_storage()  # storages keep their Python object alive
                self.created[st.data_ptr()] = (weakref.ref(st), st.nbytes())
        return out

    def live_bytes(self) -> int:
        gc.collect()
        return sum(n for ref, n in self.created.values() if ref() is not None)


def _saved_bytes(path, policy: str, compile: bool) -> int:
    """Bytes a training forward of the decoder (4 x 64 tokens) leaves for backward."""
    cfg = ModelConfig(
        str(path), gradient_checkpointing=policy != "none", compile=compile, **POLICIES[policy]
    )
    backbone = models.load_model(cfg, torch.float32).module.model.train()
    ids = torch.randint(4, 58, (4, 64), generator=torch.Generator().manual_seed(0))
    with _LiveStorages() as track:
        hidden = backbone(input_ids=ids, use_cache=False).last_hidden_state
    saved = track.live_bytes()
    hidden.sum().backward()  # the kept tensors suffice for the gradients
    assert all(p.grad is not None for p in backbone.layers.parameters())
    return saved


def test_selective_keeps_less_than_none_more_than_full(tiny_model_dir):
    """Eager: "selective" keeps the matmul and attention outputs that "full" recomputes,
    and drops the elementwise intermediates that no checkpointing keeps."""
    saved = {p: _saved_bytes(tiny_model_dir, p, compile=False) for p in POLICIES}
    print("torch eager saved bytes", saved)
    assert saved["none"] > saved["selective"] > saved["full"], saved


class _CountMatmuls(TorchDispatchMode):
    """Matmuls executed (a selective checkpoint's cached results never reach this mode)."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
        return func(*args, **(kwargs or {}))


def test_selective_recomputes_no_matmul(tiny_model_dir):
    """Eager forward + backward: "full" runs every projection twice, "selective" as often
    as no checkpointing."""
    ids = torch.randint(4, 58, (2, 16), generator=torch.Generator().manual_seed(0))
    matmuls = {}
    for policy, kw in POLICIES.items():
        cfg = ModelConfig(str(tiny_model_dir), gradient_checkpointing=policy != "none", **kw)
        backbone = models.load_model(cfg, torch.float32).module.model.train()
        with _CountMatmuls() as count:
            backbone(input_ids=ids, use_cache=False).last_hidden_state.sum().backward()
        matmuls[policy] = count.n
    assert matmuls["full"] > matmuls["selective"] == matmuls["none"], matmuls


def test_compiled_selective_keeps_what_the_compiler_keeps(tiny_model_dir):
    """Compiled layers: the checkpoint sits inside the compiled function and the
    partitioner applies the policy, so "selective" keeps the matmul and attention
    outputs. Inductor's partitioner alone already recomputes the pointwise ops and keeps
    the matmul outputs, so that equals no checkpointing; "full" keeps less. (With the
    checkpoint around the compiled function instead, SAC sees inductor's ``mm.out``
    calls, saves only the attention output and recomputes every matmul.)"""
    saved = {p: _saved_bytes(tiny_model_dir, p, compile=True) for p in POLICIES}
    print("torch compiled saved bytes", saved)
    assert saved["none"] == saved["selective"] > saved["full"], saved


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
    """Selective checkpointing inside the compiled layers (FSDP2 around them) gives the
    eager engine's loss, gradient norm and weights, without checkpointing."""
    eager = _engine(tiny_model_dir, pack, compile=False)
    selective = _engine(
        tiny_model_dir, pack, compile=True, gradient_checkpointing=True, **POLICIES["selective"]
    )
    graphs = counters["stats"]["unique_graphs"]
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
