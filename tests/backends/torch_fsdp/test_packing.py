"""Sequence packing (ParallelConfig.pack_sequences): the packed layout by hand. (That the
packed engine gives the padded engine's outputs and update: the contract suite,
tests/backends/test_contract.py.)"""

from __future__ import annotations

import numpy as np
import torch

from polyrl.backends.torch_fsdp.models import _packed
from polyrl.batch import from_token_lists


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
