"""attn_implementation="polyrl_varlen" (backends/torch_fsdp/attention.py): the varlen
attention against a dense masked softmax written here, and the engine with it against
the engine with sdpa, padded and packed. The gpu test checks torch's FlashAttention
varlen kernel against the per-sequence reference on CUDA and that it is the one chosen."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch_fsdp_helpers import PARITY_EPS, nll_loss, random_batch

from polyrl.backends import get_engine
from polyrl.backends.torch_fsdp import attention
from polyrl.config import ModelConfig, OptimConfig, ParallelConfig

ATOL = 1e-5  # fp32: same maths, other summation order (~1e-7 seen)


def dense(q, k, v, seq, scale):
    """q [B, H, L, D], k/v [B, K, L, D], seq [B, L] sequence ids (-1: padding) -> the
    softmax over keys of the same sequence at or before the query, [B, L, H, D]; 0 at
    padding."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.einsum("bhqd,bhkd->bhqk", q, k) * scale
    pos = torch.arange(q.shape[2])
    allowed = (seq[:, :, None] == seq[:, None, :]) & (pos[:, None] >= pos[None, :])
    allowed &= seq[:, None, :] >= 0
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    probs = torch.nan_to_num(torch.softmax(scores, -1))  # padding rows: all -inf
    out = torch.einsum("bhqk,bhkd->bqhd", probs, v)
    return out * (seq >= 0)[:, :, None, None]


def qkv(b, length, device="cpu", dtype=torch.float32, heads=4, kv_heads=2, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    make = lambda h: torch.randn(b, h, length, d, generator=g).to(device, dtype)  # noqa: E731
    return make(heads), make(kv_heads), make(kv_heads)


def test_packed_row_by_cu_seqlens_and_by_positions():
    q, k, v = qkv(1, 9)
    seq = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, 2]])
    cu = attention.cu_seqlens(torch.tensor([3, 2, 4]))
    assert cu.tolist() == [0, 3, 5, 9]
    want = dense(q, k, v, seq, 0.3)
    got, _ = attention.varlen_attention(
        None, q, k, v, None, scaling=0.3, cu_seq_lens_q=cu, max_length_q=4
    )
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]])
    got, _ = attention.varlen_attention(None, q, k, v, None, scaling=0.3, position_ids=positions)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


def test_padded_batch_by_mask():
    q, k, v = qkv(3, 6, seed=1)
    # left-padded prompts, right-padded responses (polyrl.batch's layout); an empty row
    mask = torch.tensor([[0, 0, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0]]).bool()
    seq = torch.where(mask, 0, -1)
    got, _ = attention.varlen_attention(None, q, k, v, mask, scaling=0.25)
    torch.testing.assert_close(got, dense(q, k, v, seq, 0.25), atol=ATOL, rtol=0)
    # no mask and no positions: each row is one causal sequence
    got, _ = attention.varlen_attention(None, q, k, v, None, scaling=0.25)
    torch.testing.assert_close(got, dense(q, k, v, torch.zeros(3, 6), 0.25), atol=ATOL, rtol=0)


def test_sliding_window_is_refused():
    q, k, v = qkv(1, 4)
    with pytest.raises(ValueError, match="sliding_window=8.*attn_implementation='sdpa'"):
        attention.varlen_attention(None, q, k, v, None, sliding_window=8)


def _engine(path, attn: str, pack: bool):
    engine = get_engine("torch_fsdp")()
    engine.init(
        ModelConfig(str(path), attn_implementation=attn),
        OptimConfig(lr=1e-3, eps=PARITY_EPS),
        ParallelConfig(micro_batch_size=4, pack_sequences=pack),
    )
    return engine


@pytest.mark.parametrize("pack", [False, True], ids=["padded", "packed"])
def test_engine_varlen_equals_sdpa(tiny_model_dir, pack):
    batch = random_batch(7, seed=3)
    sdpa, varlen = (
        _engine(tiny_model_dir, "sdpa", False),
        _engine(tiny_model_dir, "polyrl_varlen", pack),
    )
    before = attention.kernel_calls["reference"]
    out_a = sdpa.forward(batch, temperature=0.8, entropy=True)
    out_b = varlen.forward(batch, temperature=0.8, entropy=True)
    assert attention.kernel_calls["reference"] > before  # the registered function ran
    for key in ("log_probs", "entropy"):
        np.testing.assert_allclose(out_b[key], out_a[key], atol=ATOL)
    m_a, m_b = sdpa.train_step(batch, nll_loss), varlen.train_step(batch, nll_loss)
    for key in ("loss", "grad_norm"):
        np.testing.assert_allclose(m_b[key], m_a[key], rtol=ATOL)


@pytest.mark.gpu
def test_cuda_flash_varlen_matches_reference():
    q, k, v = qkv(1, 300, "cuda", torch.bfloat16, heads=12, kv_heads=2, d=128, seed=4)
    for x in (q, k, v):
        x.requires_grad_(True)
    lengths = torch.tensor([100, 1, 150, 49])
    cu = attention.cu_seqlens(lengths).cuda()
    assert attention.kernel_for(q) == "flash_varlen"
    before = attention.kernel_calls["flash_varlen"]
    fast, _ = attention.varlen_attention(
        None, q, k, v, None, scaling=0.1, cu_seq_lens_q=cu, max_length_q=150
    )
    assert attention.kernel_calls["flash_varlen"] == before + 1
    grads_fast = torch.autograd.grad(fast.float().square().sum(), (q, k, v))
    flat = [x.detach().float().transpose(1, 2)[0].requires_grad_(True) for x in (q, k, v)]
    ref = attention._reference(*flat, cu, 0.1)[None]
    grads_ref = torch.autograd.grad(ref.square().sum(), flat)
    torch.testing.assert_close(fast.float(), ref, atol=2e-2, rtol=2e-2)  # bf16 inputs/outputs
    for g_fast, g_ref in zip(grads_fast, grads_ref):
        err = (g_fast.float().transpose(1, 2)[0] - g_ref).abs().max()
        assert err <= 3e-2 * g_ref.abs().max(), err


@pytest.mark.gpu
def test_cuda_engine_packed_varlen_equals_padded_sdpa(tiny_model_dir):
    """The whole path on CUDA in bf16: packed micro-batches through FlashAttention varlen
    give sdpa's padded log-probs and loss to bf16 precision."""
    batch = random_batch(8, seed=6)

    def engine(attn, pack):
        eng = get_engine("torch_fsdp")()
        eng.init(
            ModelConfig(str(tiny_model_dir), dtype="bfloat16", attn_implementation=attn),
            OptimConfig(lr=1e-3),
            ParallelConfig(micro_batch_size=4, pack_sequences=pack),
        )
        return eng

    sdpa, varlen = engine("sdpa", False), engine("polyrl_varlen", True)
    before = attention.kernel_calls["flash_varlen"]
    out_a, out_b = sdpa.forward(batch), varlen.forward(batch)
    assert attention.kernel_calls["flash_varlen"] > before
    # bf16 (attention kernels round differently); attending across sequences or to
    # padding would move log-probs by O(1)
    np.testing.assert_allclose(out_b["log_probs"], out_a["log_probs"], atol=0.1)
    m_a, m_b = sdpa.train_step(batch, nll_loss), varlen.train_step(batch, nll_loss)
    assert m_b["loss"] == pytest.approx(m_a["loss"], rel=5e-2)
