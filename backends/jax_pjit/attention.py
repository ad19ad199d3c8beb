"""Causal attention within segments for the JAX models: cuDNN flash attention on GPU, XLA
elsewhere.

A row of ``segment_ids`` [B, T] (int) holds one or more sequences: equal non-zero ids are
one sequence (contiguous), 0 is padding. A padded batch has ``segment_ids =
attention_mask`` (one sequence per row, padding on either side); a packed row
(``ParallelConfig.pack_sequences``) numbers its sequences 1, 2, ... A query attends to
the keys of its own sequence at or before it; padded queries produce zeros.

Implementations (``ModelConfig.attn_implementation`` through :func:`resolve`):

* ``xla``: ``jax.nn.dot_product_attention(implementation="xla")`` with the boolean mask
  causal & same segment (the [B, 1, T, T] mask and fp32 scores are materialised).
* ``xla_blocks`` (what ``xla`` becomes on CPU): the same, one call per block of
  :data:`QUERY_BLOCK` queries against the keys up to the block's last query only (every
  later key is masked for all of them, so nothing changes but the summation order): the
  masked upper triangle is never computed and no [T, T] scores are held at once; a block
  that is padding in every row (past a micro-batch's longest row) is skipped
  (``lax.cond``), forward and backward. On the 2-core CPU, forward + backward of 4 rows x
  2,064 tokens (the tiny model's heads) took 0.24 s against 0.66 s (docs/backends.md).
* ``cudnn``: cuDNN's fused flash attention (``jax._src.cudnn.fused_attention_stablehlo``,
  the kernel behind ``jax.nn.dot_product_attention(implementation="cudnn")``) in its
  packed layout: per row, each sequence's start (``q_offsets``) and length
  (``q_seqlen``), causal within each sequence, no dense mask. The public function takes
  only one right-padded sequence per row, which neither the left-padded prompts of a
  padded batch nor a packed row are, so the packed-layout entry point is called with at
  least 2 segment slots per row (1-slot calls take cuDNN's unpacked path, which ignores
  offsets). Needs a GPU, bf16/fp16, head dim <= 256 (Hopper) / 128 and a multiple of 8,
  Hopper or newer for the packed layout, cuDNN >= 9.6.
* ``auto`` and the default ``sdpa``: ``cudnn`` where it applies, else ``xla``; the reason
  it does not apply is logged once (and kept in :data:`fallbacks`).
* ``xla`` and every other name (the torch backend's ``polyrl_varlen``, ...): ``xla``.

Whatever resolves to ``xla`` runs as ``xla_blocks`` on CPU.

cuDNN is the default on GPU since it trained the shipped GRPO experiment on an H200
(2026-11-30: finite updates, the same rollout/trainer log-prob gap as XLA and as torch,
the step 16.7 s against 24.5 s with XLA, each run beside another benchmark on the host's
other GPU) and ran the 1.5B train step at 40% MFU against XLA's 24%. Before :func:`_cudnn`
masked its inputs, that GRPO run had a non-finite gradient on every step (docs/backends.md).
"""

from __future__ import annotations

import collections
import logging
from functools import partial

import jax
import jax.numpy as jnp

__all__ = [
    "QUERY_BLOCK",
    "resolve",
    "attend",
    "segment_bounds",
    "causal_segment_mask",
    "fallbacks",
]

log = logging.getLogger(__name__)

# reason -> times cuDNN was not used for it (each reason logged once)
fallbacks: collections.Counter[str] = collections.Counter()
NAMES = {"sdpa": "auto", "auto": "auto", "cudnn": "cudnn"}  # every other name: xla
QUERY_BLOCK = 256  # queries per call of ``xla_blocks``


def _fall_back(reason: str) -> None:
    if not fallbacks[reason]:
        log.info("jax_pjit attention: XLA instead of cuDNN (%s)", reason)
    fallbacks[reason] += 1


def resolve(attn_implementation: str, platform: str, dtype, probe=None) -> str:
    """``xla`` (``xla_blocks`` on CPU), ``cudnn`` (forced) or ``auto`` (cuDNN, XLA if the
    traced shapes do not fit) for ``ModelConfig.attn_implementation`` (``sdpa``, the
    default, means ``auto``) on ``platform`` with compute ``dtype``.
    ``probe``: ``(device, heads, kv_heads, head_dim)``: on a GPU, first compile and run
    a small forward + backward of the cuDNN call with the model's heads on ``device``
    (:func:`probe_cudnn`), so a cuDNN that fails only when compiling or running is found
    at start-up. A forced ``cudnn`` that cannot run raises with the reason, here or when
    the step is traced (:func:`attend`); ``auto`` falls back to ``xla``."""
    xla = "xla_blocks" if platform == "cpu" else "xla"
    wanted = NAMES.get(attn_implementation, "xla")
    if wanted == "xla":
        return xla
    reason = None
    if platform != "gpu":
        reason = f"platform is {platform!r}, cuDNN needs a CUDA GPU"
    elif jnp.dtype(dtype) not in (jnp.bfloat16, jnp.float16):
        reason = f"compute dtype is {jnp.dtype(dtype).name}, cuDNN attention needs bfloat16/float16"
    elif probe is not None:
        reason = probe_cudnn(*probe, dtype=dtype)
    if reason is None:
        return wanted
    if wanted == "cudnn":
        raise ValueError(
            f"ModelConfig.attn_implementation='cudnn': {reason}; use 'auto' (cuDNN where it "
            "applies, XLA elsewhere) or the default 'sdpa' (XLA)"
        )
    _fall_back(reason)
    return xla


def probe_cudnn(device, heads: int, kv_heads: int, head_dim: int, dtype) -> str | None:
    """None when cuDNN's packed attention compiles and runs forward and backward on
    ``device`` for these heads (two sequences and padding in a 64-token row), else why
    not. Any error counts: this runs before the model exists, to fall back cleanly."""
    seg = jnp.asarray([[1] * 32 + [2] * 16 + [0] * 16], jnp.int32)
    q = jnp.zeros((1, 64, heads, head_dim), dtype)
    kv = jnp.zeros((1, 64, kv_heads, head_dim), dtype)
    loss = lambda q, k, v: _cudnn(q, k, v, seg, 1.0, 2).astype(jnp.float32).sum()  # noqa: E731
    try:
        q, k, v = jax.device_put((q, kv, kv), device)
        jax.block_until_ready(jax.jit(jax.grad(loss, (0, 1, 2)))(q, k, v))
    except Exception as e:  # noqa: BLE001 - whatever stops cuDNN here means XLA
        return f"cuDNN probe failed: {type(e).__name__}: {str(e)[:300]}"
    return None


def causal_segment_mask(segment_ids: jax.Array, start: int = 0) -> jax.Array:
    """[B, T] -> [B, 1, T - start, T] bool, for the queries from ``start`` on against
    every key: key at or before the query, same non-zero segment."""
    t = segment_ids.shape[1]
    same = segment_ids[:, start:, None] == segment_ids[:, None, :]
    causal = jnp.arange(start, t)[:, None] >= jnp.arange(t)[None, :]
    return (same & (segment_ids[:, None, :] != 0) & causal)[:, None]


def segment_bounds(segment_ids: jax.Array, slots: int) -> tuple[jax.Array, jax.Array]:
    """[B, T] segment ids -> (starts [B, slots + 1], lengths [B, slots]) int32, -1 where a
    row has fewer sequences (cuDNN's packed-layout arguments). At most ``slots``
    sequences per row."""
    prev = jnp.pad(segment_ids[:, :-1], ((0, 0), (1, 0)))
    is_start = (segment_ids != 0) & (segment_ids != prev)
    starts = jax.vmap(lambda r: jnp.nonzero(r, size=slots + 1, fill_value=-1)[0])(is_start)
    starts = starts.astype(jnp.int32)
    first = jnp.take_along_axis(segment_ids, jnp.maximum(starts[:, :slots], 0), axis=1)
    lengths = (segment_ids[:, None, :] == first[:, :, None]).sum(-1, dtype=jnp.int32)
    return starts, jnp.where(starts[:, :slots] >= 0, lengths, -1)


def _cudnn(q, k, v, segment_ids, scale: float, slots: int) -> jax.Array:
    from jax._src.cudnn.fused_attention_stablehlo import MaskType
    from jax._src.cudnn.fused_attention_stablehlo import dot_product_attention as cudnn_attention

    # The kernel writes nothing at positions outside every sequence (padding), in the
    # output and in dq/dk/dv alike. The inputs go in through a select, whose transpose
    # drops whatever gradient the kernel left there (a product with 0 would keep a NaN).
    inside = (segment_ids != 0)[:, :, None, None]
    q, k, v = (jnp.where(inside, x, jnp.zeros((), x.dtype)) for x in (q, k, v))
    starts, lengths = segment_bounds(segment_ids, max(2, slots))
    if k.shape[2] != q.shape[2]:
        # JAX scales both q and kv packed offsets by the query's heads x head dim (its
        # _fix_seqlen_offsets), which is the key/value token stride only without GQA
        group = q.shape[2] // k.shape[2]
        k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
    out = cudnn_attention(
        q,
        k,
        v,
        q_seqlen=lengths,
        kv_seqlen=lengths,
        q_offsets=starts,
        kv_offsets=starts,
        scale=scale,
        mask_type=MaskType.PADDING_CAUSAL,
        qkv_layout="BTNH",
    )
    # positions outside every sequence are not written by the kernel
    return jnp.where((segment_ids != 0)[:, :, None, None], out, 0)


def attend(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segment_ids: jax.Array,
    *,
    scale: float,
    implementation: str,
    slots: int = 1,
    block: int = QUERY_BLOCK,
) -> jax.Array:
    """q [B, T, H, D], k/v [B, T, K, D] (K divides H) -> [B, T, H, D]. ``slots``: most
    sequences in one row (static; 1 for a padded batch). ``implementation``: from
    :func:`resolve`; ``block``: queries per call of ``xla_blocks``."""
    if implementation in ("cudnn", "auto"):
        try:
            return _cudnn(q, k, v, segment_ids, scale, slots)
        # checked while tracing (TypeError/ImportError: a JAX without this entry point)
        except (NotImplementedError, ValueError, RuntimeError, TypeError, ImportError) as e:
            if implementation == "cudnn":
                raise ValueError(
                    f"ModelConfig.attn_implementation='cudnn': cuDNN cannot run this "
                    f"attention ({type(e).__name__}: {e}); use 'auto' or the default 'sdpa' (XLA)"
                ) from e
            _fall_back(f"{type(e).__name__}: {e}")
    t = q.shape[1]
    blocks = implementation == "xla_blocks" and t > block  # else one call, as ``xla``
    step = block if blocks else t

    def part(q, k, v, seg, start):  # queries [start, end) see keys [0, end) only
        return jax.nn.dot_product_attention(
            q, k, v, mask=causal_segment_mask(seg, start), scale=scale, implementation="xla"
        )

    def run(s: int) -> jax.Array:
        args = (q[:, s : s + step], k[:, : s + step], v[:, : s + step], segment_ids[:, : s + step])
        if not blocks:
            return part(*args, s)
        # a block of padding in every row (a micro-batch's longest row ends before it) is
        # zeros, computed or not: skip it, forward and backward
        return jax.lax.cond(
            jnp.any(segment_ids[:, s : s + step] != 0),
            partial(part, start=s),
            lambda q, *_: jnp.zeros_like(q),
            *args,
        )

    out = jnp.concatenate([run(s) for s in range(0, t, step)], axis=1)
    return jnp.where((segment_ids != 0)[:, :, None, None], out, 0)
