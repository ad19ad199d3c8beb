"""Variable-length causal attention: ``ModelConfig.attn_implementation = "polyrl_varlen"``.

Registered in transformers' ``AttentionInterface`` (and its mask interface, with the same
2-D padding mask as ``flash_attention_2``), so any transformers causal LM runs with it.
Every call reduces its input to sequences laid end to end ("varlen": cumulative sequence
starts ``cu_seqlens`` [N + 1]) and attends causally within each sequence only:

* a packed row (``ParallelConfig.pack_sequences``; ``policy_outputs`` passes
  ``cu_seq_lens_q`` / ``max_length_q`` computed once per micro-batch),
* a padded batch (transformers passes the [B, L] mask; padded positions are dropped
  before the kernel and come back as zeros),
* neither: sequences start where ``position_ids`` restarts at 0 (one host sync per layer).

Kernels (:func:`kernel_for`): ``flash_varlen`` = ``torch.nn.attention.varlen.varlen_attn``
(FlashAttention-2 in torch: CUDA, fp16/bf16, no dense mask, backward included);
``reference`` = ``scaled_dot_product_attention(is_causal=True)`` once per sequence, the
same maths on any device and dtype (CPU tests check the fast path's layout with it; a
``gpu`` test checks the two kernels agree on CUDA). :data:`kernel_calls` counts which
kernel each call ran.
"""

from __future__ import annotations

import collections
import inspect
import math

import torch
import torch.nn.functional as F

__all__ = ["NAME", "register", "kernel_for", "kernel_calls", "varlen_attention", "cu_seqlens"]

NAME = "polyrl_varlen"
kernel_calls: collections.Counter[str] = collections.Counter()


def register() -> None:
    """Make ``attn_implementation="polyrl_varlen"`` known to transformers (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    # Outside torch.compile's graphs (ModelConfig.compile): it reads sequence bounds on
    # the host and counts kernel_calls, and its kernel is one call either way.
    AttentionInterface.register(NAME, torch.compiler.disable(varlen_attention))
    AttentionMaskInterface.register(NAME, flash_attention_mask)


def cu_seqlens(lengths: torch.Tensor) -> torch.Tensor:
    """[N] sequence lengths -> [N + 1] int32 cumulative starts (0, l0, l0 + l1, ...)."""
    return F.pad(torch.cumsum(lengths, 0, dtype=torch.int32), (1, 0))


def _flash_varlen_fn():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:  # torch < 2.10
        return None
    return varlen_attn


def kernel_for(query: torch.Tensor) -> str:
    """``flash_varlen`` on CUDA in fp16/bf16 where torch has ``varlen_attn``, else
    ``reference``."""
    fast = query.is_cuda and query.dtype in (torch.float16, torch.bfloat16)
    return "flash_varlen" if fast and _flash_varlen_fn() is not None else "reference"


def _reference(q, k, v, cu: torch.Tensor, scale: float) -> torch.Tensor:
    """q [N, H, D], k/v [N, K, D] -> [N, H, D]: causal SDPA within each sequence."""
    out = torch.zeros_like(q)
    bounds = cu.tolist()
    for s, e in zip(bounds[:-1], bounds[1:]):
        if e > s:
            seq = [x[s:e].transpose(0, 1) for x in (q, k, v)]  # [heads, len, D]
            out[s:e] = F.scaled_dot_product_attention(
                *seq, is_causal=True, scale=scale, enable_gqa=True
            ).transpose(0, 1)
    return out


def _flash(q, k, v, cu: torch.Tensor, max_len: int, scale: float) -> torch.Tensor:
    """torch's varlen FlashAttention, across the signatures of torch 2.10 (``is_causal``,
    no ``scale``, no GQA) and later (``window_size``, ``scale``, ``enable_gqa``)."""
    fn = _flash_varlen_fn()
    params = inspect.signature(fn).parameters
    kw = {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}
    if "scale" in params:
        kw["scale"] = scale
    elif not math.isclose(scale, q.shape[-1] ** -0.5):
        q = q * (scale * q.shape[-1] ** 0.5)
    if k.shape[1] != q.shape[1]:
        if "enable_gqa" in params:
            kw["enable_gqa"] = True
        else:
            group = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    return fn(q, k, v, cu, cu, max_len, max_len, **kw)


def varlen_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    position_ids: torch.Tensor | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    max_length_q: int | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: query [B, H, L, D], key/value [B, K, L, D] ->
    ([B, L, H, D], None); see the module docstring for the three input layouts."""
    if sliding_window is not None or dropout:
        raise ValueError(
            f"ModelConfig.attn_implementation={NAME!r} supports neither sliding-window "
            f"attention (sliding_window={sliding_window}) nor attention dropout "
            f"({dropout}); use attn_implementation='sdpa' for this model"
        )
    b, h, length, d = query.shape
    scale = scaling if scaling is not None else d**-0.5
    q, k, v = (x.transpose(1, 2).reshape(b * length, x.shape[1], d) for x in (query, key, value))
    keep = None
    if cu_seq_lens_q is not None:
        cu, max_len = cu_seq_lens_q, int(max_length_q)
    elif attention_mask is not None:  # [B, L] bool, padded positions False
        mask = attention_mask[:, -length:].bool()
        keep = mask.reshape(-1).nonzero().squeeze(1)
        lengths = mask.sum(1)
        cu, max_len = cu_seqlens(lengths), int(lengths.max())
        q, k, v = q[keep], k[keep], v[keep]
    else:
        if position_ids is None:
            position_ids = torch.arange(length, device=query.device).expand(b, length)
        starts = (position_ids.reshape(-1) == 0).nonzero().squeeze(1).to(torch.int32)
        cu = torch.unique(torch.cat([starts.new_tensor([0, b * length]), starts]))
        max_len = int(cu.diff().max())
    kernel = kernel_for(query)
    kernel_calls[kernel] += 1
    if kernel == "flash_varlen":
        out = _flash(q, k, v, cu, max_len, scale)
    else:
        out = _reference(q, k, v, cu, scale)
    if keep is not None:
        out = out.new_zeros((b * length, h, d)).index_copy(0, keep, out)
    return out.reshape(b, length, h, d), None
