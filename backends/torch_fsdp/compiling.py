"""``torch.compile`` as the torch backend uses it (``ModelConfig.compile``): decoder layers
(``models``) and the LM head's chunk scoring (``lm_head``)."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable

import torch
import torch._functorch.config
import torch._inductor.config

__all__ = ["compiled"]

# The compiled code may call one function for several variants (grad on/off, inputs that
# need a gradient or not, recomputed under checkpointing; every decoder layer shares one
# code object): room for all of them, since past the limit dynamo falls back to eager with
# only a log line.
RECOMPILE_LIMIT = 32


@functools.cache
def _configure_dynamo() -> None:
    """Process-wide settings, made once (every layer and LM head goes through
    :func:`compiled`)."""
    torch._dynamo.config.recompile_limit = max(
        torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT
    )
    # A Python float reaching a compiled layer (unspecialized by default) made dynamo trace
    # the layer, hand the graph to AOTAutograd, then restart its analysis to turn the
    # float into a tensor: every process traced twice, and the discarded graph missed the
    # AOTAutograd cache even when warm (CPU, tiny model, a compiled train step: 16.3 s of
    # compiling warm -> 8.2 s). Floats are constants of the graph instead, guarded by value
    # (a new temperature compiles one more variant of the LM head).
    torch._dynamo.config.specialize_float = True
    # Inductor fuses a row and a column reduction (RMSNorm's backward) only past a size
    # (rows >= 4096, >= 2x columns, 5 Mi elements) and guards the graph on that choice:
    # a micro-batch on the other side of it compiled again (the warm-up's two rows against
    # step 1's 64 x 532 tokens: `hidden_states.size()[0]*hidden_states.size()[1] <= 4096`).
    # Non-strict mode skips those checks: the fused kernel whatever the size (the one
    # training-sized micro-batches got anyway), one graph for every size.
    torch._inductor.config.triton.mix_order_reduction_non_strict_mode = True
    # polyrl.tensor resolves torch's namespace through array_api_compat, whose type checks
    # are lru_cache'd pure functions of the class; dynamo traces through the cache and
    # says so once per function. Nothing to act on.
    warnings.filterwarnings(
        "ignore",
        message=r"Dynamo detected a call to a `functools.lru_cache`-wrapped function at '_helpers",
        category=UserWarning,
    )


def compiled(fn: Callable, memory_budget: float | None = None) -> Callable:
    """``fn`` under ``torch.compile(dynamic=True)``: sequence lengths and chunk sizes
    change every call; parameter shapes stay static (dynamo's default for parameters).
    ``memory_budget`` (``checkpoint_policy="budget"``): the partitioner of each graph
    compiled from it keeps at most this fraction of the activations it keeps by default
    and recomputes the rest in the backward pass (AOTAutograd's
    ``activation_memory_budget``, read when a call compiles; the graphs then serve every
    engine of the process: one budget per process, as a role's engine has its own)."""
    _configure_dynamo()
    fn_c = torch.compile(fn, dynamic=True)
    if memory_budget is None:
        return fn_c

    @functools.wraps(fn)
    def within_budget(*args, **kwargs):
        with torch._functorch.config.patch(activation_memory_budget=memory_budget):
            return fn_c(*args, **kwargs)

    return within_budget
