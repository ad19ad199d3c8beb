"""torch_fsdp tests: one intra-op thread.

The tiny model's matmuls are far too small to gain from threads, and on a shared 2-core
CI box OpenMP threads spin against other processes (a step measured 20x slower with 2
threads under load than with 1). Restored afterwards for the rest of the session.
"""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
