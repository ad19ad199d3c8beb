"""Sequence packing (ParallelConfig.pack_sequences): the packed layout by hand, and the
packed engine gives the padded engine's log-probs, entropy, loss and update."""

from __future__ import annotations

import numpy as np
import torch
from torch_fsdp_helpers import PARITY_EPS, full_weights, nll_loss, random_batch

from polyrl.backends import get_engine
from polyrl.backends.torch_fsdp.models import _packed
from polyrl.batch import from_token_lists
from polyrl.config import ModelConfig, OptimConfig, ParallelConfig

# fp32; packing changes matmul shapes and the attention mask's form only (~1e-7 seen).
ATOL = 1e-5


def test_packed_layout_by_hand():
    b = from_token_lists([[5, 6], [7]], [[8], [9, 10, 11]], pad_id=0)
    inputs = {k: torch.from_numpy(np.array(b[k])) for k in b.tensors}
    packed = _packed(inputs)
    # real tokens in order: row 0 = 5 6 8, row 1 = 7 9 10 11
    assert packed["input_ids"].tolist() == [[5, 6, 8, 7, 9, 10, 11]]
    assert packed["position_ids"].tolist() == [[0, 1, 2, 0, 1, 2, 3]]
    # 8 is predicted at position 1 (token 6); 9, 10, 11 at 3, 4, 5; plus one dropped
    assert packed["keep"].tolist() == [1, 3, 4, 5, 5]
    assert packed["targets"].tolist() == [[8, 9, 10, 11]]
    assert packed["where"].tolist() == [[True, False, False], [True, True, True]]
    # sequence boundaries for the polyrl_varlen attention: lengths 3 and 4
    assert packed["varlen"]["cu_seq_lens_q"].tolist() == [0, 3, 7]
    assert packed["varlen"]["max_length_q"] == 4


def _engine(path, pack: bool):
    engine = get_engine("torch_fsdp")()
    engine.init(
        ModelConfig(str(path)),
        OptimConfig(lr=1e-3, eps=PARITY_EPS),
        ParallelConfig(micro_batch_size=4, pack_sequences=pack),
    )
    return engine


def test_packed_equals_padded(tiny_model_dir):
    batch = random_batch(9, seed=5)
    padded, packed = _engine(tiny_model_dir, False), _engine(tiny_model_dir, True)
    out_a = padded.forward(batch, temperature=0.7, entropy=True)
    out_b = packed.forward(batch, temperature=0.7, entropy=True)
    for key in ("log_probs", "entropy"):
        np.testing.assert_allclose(out_b[key], out_a[key], atol=ATOL)
    m_a, m_b = padded.train_step(batch, nll_loss), packed.train_step(batch, nll_loss)
    for key in ("loss", "grad_norm"):
        np.testing.assert_allclose(m_b[key], m_a[key], rtol=ATOL)
    w_a, w_b = full_weights(padded), full_weights(packed)
    for name in w_a:
        torch.testing.assert_close(w_b[name], w_a[name], atol=1e-6, rtol=0)
